"""How a new policy version travels from the learner to the inference workers.

- `stream` (what auto picks): the learner keeps its newest version in memory, as one buffer in the engines'
  dtype, and a `WeightServer` thread of its own sends that buffer to any inference worker that connects; Redis
  carries only the announcement (version, address, a random token). A worker reads the bytes straight into
  memory and hands the tensors to its engine: no file, no copy in Redis, one pass over the bytes on each side.
- `disk`: the learner writes a safetensors file under the run directory and publishes its path. Every
  inference worker must see that path: one machine, or a filesystem the nodes share. The learner deletes a version
  once KEEP_VERSIONS newer ones are out, which the staleness gate does not forbid while a worker is still to load it
  (max_head_offpolicyness above 2): a worker opens the file before its engine is touched, and one that finds it gone
  keeps serving what it holds and loads the newest announcement next.

Why a server the workers pull from, rather than a `torch.distributed` broadcast: it needs no peer to be alive at
the moment of publishing. A worker restarted on another node, or one that joins late, connects whenever it comes
up and gets the newest version, while a broadcast needs every member of a fixed group at once (one dead worker
stalls the learner) and a new group formed on every restart. The learner never waits on a worker: publishing
costs it one cast-and-copy of the weights and their checksum.

The stream is a pipeline: the learner announces a version before copying it, a connection sends each tensor as
soon as it is copied (the checksum follows the bytes), the worker's receiving thread computes each tensor's part of
the checksum as it lands, and an engine that loads tensor by tensor (`GenerationBackend.loads_as_they_arrive`)
takes each one as it arrives. A tied tensor (an output head that is the embedding) is sent once.

Atomic for generation: a connection sends the one buffer it took when it was accepted, whole, with that buffer's
version in its header; a newer version only replaces the server's reference. The worker loads what the header
names, with no sequence running. It keeps the newest whole version it received in one buffer while the next
arrives in another, so if a transfer breaks off mid-load (the learner died), the engine's load completes from the
held version and the worker loads the held version whole again before it generates: it never serves half of one
version and half of another. A worker that cannot reach the learner (it is restarting from a checkpoint), or whose
transfer breaks off, keeps serving the version it has, says so in its log, and tries again after a wait that doubles
with each failure (a newer announcement at once).

The listener answers only a worker that sends the token announced on the password-protected bus; until a peer has
sent it, the server reads at most a small frame, within one short deadline, and holds a bounded number of
connections.
"""

import contextlib
import hmac
import logging
import secrets
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
from safetensors.torch import load_file

from rlsys import protocol
from rlsys.api.messages import MAX_PATH_CHARS, WEIGHT_DTYPES, InvalidMessage, fields, integer, integers, items, \
    string
from rlsys.engine.weights import WEIGHTS_FILE, write_weight_update
from rlsys.weight_checksum import ChecksumParts, weights_checksum
from rlsys.weight_versions import version_directory

log = logging.getLogger(__name__)

KEEP_VERSIONS = 3  # disk: a worker opens a version just after reading its announcement; one deleted by then is skipped
ALIGN = 64  # bytes: every tensor in the buffer starts aligned, so it can be viewed in place as its dtype
IO_TIMEOUT = 30.0  # seconds without progress after which a transfer counts as broken off
HANDSHAKE_SECONDS = 5.0  # to connect, ask and have the header: a learner slower than this is hung or unreachable
RETRY_SECONDS = 1.0  # a worker tries an announcement it could not fetch again after this, doubled on each failure
MAX_RETRY_SECONDS = 30.0  # ... up to this: each try of a hung learner holds the engine's thread for a handshake
SEND_BYTES = 8 << 20  # sent at a time: a socket's timeout bounds a whole sendall, so each must be short
MAX_CONNECTIONS = 256  # at once; a worker holds one, and one more while a newer version arrives
_LENGTH = struct.Struct(">I")  # the length of each msgpack frame (request, header)
MAX_FRAME_BYTES = 64 << 20  # a header longer than this is not one of ours
MAX_REQUEST_BYTES = 1024  # a request is a token: read before the token is checked, so it stays small
MAX_BYTES = 2**63 - 1  # a header's sizes and offsets: torch's (int64)
MAX_DIMENSIONS = 64  # of a tensor in a header


def resolve(cluster) -> str:
    """The transport `cluster.weights_transport` names; auto is the stream."""
    return "stream" if cluster.weights_transport == "auto" else cluster.weights_transport


