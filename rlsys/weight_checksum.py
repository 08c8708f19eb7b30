"""One checksum of a set of weights, so that what an inference worker loaded can be compared with what the
learner published (stale weights after a sync, a truncated or corrupted file, a tensor left out).

Every weight path calls `weights_checksum` on both ends: the publisher on the tensors it hands over, the
receiver on the tensors it holds after loading. Equal checksums mean equal names, shapes, dtypes and bytes.
"""

import hashlib

import torch

from rlsys.supervisor import RunCannotGoOn


def weights_checksum(tensors: dict[str, torch.Tensor], dtype: str | None = None) -> str:
    """blake2b over every tensor in name order: its name, dtype, shape and raw bytes.

    `dtype` (a torch dtype name): cast each floating tensor to it first, so a learner training in float32 can compute the
    checksum of the bfloat16 copy an engine holds. Cost: one pass over the bytes (about 1 GB/s on a CPU core).
    """
    cast = getattr(torch, dtype) if dtype else None
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach()
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        t = t.to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class WeightChecksumMismatch(RunCannotGoOn):
    """An inference worker holds other weights than the learner published for that version."""

    def __init__(self, worker: str, version: int, published: str, loaded: str):
        super().__init__(f"{worker} loaded version {version} with checksum {loaded}, but the learner published "
                         f"{published}: the weights it serves are not the ones trained")
        self.worker, self.version = worker, version
