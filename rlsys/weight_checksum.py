"""One checksum of a set of weights, so that what an inference worker loaded can be compared with what the
learner published (stale weights after a sync, a truncated or corrupted transfer, a tensor left out or
transposed).

Every weight path computes it on both ends (`weights_checksum`, or `ChecksumParts` tensor by tensor as a transfer
copies or receives them): the publisher on the tensors it hands over, the receiver on the tensors it holds after
loading, or on the bytes that arrived. It runs where the tensors live (a GPU model's on the GPU) and
costs one read of the weights at memory speed, with no host copy of the weights: each tensor's bytes are read
as 64-bit integers (or narrower, where a row's size needs it) and summed with wrap-around, which is exact and
so the same on every device, thread count and summation order. Per tensor three sums go into the digest: all
words, the row sums weighted by row index and the column sums weighted by column index. A changed word changes
the first; swapped rows or columns, or a transposed matrix, change the others. It is a check against bugs, not
against an adversary (who could craft compensating changes); the transport itself is authenticated.

On a GPU those few operations per tensor are host work that outweighs their reads on a small model (BENCHMARKS.md,
"Fifth GPU session"), so `weights_checksum` captures them as a CUDA graph once per set of tensors (their names,
addresses, dtypes and shapes: a model's own, updated in place, are one set for the whole run) and replays it. A
capture that fails leaves that device's checksums eager from then on, with a warning: a check must not end a run.
"""

import hashlib
import logging
from collections.abc import Callable

import torch

from rlsys.cuda_graphs import GRAPH_CAPTURE
from rlsys.errors import RunCannotGoOn

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
log = logging.getLogger(__name__)


def weights_checksum(tensors: dict[str, torch.Tensor], dtype: str | None = None) -> str:
    """Digest of every tensor's name, dtype, shape and bytes (as their integer sums), in name order.

    `dtype` (a torch dtype name): cast each floating tensor to it first, so a learner training in float32 can compute
    the checksum of the bfloat16 copy an engine holds."""
    cast = getattr(torch, dtype) if dtype else None
    devices = {t.device for t in tensors.values()}
    if len(devices) == 1 and (device := devices.pop()).type in GRAPH_CAPTURE and device.type not in _eager:
        try:
            return _replayed(tensors, cast, device)
        except RuntimeError as error:  # the check must not end the run: the same sums, issued one by one
            _eager.add(device.type)
            log.warning("the weight checksum could not be captured as a CUDA graph on %s (%s); it runs eagerly "
                        "from now on", device, error)
    return _parts(tensors, cast).digest()


def _parts(tensors: dict[str, torch.Tensor], cast: torch.dtype | None) -> "ChecksumParts":
    parts = ChecksumParts()
    for name, t in tensors.items():
        parts.add(name, t.detach().to(cast) if cast is not None and t.is_floating_point() else t)
    return parts


MAX_GRAPHS = 2  # sets of tensors whose checksum graph is kept: a learner checks one, an engine another
_eager: set[str] = set()  # device types where a capture failed
_graphs: dict[tuple, tuple[Callable[[], torch.Tensor], list[str]]] = {}  # by set: the replay and the labels