def serving_host(backend: str) -> str:
    """Where the learner's weight server listens: loopback on one machine, this node's address under Ray (the
    workers may be on other nodes)."""
    if backend == "ray":
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


@dataclass
class Received:
    """One version as a worker got it: tensors in memory (stream; an `Incoming` while they still arrive) or in its
    opened file (disk), with the checksum the learner computed over them in `dtype` (empty when the
    publisher sent none) and, streamed, the checksum of the bytes that arrived."""

    version: int
    weights: "dict[str, torch.Tensor] | Incoming"
    checksum: str = ""
    dtype: str = ""
    buffer: torch.Tensor | None = None  # streamed: the memory the tensors are views of
    layout: list | None = None  # streamed: [name, dtype, shape, start, bytes] of each tensor in the buffer
    arrived_checksum: str = ""


class _Offer:
    """One version as the server offers it: a buffer the learner fills tensor by tensor, announced before it is
    full, so a connection sends each tensor as soon as it is copied; the checksum follows the bytes."""

    def __init__(self, header: dict, buffer: torch.Tensor):
        self.header, self.buffer = _frame(header), buffer
        self.size = header["bytes"]
        self.filled = 0  # bytes of the buffer written
        self.checksum: str | None = None  # once every tensor is written
        self.failed = False  # the learner's copy raised: connections break off, workers keep what they hold
        self.changed = threading.Condition()

    def mark(self, filled: int, checksum: str | None = None, failed: bool = False) -> None:
        with self.changed:
            self.filled, self.checksum, self.failed = filled, checksum, failed
            self.changed.notify_all()

    def wait_beyond(self, sent: int) -> int:
        """Bytes written once more than `sent` are (or the checksum is, when all are); raises if the copy failed."""
        with self.changed:
            while not self.failed and self.filled <= sent and (self.checksum is None or sent < self.size):
                self.changed.wait(IO_TIMEOUT)
            if self.failed:
                raise OSError("the learner could not copy this version")
            return self.filled


