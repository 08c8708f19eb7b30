"""Micro-batches by token budget, cut from a SequenceBatch: sequences packed end to end in one row, or padded rows.

The batch holds every sequence's tokens in one flat tensor and each per-token field in one [N + 1] tensor, aligned
with the tokens they predict (a sequence's last slot, which predicts nothing, and slot N hold 0; rlsys/algorithms/
batch.py). A micro-batch is one gather per tensor from those, by a `source` index computed on the host: a packed row
puts sequences end to end and restarts the position ids at 0 for each, so attention stays within a sequence and no
padding is computed; padded rows point their padding at slot N. Either way the slot between two sequences and every
pad read field value 0, which for the loss mask means they are never trained on. `MicroBatch.scatter` writes
per-token results (logprobs, values) back into the batch's layout.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from rlsys.algorithms.batch import SequenceBatch
from rlsys.host_copy import to_device


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]; in a packed row they restart at 0 for every sequence
    attention_mask: torch.Tensor | None  # [R, L] for padded rows; None for a packed row (positions mark sequences)
    fields: dict[str, torch.Tensor]  # per predicted token, [R, L-1]
    indices: list[int]  # which sequences of the batch it holds
    source: torch.Tensor  # [R, L]: the batch position of each slot; padding points at slot N (see batch.py)
    starts: list[int] = field(default_factory=lambda: [0])  # where each segment of a row starts (padded: 0)
    # Per segment, the (start, length) of the shared prefix it continues (length 0: none); None when nothing is shared
    contexts: list[tuple[int, int]] | None = None

    def scatter(self, per_token: torch.Tensor, out: torch.Tensor) -> None:
        """Writes [R, L-1] values in this micro-batch's layout into `out` ([N + 1], the batch's layout). Slots that
        predict nothing of their own sequence get values too: the caller zeroes them (SequenceBatch.predicts)."""
        out[self.source[:, :-1]] = per_token.to(out.dtype)

    @property
    def num_tokens(self) -> int:
        """Tokens the model computes, padding included."""
        return self.input_ids.numel()


def pack_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: bins of at most `budget` tokens (a longer sequence gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        target = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if target is None:
            bins.append([])
            room.append(budget)
            target = len(bins) - 1
        bins[target].append(i)
        room[target] -= lengths[i]
    return bins


def pad_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """In the given order, as many sequences per micro-batch as fit in `budget` once padded to the longest."""
    bins: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if bins and (len(bins[-1]) + 1) * max(longest, n) <= budget:
            bins[-1].append(i)
            longest = max(longest, n)
        else:
            bins.append([i])
            longest = n
    return bins


def prefix_groups(batch: SequenceBatch, indices: list[int]) -> list[list[int]]:
    """`indices` grouped by shared prefix, in order of first appearance."""
    members: dict[int, list[int]] = {}
    for i in indices:
        members.setdefault(batch.prefix_ids[i], []).append(i)
    return list(members.values())


def shared_tokens(batch: SequenceBatch, members: list[int]) -> int:
    """Tokens a row computes for `members`, sequences of one shared prefix: the prefix once, then each one's own."""
    k = batch.prefix_lengths[members[0]]
    return k + sum(batch.lengths[i] - k for i in members)


def prefix_units(batch: SequenceBatch, indices: list[int], budget: int) -> list[tuple[int, list[int]]]:
    """`indices` as units of (shared prefix length, sequences): sequences with the same prefix together, at most
    `budget` tokens a unit once the prefix is counted once (a unit of one sequence may be longer)."""
    units = []
    for group in prefix_groups(batch, indices):
        k = batch.prefix_lengths[group[0]]
        unit, tokens = [], k
        for i in group:
            own = batch.lengths[i] - k
            if unit and tokens + own > budget:
                units.append((k, unit))
                unit, tokens = [], k
            unit.append(i)
            tokens += own
        units.append((k, unit))
    return units


