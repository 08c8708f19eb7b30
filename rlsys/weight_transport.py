"""How a new policy version travels from the learner to the inference workers.

- `stream` (what auto picks): the learner keeps its newest version in memory, as one buffer in the engines'
  dtype, and a `WeightServer` thread of its own sends that buffer to any inference worker that connects; Redis
  carries only the announcement (version, address, a random token). A worker reads the bytes straight into
  memory and hands the tensors to its engine: no file, no copy in Redis, one pass over the bytes on each side.
- `disk`: the learner writes a safetensors file under the run directory and publishes its path. Every
  inference worker must see that path: one machine, or a filesystem the nodes share.

Why a server the workers pull from, rather than a `torch.distributed` broadcast: it needs no peer to be alive at
the moment of publishing. A worker restarted on another node, or one that joins late, connects whenever it comes
up and gets the newest version, while a broadcast needs every member of a fixed group at once (one dead worker
stalls the learner) and a new group formed on every restart. The learner never waits on a worker: publishing
only swaps the buffer the server thread sends, so it costs one cast-and-copy of the weights and their checksum.
A worker that cannot reach the learner (it is restarting from a checkpoint), or whose transfer breaks off, keeps
serving the version it has, says so in its log, and tries the newest announcement at its next check.

Atomic for generation: a connection sends the one buffer it took when it was accepted, whole, with that buffer's
version and checksum in its header; a newer version only replaces the server's reference. The worker loads
what the header names, so it never holds half of one version and half of another.
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
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from rlsys import protocol
from rlsys.engine.weights import write_weight_update
from rlsys.weight_checksum import weights_checksum

log = logging.getLogger(__name__)

KEEP_VERSIONS = 3  # disk: an inference worker may still be reading a slightly older version
ALIGN = 64  # bytes: every tensor in the buffer starts aligned, so it can be viewed in place as its dtype
IO_TIMEOUT = 30.0  # seconds without progress after which a transfer counts as broken off
RETRY_SECONDS = 1.0  # a worker tries an announcement it could not fetch again at most this often
_LENGTH = struct.Struct(">I")  # the length of each msgpack frame (request, header)
MAX_FRAME_BYTES = 64 << 20  # a request or header longer than this is not one of ours


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
    """One version as a worker got it: tensors in memory (stream) or the directory of its file (disk), with the
    checksum the learner computed over them in `dtype` (empty when the publisher sent none)."""

    version: int
    weights: dict[str, torch.Tensor] | str
    checksum: str = ""
    dtype: str = ""
    buffer: torch.Tensor | None = None  # streamed: the memory the tensors are views of


class WeightServer:
    """The learner's side of `stream`: serves its newest version to every inference worker that asks."""

    def __init__(self, host: str = "127.0.0.1"):
        self.token = secrets.token_hex(16)  # announced over the password-protected bus only
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._offer: tuple[bytes, torch.Tensor] | None = None  # (header frame, buffer)
        # A buffer no longer offered nor being sent, written again by the next offer: a fresh one of a model's size
        # costs a page fault per 4 KiB, as much as the copy itself.
        self._spare: torch.Tensor | None = None
        self._sending: dict[int, int] = {}  # id(buffer) -> connections sending it
        self._closed = False
        threading.Thread(target=self._accept, name="weight-server", daemon=True).start()

    def offer(self, version: int, state_dict: dict[str, torch.Tensor], dtype: str) -> str:
        """From now on serve `state_dict` cast to `dtype` as `version`; returns its checksum."""
        cast = getattr(torch, dtype)
        entries, offset = [], 0
        for name, t in state_dict.items():
            t_dtype = cast if t.is_floating_point() else t.dtype
            nbytes = t.numel() * t_dtype.itemsize
            entries.append((name, t, t_dtype, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        # A GPU model's tensors go to pinned memory without a wait each, and its checksum is computed on the GPU
        # (the host has one core for it) while they travel; one wait before the buffer is offered.
        on_gpu = any(t.is_cuda for t in state_dict.values())
        with self._lock:
            buffer, self._spare = self._spare, None
        if buffer is None or buffer.numel() != offset or buffer.is_pinned() != on_gpu:
            buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=on_gpu)
        tensors = {name: _view(buffer, t_dtype, t.shape, start, nbytes) for name, t, t_dtype, start, nbytes in entries}
        for name, t, *_ in entries:
            tensors[name].copy_(t.detach(), non_blocking=on_gpu)  # the cast and the host copy in one pass
        checksum = weights_checksum(state_dict, dtype) if on_gpu else weights_checksum(tensors)
        if on_gpu:
            torch.cuda.synchronize()
        header = {"version": version, "checksum": checksum, "dtype": dtype, "bytes": offset,
                  "tensors": [[name, str(t_dtype).removeprefix("torch."), list(t.shape), start, nbytes]
                              for name, t, t_dtype, start, nbytes in entries]}
        with self._lock:
            previous, self._offer = self._offer, (_frame(header), buffer)
            if previous is not None and not self._sending.get(id(previous[1])):
                self._spare = previous[1]
        return checksum

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone leaves it listening)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), name="weight-send", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(IO_TIMEOUT)
            try:
                request = _read_frame(connection)
                if not (isinstance(request, dict) and isinstance(request.get("token"), str)
                        and hmac.compare_digest(request["token"], self.token)):
                    connection.sendall(_frame({"error": "wrong token"}))
                    return
                with self._lock:
                    offer = self._offer
                    if offer is not None:
                        self._sending[id(offer[1])] = self._sending.get(id(offer[1]), 0) + 1
                if offer is None:
                    connection.sendall(_frame({"error": "no version published yet"}))
                    return
                try:
                    connection.sendall(offer[0])
                    connection.sendall(memoryview(offer[1].numpy()))  # the GIL is released while the bytes go out
                finally:
                    self._sent(offer[1])
            except (OSError, ValueError, msgpack.UnpackException) as e:
                log.info("a weight transfer to a worker broke off: %s", e)

    def _sent(self, buffer: torch.Tensor) -> None:
        """A connection is done with `buffer`: the last one makes it the spare unless it is still offered."""
        with self._lock:
            self._sending[id(buffer)] -= 1
            if not self._sending[id(buffer)]:
                del self._sending[id(buffer)]
                if self._offer is None or self._offer[1] is not buffer:
                    self._spare = buffer