class WeightServer:
    """The learner's side of `stream`: serves its newest version to every inference worker that asks."""

    def __init__(self, host: str = "127.0.0.1"):
        self.token = secrets.token_hex(16)  # announced over the password-protected bus only
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._offer: _Offer | None = None
        # A buffer no longer offered nor being sent, written again by the next offer: a fresh one of a model's size
        # costs a page fault per 4 KiB, as much as the copy itself.
        self._spare: torch.Tensor | None = None
        self._sending: dict[int, int] = {}  # id(buffer) -> connections sending it
        self._closed = False
        self._senders: dict[threading.Thread, socket.socket] = {}  # each connection's thread (under _lock)
        self._accepting = threading.Thread(target=self._accept, name="weight-server", daemon=True)
        self._accepting.start()

    def offer(self, version: int, state_dict: dict[str, torch.Tensor], dtype: str,
              announce: Callable[[], None] = lambda: None) -> str:
        """From now on serve `state_dict` cast to `dtype` as `version`; returns its checksum.

        `announce` is called once the version is offered and before it is copied: workers that connect then receive
        each tensor as soon as it is copied, and the learner's copy overlaps their transfer. It returns once every
        tensor is copied, so the learner may change its weights after."""
        cast = getattr(torch, dtype)
        entries, offset, placed = [], 0, {}
        for name, t in state_dict.items():
            t_dtype = cast if t.is_floating_point() else t.dtype
            nbytes = t.numel() * t_dtype.itemsize
            # A tied tensor (the output head that is the embedding) is one memory under two names: sent once.
            alias = placed.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), (name, offset))
            entries.append((name, t, t_dtype, alias[1], nbytes, alias[0]))
            if alias[0] == name:
                offset += -(-nbytes // ALIGN) * ALIGN
        on_gpu = any(t.is_cuda for t in state_dict.values())
        with self._lock:
            buffer, self._spare = self._spare, None
        if buffer is None or buffer.numel() != offset or buffer.is_pinned() != on_gpu:
            buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=on_gpu)
        header = {"version": version, "dtype": dtype, "bytes": offset,
                  "tensors": [[name, str(t_dtype).removeprefix("torch."), list(t.shape), start, nbytes]
                              for name, t, t_dtype, start, nbytes, _ in entries]}
        offer = _Offer(header, buffer)
        with self._lock:
            previous, self._offer = self._offer, offer
            if previous is not None and not self._sending.get(id(previous.buffer)):
                self._spare = previous.buffer
        try:
            announce()
            checksum = self._fill(offer, entries, state_dict, dtype, on_gpu)
        except BaseException:  # connections to this offer break off instead of waiting for bytes that never come
            offer.mark(offer.filled, failed=True)
            raise
        return checksum

    @staticmethod
    def _fill(offer: _Offer, entries: list, state_dict: dict, dtype: str, on_gpu: bool) -> str:
        """The cast and the host copy in one pass per tensor, each tensor offered as soon as it is copied."""
        tensors = {name: _view(offer.buffer, t_dtype, t.shape, start, nbytes)
                   for name, t, t_dtype, start, nbytes, _ in entries}
        if on_gpu:  # to pinned memory without a wait each, the checksum computed on the GPU meanwhile; one wait
            for name, t, *_, first in entries:
                if first == name:
                    tensors[name].copy_(t.detach(), non_blocking=True)
            checksum = weights_checksum(state_dict, dtype)
            torch.cuda.synchronize()
            offer.mark(offer.size, checksum)
            return checksum
        parts = ChecksumParts()
        for name, t, t_dtype, start, nbytes, first in entries:
            if first == name:
                tensors[name].copy_(t.detach())
                offer.mark(min(start + -(-nbytes // ALIGN) * ALIGN, offer.size))
                parts.add(name, tensors[name])  # while the bytes go out
            else:
                parts.alias(name, first)
        checksum = parts.digest()
        offer.mark(offer.size, checksum)
        return checksum

    def close(self) -> None:
        """Stops serving, and returns once the server's threads have ended and its buffers are freed. A thread of
        ours left to end while the interpreter exits would free them then: freeing a tensor there retakes the GIL
        inside torch's C++, where CPython ends the thread, and that aborts the process ("terminate called without
        an active exception", seen at the learner role's exit)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone leaves it listening)
        self._listener.close()
        self._accepting.join(IO_TIMEOUT)
        with self._lock:
            senders = dict(self._senders)
        for connection in senders.values():
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)  # a transfer in flight breaks off now, not at its timeout
        for thread in senders:
            thread.join(IO_TIMEOUT)
        with self._lock:
            self._offer = self._spare = None

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            sender = threading.Thread(target=self._serve, args=(connection,), name="weight-send", daemon=True)
            with self._lock:  # the ended ones go: a thread is joined by close even once it left _serve
                self._senders = {t: c for t, c in self._senders.items() if t.is_alive()}
                if len(self._senders) >= MAX_CONNECTIONS:
                    connection.close()  # no thread or memory for a connection past the limit
                    continue
                self._senders[sender] = connection
            sender.start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                # Before the token is checked a peer gets a small frame and one deadline for all of it.
                request = _read_frame(connection, MAX_REQUEST_BYTES, time.monotonic() + HANDSHAKE_SECONDS)
                connection.settimeout(IO_TIMEOUT)
                if not (isinstance(request, dict) and isinstance(request.get("token"), str)
                        and hmac.compare_digest(request["token"].encode(), self.token.encode())):
                    connection.sendall(_frame({"error": "wrong token"}))
                    return
                with self._lock:
                    offer = self._offer
                    if offer is not None:
                        self._sending[id(offer.buffer)] = self._sending.get(id(offer.buffer), 0) + 1
                if offer is None:
                    connection.sendall(_frame({"error": "no version published yet"}))
                    return
                try:
                    connection.sendall(offer.header)
                    data, sent = memoryview(offer.buffer.numpy()), 0
                    while sent < offer.size:
                        filled = offer.wait_beyond(sent)
                        for start in range(sent, filled, SEND_BYTES):  # the GIL is released while bytes go out
                            connection.sendall(data[start:min(start + SEND_BYTES, filled)])
                        sent = filled
                    offer.wait_beyond(sent)
                    connection.sendall(_frame({"checksum": offer.checksum}))
                finally:
                    self._sent(offer.buffer)
            except (OSError, ValueError, TypeError, msgpack.UnpackException) as e:
                log.info("a weight transfer to a worker broke off: %s", e)

    def _sent(self, buffer: torch.Tensor) -> None:
        """A connection is done with `buffer`: the last one makes it the spare unless it is still offered."""
        with self._lock:
            self._sending[id(buffer)] -= 1
            if not self._sending[id(buffer)]:
                del self._sending[id(buffer)]
                if self._offer is None or self._offer.buffer is not buffer:
                    self._spare = buffer


class Incoming:
    """A version arriving over the stream: a thread reads its tensors in buffer order and (`checksum_arrived`)
    computes each one's part of the checksum as it lands, while an engine that loads tensor by tensor takes them
    from `items`."""

    def __init__(self, connection: socket.socket, header: dict, buffer: torch.Tensor, held: Received | None,
                 source: str, checksum_arrived: bool = True):
        self.version, self.dtype, self.buffer, self.source = header["version"], header["dtype"], buffer, source
        self.checksum_arrived = checksum_arrived  # else `arrived_checksum` stays empty: the engine's own is checked
        self.layout = header["tensors"]
        self.tensors = {name: _view(buffer, getattr(torch, dtype), shape, start, nbytes)
                        for name, dtype, shape, start, nbytes in self.layout}
        self.held = held  # a whole earlier version of this layout: what `items` gives if this one breaks off
        self.checksum = ""  # the learner's, from the trailer
        self.arrived_checksum = ""  # of the bytes that arrived
        self.error: Exception | None = None
        self._arrived = 0  # tensors whose bytes are all here
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._receive, args=(connection,), name="weight-receive", daemon=True)
        self._thread.start()

    def items(self):
        """(name, tensor) in buffer order, each once its bytes are here. If the transfer breaks off, the rest come
        from the held version, so the engine's load always completes; `whole` then raises, and the worker loads the
        held version whole again (the engine holds a mix of two versions until then, with nothing generating)."""
        for i, (name, tensor) in enumerate(self.tensors.items()):
            with self._changed:
                while self._arrived <= i and self.error is None:
                    self._changed.wait()
            yield (name, tensor) if self.error is None else (name, self.held.weights[name])

    def whole(self) -> Received:
        """This version once every byte and the checksum arrived; raises OSError if the transfer broke off."""
        self._thread.join()
        if self.error is not None:
            raise OSError(f"the transfer of version {self.version} broke off: {self.error}") from self.error
        return Received(self.version, self.tensors, self.checksum, self.dtype, self.buffer, self.layout,
                        self.arrived_checksum)

    def _receive(self, connection: socket.socket) -> None:
        parts = ChecksumParts()
        try:
            with connection:
                view, received, first_at = memoryview(self.buffer.numpy()), 0, {}
                for name, dtype, shape, start, nbytes in self.layout:  # in buffer order
                    end = min(start + -(-nbytes // ALIGN) * ALIGN, len(view))  # a tied tensor's: the first one's
                    if end > received:
                        _read_into(connection, view[received:end])  # the tensor and the alignment after it
                        received = end
                    with self._changed:
                        self._arrived += 1
                        self._changed.notify_all()
                    if not self.checksum_arrived:
                        continue
                    # a tied tensor has the first one's place, dtype and shape; an empty one shares only its place
                    first = first_at.setdefault((start, dtype, tuple(shape)), name)
                    if first == name:
                        parts.add(name, self.tensors[name])
                    else:
                        parts.alias(name, first)
                if received != len(view):
                    raise ValueError(f"the header's tensors end at byte {received} of {len(view)}")
                trailer = _read_frame(connection)
                if not isinstance(trailer, dict) or not isinstance(trailer.get("checksum"), str):
                    raise ValueError(f"the transfer ended with {trailer!r} where the checksum belongs")
                self.checksum = trailer["checksum"]
                self.arrived_checksum = parts.digest() if self.checksum_arrived else ""
        except Exception as e:  # whatever ends this thread must reach `items` and `whole`, or the engine waits forever
            with self._changed:
                self.error = e
                self._changed.notify_all()


def fetch(address: str, token: str, into: torch.Tensor | None = None) -> Received:
    """The newest version `address` serves, read whole into memory (into `into` if it has the size: the tensors are
    then views of it); raises OSError if it cannot be had whole now."""
    return _open(address, token, into, held=None).whole()


def _open(address: str, token: str, into: torch.Tensor | None, held: Received | None,
          checksum_arrived: bool = True, pinned: bool = False) -> Incoming:
    """The transfer of the newest version `address` serves, started (into `into` if it has the size; else a new
    buffer, in pinned memory if `pinned`)."""
    host, port = address.rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=HANDSHAKE_SECONDS)
    try:
        connection.sendall(_frame({"token": token}))
        header = _read_frame(connection, MAX_FRAME_BYTES, time.monotonic() + HANDSHAKE_SECONDS)
        if isinstance(header, dict) and "error" in header:
            raise ConnectionError(f"the weight server at {address} refused: {header}")
        header = _parse_header(header)  # InvalidMessage (a ValueError) naming the field
        connection.settimeout(IO_TIMEOUT)
        size = header["bytes"]
        buffer = (into if into is not None and into.numel() == size
                  else torch.empty(size, dtype=torch.uint8, pin_memory=pinned))  # RuntimeError if out of memory
        return Incoming(connection, header, buffer, held, address, checksum_arrived)  # its thread owns it from here
    except BaseException:
        connection.close()
        raise


def publish(bus, model: torch.nn.Module, version: int, transport: str, weights_dir: Path,
            state_dict: dict | None = None, dtype: str = "float32", server: WeightServer | None = None,
            extra: dict | None = None) -> None:
    """Version `version` of `model` (its `state_dict` if given: one gathered from the learner's shards) made
    available to every inference worker in `dtype`, then announced on the bus with `extra` fields.

    stream needs the learner's `server` and announces before copying (the copy overlaps the transfers); disk writes
    under `weights_dir` and announces the checksum with the path."""
    state = model.state_dict() if state_dict is None else state_dict
    if transport == "stream":
        server.offer(version, state, dtype, announce=lambda: bus.set(protocol.WEIGHTS, {
            "version": version, "address": server.address, "token": server.token, **(extra or {})}))
        return
    path = write_weight_update(model, version_directory(weights_dir, version), state)
    bus.set(protocol.WEIGHTS, {"version": version, "path": str(path), "dtype": dtype,
                               "checksum": weights_checksum(state, dtype), **(extra or {})})
    shutil.rmtree(version_directory(weights_dir, version - KEEP_VERSIONS), ignore_errors=True)


class WeightReceiver:
    """The inference worker's side: a published version, as something its engine can load.

    Two buffers take turns: the newest whole version stays in one (`held`) while the next arrives in the other, so
    an engine may load the next tensor by tensor as it arrives and still go back if the transfer breaks off.

    `checksum_arrived`: compute the checksum of the bytes that arrive, for an engine that cannot list the tensors it
    holds (`given_checksum`); one that can has those checked, and the receiving thread reads each tensor once less.
    `pinned`: the buffers in pinned memory, from which a GPU engine copies without waiting for each copy."""

    def __init__(self, checksum_arrived: bool = True, pinned: bool = False):
        self.checksum_arrived, self.pinned = checksum_arrived, pinned
        self.received_streamed = 0  # versions that arrived over the stream
        self.failed_fetches = 0  # transfers that could not be had whole (the learner restarting, a broken link)
        self.held: Received | None = None  # the newest version streamed whole
        self._spare: torch.Tensor | None = None  # the other buffer
        self._failed: tuple[str, int, float, int] | None = None  # (address, version, next try at, failures so far)

    def receive(self, published, as_they_arrive: bool = False) -> Received | None:
        """`published` (rlsys.api.messages.PublishedWeights) as loadable weights; None if it cannot be had now.

        `as_they_arrive`: when a whole version of the same layout is held, return as soon as the transfer starts,
        with `weights` the `Incoming` tensors; `settle` it once they are loaded. Otherwise return it whole."""
        announcement = (published.path or published.address, published.version)
        if self._failed and self._failed[:2] == announcement and time.monotonic() < self._failed[2]:
            return None  # not yet time to try this announcement again
        if published.path:
            # Opened here, not by the engine: a file the learner deletes once it is open stays readable, and one it
            # deleted before fails now, with the engine untouched (vLLM's reload fails halfway, its layers emptied).
            try:
                tensors = load_file(f"{published.path}/{WEIGHTS_FILE}")
            except OSError as e:
                self._fetch_failed(announcement, e)
                return None
            return Received(published.version, tensors, published.checksum, published.dtype)
        try:
            incoming = _open(published.address, published.token, self._spare, self.held, self.checksum_arrived,
                             self.pinned)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, msgpack.UnpackException) as e:
            self._fetch_failed(announcement, e)  # RuntimeError: no memory for the buffer; the held version serves on
            return None
        self._spare = None  # the incoming version's buffer now
        arriving = Received(incoming.version, incoming, dtype=incoming.dtype, buffer=incoming.buffer)
        if as_they_arrive and self.held is not None and self.held.layout == incoming.layout:
            return arriving
        return self.settle(arriving)

    def settle(self, received: Received) -> Received | None:
        """`received` once it is whole, after an engine loaded it as it arrived: with its checksums, and now the held
        version; None if the transfer broke off (the engine then holds part of it and part of `held`: load `held`
        again). A version that was whole already is returned as it is."""
        if not isinstance(incoming := received.weights, Incoming):
            return received
        try:
            whole = incoming.whole()
        except OSError as e:
            self._spare = incoming.buffer
            self._fetch_failed((incoming.source, incoming.version), e)
            return None
        self._failed = None
        self.received_streamed += 1
        if self.held is not None:
            self._spare = self.held.buffer
        self.held = whole
        return whole

    def _fetch_failed(self, announcement: tuple[str, int], error: Exception) -> None:
        """Tries of one announcement come RETRY_SECONDS apart, doubled on each failure up to MAX_RETRY_SECONDS: a
        learner that never answers costs the worker's engine a handshake's wait now and then, not most of its time."""
        times = self._failed[3] + 1 if self._failed and self._failed[:2] == announcement else 1
        if times == 1:  # one line per announcement, not per retry
            log.warning("could not fetch version %d from the learner at %s (%s); serving the weights held and trying "
                        "again, from %.0f s apart to %.0f s", announcement[1], announcement[0], error, RETRY_SECONDS,
                        MAX_RETRY_SECONDS)
        wait = min(RETRY_SECONDS * 2 ** (times - 1), MAX_RETRY_SECONDS)
        self._failed = (*announcement, time.monotonic() + wait, times)
        self.failed_fetches += 1


def given_checksum(received: Received, held: dict | None = None) -> str:
    """The checksum to compare with the learner's: of `held`, the tensors an engine holds after loading `received`,
    or where it cannot list them (None), of what it was given: the bytes that arrived, or the file's tensors."""
    if held is not None:
        return weights_checksum(held, received.dtype)
    if received.arrived_checksum:  # streamed
        return received.arrived_checksum
    if received.buffer is not None:
        raise ValueError("a streamed version's checksum needs the engine's tensors, or WeightReceiver(checksum_arrived"
                         "=True) for an engine that cannot list them")
    return weights_checksum(received.weights, received.dtype)


def _parse_header(header) -> dict:
    """A weight server's header checked as a bus message is (rlsys/api/messages.py): one from another rlsys, say,
    is refused naming the field, and the worker keeps serving what it holds, instead of dying on a dtype torch
    lacks or a version that is no integer."""
    d = fields(header, "the weight server's header", {"version", "dtype", "bytes", "tensors"})
    integer(d["version"], "version")
    if not isinstance(d["dtype"], str) or d["dtype"] not in WEIGHT_DTYPES:
        raise InvalidMessage(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {d['dtype']!r:.60}")
    integer(d["bytes"], "bytes", high=MAX_BYTES)
    items(d["tensors"], "tensors", _tensor_entry)
    return d


def _tensor_entry(entry, where: str) -> list:
    """[name, dtype, shape, start, bytes] of one tensor in a header."""
    if not isinstance(entry, list) or len(entry) != 5:
        raise InvalidMessage(f"{where} must be [name, dtype, shape, start, bytes], got {type(entry).__name__}")
    name, dtype, shape, start, nbytes = entry
    string(name, f"{where} name", MAX_PATH_CHARS)
    if not isinstance(getattr(torch, string(dtype, f"{where} dtype"), None), torch.dtype):
        raise InvalidMessage(f"{where} dtype must name a torch dtype, got {dtype!r:.60}")
    integers(shape, f"{where} shape", high=MAX_BYTES, max_items=MAX_DIMENSIONS)
    integer(start, f"{where} start", high=MAX_BYTES)
    integer(nbytes, f"{where} bytes", high=MAX_BYTES)
    return entry


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape, start: int, nbytes: int) -> torch.Tensor:
    return buffer[start:start + nbytes].view(dtype).view(tuple(shape))


def _frame(message: dict) -> bytes:
    data = msgpack.packb(message)
    return _LENGTH.pack(len(data)) + data


def _read_frame(connection: socket.socket, max_bytes: int = MAX_FRAME_BYTES, deadline: float | None = None):
    """One msgpack frame of at most `max_bytes`, all of it by `deadline` (monotonic) if given."""
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size, deadline))
    if length > max_bytes:
        raise ValueError(f"a frame of {length} bytes is longer than {max_bytes}")
    return msgpack.unpackb(_read_exactly(connection, length, deadline))


def _read_exactly(connection: socket.socket, n: int, deadline: float | None = None) -> bytes:
    data = bytearray(n)
    _read_into(connection, memoryview(data), deadline)
    return bytes(data)


def _read_into(connection: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the other side took too long to say what it wants")
            connection.settimeout(left)
        got = connection.recv_into(view)
        if got == 0:
            raise ConnectionError("the connection closed before the whole transfer arrived")
        view = view[got:]
