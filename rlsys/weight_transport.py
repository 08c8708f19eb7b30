"""How a new policy version travels from the learner to the inference workers.

- `disk`: the learner writes a safetensors file under the run directory and publishes its path. Every
  inference worker must see that path: one machine, or a filesystem the nodes share.
- `bus`: the learner puts the same safetensors bytes on the bus, in chunks, with their SHA-256, and then
  the pointer to them; a worker reads the chunks, checks the digest and writes the file into a directory
  of its own node. No path is shared; the nodes only need the Redis they already reach.

Why the bus on CPU clusters, rather than Ray's object store or a gloo broadcast: it works the same under
both backends (local and Ray) and needs no peer to be alive at the moment of reading. A worker restarted
on another node, or one that joins late, takes the newest version whenever it comes up, while a
broadcast needs every member of a fixed group at once (one dead worker stalls the learner), and an
object in Ray's store dies with its owner (the learner) and exists only under Ray. The cost: one copy of
the newest versions in Redis memory (KEEP_VERSIONS of them) and Redis's single-threaded bandwidth, which
is fine for the small models trained on CPU; on GPUs the peers' NCCL broadcast is the path to take.
A digest that does not match (a resumed run republishing a version while a worker reads it) or a chunk
already dropped (the worker fell more than KEEP_VERSIONS behind) makes the worker skip this pointer and
try the newest one at its next check.
"""

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

from rlsys import protocol
from rlsys.engine.weights import weight_tensors, write_weight_file, write_weight_update

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # well under Redis's 512 MB value limit, small enough not to stall other clients
KEEP_VERSIONS = 3  # an inference worker may still be reading a slightly older version


def resolve(cluster) -> str:
    """The transport `cluster.weights_transport` names; auto is disk on one machine, bus on Ray."""
    if cluster.weights_transport != "auto":
        return cluster.weights_transport
    return "bus" if cluster.backend == "ray" else "disk"


def publish(bus, model: torch.nn.Module, version: int, transport: str, weights_dir: Path,
            state_dict: dict | None = None, check: dict | None = None) -> None:
    """Version `version` of `model` (its `state_dict` if given: one gathered from the learner's shards) made
    available to every inference worker, then announced on the bus with `check` ({"checksum", "dtype"}: what
    the engine must hold once loaded, rlsys/weight_checksum.py) if given."""
    check = check or {}
    if transport == "disk":
        path = write_weight_update(model, Path(weights_dir) / f"v{version}", state_dict)
        bus.set(protocol.WEIGHTS, {"version": version, "path": str(path), **check})
        shutil.rmtree(Path(weights_dir) / f"v{version - KEEP_VERSIONS}", ignore_errors=True)
        return
    data = save(weight_tensors(model, state_dict))
    chunks = range(0, len(data), CHUNK_BYTES)
    for i, start in enumerate(chunks):
        bus.set(protocol.weight_chunk(version, i), data[start:start + CHUNK_BYTES])
    bus.set(protocol.WEIGHTS, {"version": version, "chunks": len(chunks), "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest(), **check})
    old = bus.get(protocol.weight_chunk_count(version - KEEP_VERSIONS)) or 0
    bus.delete(*(protocol.weight_chunk(version - KEEP_VERSIONS, i) for i in range(old)),
               protocol.weight_chunk_count(version - KEEP_VERSIONS))
    bus.set(protocol.weight_chunk_count(version), len(chunks))


class WeightReceiver:
    """The inference worker's side: the directory to load a published version from, on this node.

    Versions that come over the bus are written into a private temporary directory, removed by close()."""

    def __init__(self, bus):
        self.bus = bus
        self.scratch_dir: Path | None = None
        self.received_over_bus = 0  # versions that arrived as chunks

    def close(self) -> None:
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.scratch_dir = None

    def directory(self, published: dict) -> str | None:
        """Where `published` can be loaded from; None if it cannot be had whole now (try the newest later)."""
        if "path" in published:
            return published["path"]
        parts = [self.bus.get(protocol.weight_chunk(published["version"], i)) for i in range(published["chunks"])]
        data = b"".join(part for part in parts if isinstance(part, bytes))
        if len(data) != published["bytes"] or hashlib.sha256(data).hexdigest() != published["sha256"]:
            log.warning("version %d changed or was dropped while it was read; waiting for the next", published["version"])
            return None
        self.received_over_bus += 1
        self.scratch_dir = self.scratch_dir or Path(tempfile.mkdtemp(prefix="rlsys-weights-"))
        return str(write_weight_file(self.scratch_dir / "current", lambda path: path.write_bytes(data)))