def fetch(address: str, token: str, into: torch.Tensor | None = None) -> Received:
    """The newest version `address` serves, read into memory (into `into` if it has the size: the tensors are then
    views of it); raises OSError if it cannot be had whole now."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=IO_TIMEOUT) as connection:
        connection.sendall(_frame({"token": token}))
        header = _read_frame(connection)
        if not isinstance(header, dict) or "error" in header:
            raise ConnectionError(f"the weight server at {address} refused: {header}")
        buffer = into if into is not None and into.numel() == header["bytes"] else torch.empty(header["bytes"],
                                                                                               dtype=torch.uint8)
        _read_into(connection, memoryview(buffer.numpy()))
    tensors = {name: _view(buffer, getattr(torch, dtype), shape, start, nbytes)
               for name, dtype, shape, start, nbytes in header["tensors"]}
    return Received(header["version"], tensors, header["checksum"], header["dtype"], buffer)


def publish(bus, model: torch.nn.Module, version: int, transport: str, weights_dir: Path,
            state_dict: dict | None = None, dtype: str = "float32", server: WeightServer | None = None,
            extra: dict | None = None) -> None:
    """Version `version` of `model` (its `state_dict` if given: one gathered from the learner's shards) made
    available to every inference worker in `dtype`, then announced on the bus with `extra` fields.

    stream needs the learner's `server`; disk writes under `weights_dir` and announces the checksum with the path."""
    state = model.state_dict() if state_dict is None else state_dict
    if transport == "stream":
        server.offer(version, state, dtype)
        bus.set(protocol.WEIGHTS, {"version": version, "address": server.address, "token": server.token,
                                   **(extra or {})})
        return
    path = write_weight_update(model, Path(weights_dir) / f"v{version}", state)
    bus.set(protocol.WEIGHTS, {"version": version, "path": str(path), "dtype": dtype,
                               "checksum": weights_checksum(state, dtype), **(extra or {})})
    shutil.rmtree(Path(weights_dir) / f"v{version - KEEP_VERSIONS}", ignore_errors=True)


class WeightReceiver:
    """The inference worker's side: a published version, as something its engine can load.

    Streamed tensors are views of one buffer that the next `receive` fills again (engines copy what they load)."""

    def __init__(self):
        self.received_streamed = 0  # versions that arrived over the stream
        self.failed_fetches = 0  # transfers that could not be had whole (the learner restarting, a broken link)
        self._buffer: torch.Tensor | None = None
        self._failed: tuple[str, int, float] | None = None  # (address, version, when) of the last failed fetch

    def receive(self, published) -> Received | None:
        """`published` (rlsys.api.messages.PublishedWeights) as loadable weights; None if it cannot be had now."""
        if published.path:
            return Received(published.version, published.path, published.checksum, published.dtype)
        announcement = (published.address, published.version)
        if self._failed and self._failed[:2] == announcement and time.monotonic() - self._failed[2] < RETRY_SECONDS:
            return None
        try:
            received = fetch(published.address, published.token, self._buffer)
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            if not self._failed or self._failed[:2] != announcement:  # one line per announcement, not per retry
                log.warning("could not fetch version %d from the learner at %s (%s); serving the weights held and "
                            "trying again every %.0f s", published.version, published.address, e, RETRY_SECONDS)
            self._failed = (*announcement, time.monotonic())
            self.failed_fetches += 1
            return None
        self._failed = None
        self.received_streamed += 1
        self._buffer = received.buffer
        return received


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape, start: int, nbytes: int) -> torch.Tensor:
    return buffer[start:start + nbytes].view(dtype).view(tuple(shape))


def _frame(message: dict) -> bytes:
    data = msgpack.packb(message)
    return _LENGTH.pack(len(data)) + data


def _read_frame(connection: socket.socket):
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes is longer than {MAX_FRAME_BYTES}")
    return msgpack.unpackb(_read_exactly(connection, length))


def _read_exactly(connection: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    _read_into(connection, memoryview(data))
    return bytes(data)


def _read_into(connection: socket.socket, view: memoryview) -> None:
    while view:
        got = connection.recv_into(view)
        if got == 0:
            raise ConnectionError("the connection closed before the whole transfer arrived")
        view = view[got:]
