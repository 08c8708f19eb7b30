"""One checksum of a set of weights, so that what an inference worker loaded can be compared with what the
learner published (stale weights after a sync, a truncated or corrupted transfer, a tensor left out or
transposed).

Every weight path calls `weights_checksum` on both ends: the publisher on the tensors it hands over, the
receiver on the tensors it holds after loading. It runs where the tensors live (a GPU model's on the GPU) and
costs one read of the weights at memory speed, with no host copy of the weights: each tensor's bytes are read
as 64-bit integers (or narrower, where a row's size needs it) and summed with wrap-around, which is exact and
so the same on every device, thread count and summation order. Per tensor three sums go into the digest: all
words, the row sums weighted by row index and the column sums weighted by column index. A changed word changes
the first; swapped rows or columns, or a transposed matrix, change the others. It is a check against bugs, not
against an adversary (who could craft compensating changes); the transport itself is authenticated.
"""

import hashlib

import torch

from rlsys.errors import RunCannotGoOn

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def weights_checksum(tensors: dict[str, torch.Tensor], dtype: str | None = None) -> str:
    """Digest of every tensor's name, dtype, shape and bytes (as their integer sums), in name order.

    `dtype` (a torch dtype name): cast each floating tensor to it first, so a learner training in float32 can compute the
    checksum of the bfloat16 copy an engine holds."""
    cast = getattr(torch, dtype) if dtype else None
    return digest({name: tensor_sums(t.detach().to(cast) if cast is not None and t.is_floating_point() else t)
                   for name, t in tensors.items()})


def tensor_sums(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One tensor's part of the checksum, computed where it lives: its dtype and shape, and its integer sums. A
    transfer computes each as its tensor is copied or arrives, then `digest`s them all."""
    t = t.detach()
    return f"{t.dtype}|{tuple(t.shape)}", _integer_sums(t.contiguous())


def digest(parts: dict[str, tuple[str, torch.Tensor]]) -> str:
    """The checksum of the tensors whose `tensor_sums` `parts` holds by name: `weights_checksum` of them."""
    names = sorted(parts)
    digest = hashlib.blake2b("\n".join(f"{name}|{parts[name][0]}" for name in names).encode(), digest_size=16)
    sums = [parts[name][1] for name in names]
    if sums:  # one copy to the host for the whole model, not a synchronisation per tensor
        on_one_device = len({s.device for s in sums}) == 1
        digest.update(torch.stack(sums if on_one_device else [s.cpu() for s in sums]).cpu().numpy().tobytes())
    return digest.hexdigest()


def _integer_sums(t: torch.Tensor) -> torch.Tensor:
    """[sum of all words, sum of row sums x (row + 1), sum of column sums x (column + 1)], int64 with wrap-around."""
    rows = t.shape[0] if t.dim() >= 2 else 1
    if t.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=t.device)
    row_bytes = t.numel() * t.element_size() // rows
    width = next(w for w in _WORDS if row_bytes % w == 0)
    words = t.reshape(-1).view(torch.uint8).view(_WORDS[width]).view(rows, row_bytes // width)
    if width < 4:  # narrow words would wrap within a row; rare and small (odd-length 1-D tensors)
        words = words.to(torch.int64)
    row_sums = words.sum(1, dtype=words.dtype).to(torch.int64)
    column_sums = words.sum(0, dtype=words.dtype).to(torch.int64)
    position = torch.arange(1, max(rows, words.shape[1]) + 1, dtype=torch.int64, device=t.device)
    return torch.stack([row_sums.sum(), (row_sums * position[:rows]).sum(),
                        (column_sums * position[:words.shape[1]]).sum()])


class WeightChecksumMismatch(RunCannotGoOn):
    """An inference worker holds other weights than the learner published for that version."""

    def __init__(self, worker: str, version: int, published: str, loaded: str):
        super().__init__(f"{worker} loaded version {version} with checksum {loaded}, but the learner published "
                         f"{published}: the weights it serves are not the ones trained")
        self.worker, self.version = worker, version