def _replayed(tensors: dict[str, torch.Tensor], cast: torch.dtype | None, device: torch.device) -> str:
    """`weights_checksum` by a graph of its operations, captured the first time these tensors are checked. The
    graph reads the addresses it recorded, so a tensor moved elsewhere (or another set) is captured anew."""
    key = (cast, device,
           tuple((name, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for name, t in tensors.items()))
    if key not in _graphs:
        labels = []

        def totals() -> torch.Tensor:
            parts = _parts(tensors, cast)
            labels[:] = parts.labels()
            return parts.totals()

        replay = GRAPH_CAPTURE[device.type]()(totals)
        while len(_graphs) >= MAX_GRAPHS:
            del _graphs[next(iter(_graphs))]  # the oldest
        _graphs[key] = replay, labels
    replay, labels = _graphs[key]
    return _digest(labels, replay().cpu())


def _digest(labels: list[str], totals: torch.Tensor) -> str:
    digest = hashlib.blake2b("\n".join(labels).encode(), digest_size=16)
    if labels:
        digest.update(totals.numpy().tobytes())
    return digest.hexdigest()


class ChecksumParts:
    """The checksum of tensors added one by one, as a transfer copies or receives them. Adding a tensor reads it
    (its row and column sums, while the next bytes move); `digest` weighs and totals those of every tensor of one
    shape together: two operations per tensor and a dozen per shape, not a dozen per tensor, whose fixed costs
    exceeded their work on a small model."""

    def __init__(self):
        self._labels: dict[str, str] = {}
        self._by_shape: dict[tuple, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        self._aliases: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        self._labels[name] = f"{t.dtype}|{tuple(t.shape)}"
        words = _words(t.contiguous())
        row_sums, column_sums = words.sum(1, dtype=words.dtype), words.sum(0, dtype=words.dtype)
        self._by_shape.setdefault((tuple(words.shape), words.dtype, words.device), []).append(
            (name, row_sums, column_sums))

    def alias(self, name: str, first: str) -> None:
        """`name` is the tensor added as `first` (a tied output head): read once."""
        self._aliases[name] = first

    def digest(self) -> str:
        """The checksum of every tensor added: `weights_checksum` of them."""
        return _digest(self.labels(), self.totals().cpu())  # one copy to the host for the whole model

    def labels(self) -> list[str]:
        """Each tensor's name, dtype and shape, in name order."""
        return [f"{name}|{self._labels[self._aliases.get(name, name)]}" for name in sorted(self._labels.keys()
                                                                                          | self._aliases.keys())]

    def totals(self) -> torch.Tensor:
        """[tensors, 3]: each tensor's three sums, in name order, where they were computed (nothing read back)."""
        sums = {}
        for ((rows, columns), _, device), group in self._by_shape.items():
            row_sums = torch.stack([r for _, r, _ in group]).to(torch.int64)
            column_sums = torch.stack([c for _, _, c in group]).to(torch.int64)
            position = torch.arange(1, max(rows, columns) + 1, dtype=torch.int64, device=device)
            totals = torch.stack([row_sums.sum(1), (row_sums * position[:rows]).sum(1),
                                  (column_sums * position[:columns]).sum(1)], dim=1)
            sums.update((name, row) for (name, _, _), row in zip(group, totals))
        for name, first in self._aliases.items():
            sums[name] = sums[first]
        parts = [sums[name] for name in sorted(sums)]
        if not parts:
            return torch.zeros(0, 3, dtype=torch.int64)
        return torch.stack(parts if len({p.device for p in parts}) == 1 else [p.cpu() for p in parts])


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as [rows, words] integers: rows the first dimension's (one for fewer than two
    dimensions), words of 64 bits or narrower where a row's size needs it. Narrow ones as int64: they would wrap
    within a row (rare and small: odd-length 1-D tensors)."""
    rows = t.shape[0] if t.dim() >= 2 else 1
    if t.numel() == 0:
        return torch.zeros(rows, 0, dtype=torch.int64, device=t.device)
    row_bytes = t.numel() * t.element_size() // rows
    width = next(w for w in _WORDS if row_bytes % w == 0)
    words = t.reshape(-1).view(torch.uint8).view(_WORDS[width]).view(rows, row_bytes // width)
    return words.to(torch.int64) if width < 4 else words


class WeightChecksumMismatch(RunCannotGoOn):
    """An inference worker holds other weights than the learner published for that version."""

    def __init__(self, worker: str, version: int, published: str, loaded: str):
        super().__init__(f"{worker} loaded version {version} with checksum {loaded}, but the learner published "
                         f"{published}: the weights it serves are not the ones trained")
        self.worker, self.version = worker, version