def collate_shared(batch: SequenceBatch, units: list[tuple[int, list[int]]], pad_id: int) -> MicroBatch:
    """Units of sequences as one packed row: each unit's shared prefix once (from its first sequence), then each
    sequence's tokens after it, position ids going on from the prefix's."""
    sources, positions, starts, contexts = [], [], [], []
    cursor = 0
    for k, members in units:
        prefix = (cursor, k)
        if k:
            sources.append(batch.offsets[members[0]] + np.arange(k))
            starts.append(cursor)
            contexts.append((cursor, 0))
            cursor += k
        for i in members:
            sources.append(batch.offsets[i] + np.arange(k, batch.lengths[i]))
            starts.append(cursor)
            contexts.append(prefix)
            cursor += batch.lengths[i] - k
        positions.extend([np.arange(k)] + [np.arange(k, batch.lengths[i]) for i in members])
    mb = gathered(batch, np.concatenate(sources)[None], np.concatenate(positions)[None], True, pad_id,
                  [i for _, members in units for i in members])
    mb.starts, mb.contexts = starts, contexts
    return mb


def collate(batch: SequenceBatch, indices: list[int], packed: bool, pad_id: int) -> MicroBatch:
    """Sequences `indices` of `batch` as one packed row, or as right-padded rows: one gather per tensor."""
    if packed:
        source = batch.positions(indices)[None]
        positions = source - np.repeat(batch.offsets[indices], np.asarray(batch.lengths)[indices])[None]
    else:
        source = batch.padded_source(indices)
        positions = np.broadcast_to(np.arange(source.shape[1]), source.shape)
    mb = gathered(batch, source, positions, packed, pad_id, list(indices))
    if packed:
        mb.starts = np.concatenate([[0], np.cumsum(np.asarray(batch.lengths)[indices])[:-1]]).tolist()
    return mb


def gathered(batch: SequenceBatch, source: np.ndarray, positions: np.ndarray, packed: bool, pad_id: int,
             indices: list[int]) -> MicroBatch:
    device = batch.device
    source_t = to_device(source, device, np.int64)
    real = source_t < batch.num_tokens
    input_ids = torch.where(real, batch.token_ids[source_t.clamp(max=max(batch.num_tokens - 1, 0))], pad_id)
    return MicroBatch(
        input_ids=input_ids, position_ids=to_device(positions, device, np.int64),
        attention_mask=None if packed else real.long(),
        fields={name: values[source_t[:, :-1]] for name, values in batch.fields.items()},
        indices=indices, source=source_t)


def micro_batches(batch: SequenceBatch, budget: int, packed: bool, pad_id: int = 0,
                  indices: list[int] | None = None, share_prefixes: bool = False) -> list[MicroBatch]:
    """Sequences `indices` of `batch` (all by default) in micro-batches of at most `budget` tokens; packed rows
    compute each shared prefix once if `share_prefixes` (and the batch knows its sequences' prefixes)."""
    indices = list(range(len(batch))) if indices is None else indices
    if packed and share_prefixes and batch.prefix_ids is not None:
        units = prefix_units(batch, indices, budget)
        bins = pack_by_token_budget([shared_tokens(batch, members) for _, members in units], budget)
        return [collate_shared(batch, [units[u] for u in b], pad_id) for b in bins]
    lengths = [batch.lengths[i] for i in indices]
    bins = pack_by_token_budget(lengths, budget) if packed else pad_by_token_budget(lengths, budget)
    return [collate(batch, [indices[i] for i in b], packed, pad_id) for b in bins]


def balance_by_tokens(lengths: list[int], n_parts: int) -> list[list[int]]:
    """Greedy, longest first: each sequence to the part with the fewest tokens so far; each part in input order.

    The learner's ranks split a mini-batch this way, so that each rank computes about the same number of tokens.
    """
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    tokens = [0] * n_parts
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        target = min(range(n_parts), key=lambda p: (tokens[p], p))
        parts[target].append(i)
        tokens[target] += lengths[i]
    return [sorted(part) for part in parts]


def empty_micro_batch(batch: SequenceBatch, packed: bool, pad_id: int = 0) -> MicroBatch:
    """Two padding slots whose per-token fields (loss mask, loss weights) are all 0: a pass that adds nothing
    to any loss or gradient, for a rank with fewer micro-batches than the others (FSDP's passes are collective).
    Padded, its attention mask is all ones: a row with nothing to attend to would be NaN."""
    source = np.full((1, 2), batch.num_tokens)
    mb = gathered(batch, source, np.arange(2)[None], packed, pad_id, [])
    if not packed:
        mb.attention_mask = torch.ones_like(mb.input_ids)
    return mb
