"""Micro-batches by token budget: sequences packed end to end in one row, or padded rows.

A sequence is its token ids [n] plus per-token fields [n-1] aligned with the tokens it predicts
(field[t] belongs to token t+1). A packed row puts sequences end to end and restarts the position
ids at 0 for each, so attention stays within a sequence and no padding is computed; the slot
between two sequences (the last token of one "predicting" the first of the next) gets field value 0,
which for the loss mask means it is never trained on.
"""

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]; in a packed row they restart at 0 for every sequence
    attention_mask: torch.Tensor | None  # [R, L] for padded rows; None for a packed row (positions mark sequences)
    fields: dict[str, torch.Tensor]  # per predicted token, [R, L-1]
    indices: list[int]  # which of the input sequences it holds
    spans: list[tuple[int, int, int]]  # (row, start, length) of each of those sequences

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """[R, L-1] values in this micro-batch's layout -> one [n-1] tensor per sequence, in `indices` order."""
        return [per_token[row, start:start + n - 1] for row, start, n in self.spans]

    def to(self, device) -> "MicroBatch":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return MicroBatch(self.input_ids.to(device), self.position_ids.to(device), mask,
                          {k: v.to(device) for k, v in self.fields.items()}, self.indices, self.spans)

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


def collate_packed(token_ids: list[torch.Tensor], fields: dict[str, list[torch.Tensor]],
                   indices: list[int]) -> MicroBatch:
    """One row: the chosen sequences end to end."""
    spans, start = [], 0
    for i in indices:
        spans.append((0, start, len(token_ids[i])))
        start += len(token_ids[i])
    row_fields = {}
    for name, values in fields.items():
        parts = []
        for i in indices:
            parts += [values[i], values[i].new_zeros(1)]  # the slot between two sequences
        row_fields[name] = torch.cat(parts[:-1])[None]
    return MicroBatch(
        input_ids=torch.cat([token_ids[i] for i in indices])[None],
        position_ids=torch.cat([torch.arange(len(token_ids[i])) for i in indices])[None],
        attention_mask=None, fields=row_fields, indices=list(indices), spans=spans)


def collate_padded(token_ids: list[torch.Tensor], fields: dict[str, list[torch.Tensor]], indices: list[int],
                   pad_id: int) -> MicroBatch:
    """One right-padded row per sequence."""
    width = max(len(token_ids[i]) for i in indices)

    def pad(values: torch.Tensor, size: int, fill) -> torch.Tensor:
        return torch.cat([values, values.new_full((size - len(values),), fill)])

    lengths = [len(token_ids[i]) for i in indices]
    return MicroBatch(
        input_ids=torch.stack([pad(token_ids[i], width, pad_id) for i in indices]),
        position_ids=torch.arange(width).expand(len(indices), width).clone(),
        attention_mask=torch.stack([pad(torch.ones(n, dtype=torch.long), width, 0) for n in lengths]),
        fields={name: torch.stack([pad(values[i], width - 1, 0) for i in indices]) for name, values in fields.items()},
        indices=list(indices), spans=[(row, 0, n) for row, n in enumerate(lengths)])


def micro_batches(token_ids: list[torch.Tensor], fields: dict[str, list[torch.Tensor]], budget: int, packed: bool,
                  pad_id: int = 0) -> list[MicroBatch]:
    lengths = [len(ids) for ids in token_ids]
    if packed:
        return [collate_packed(token_ids, fields, b) for b in pack_by_token_budget(lengths, budget)]
    return [collate_padded(token_ids, fields, b, pad_id) for b in pad_by_token_budget(lengths, budget)]


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


def empty_micro_batch(field_names, packed: bool, pad_id: int = 0) -> MicroBatch:
    """Two padding tokens whose per-token fields (loss mask, loss weights) are all 0: a pass that adds nothing
    to any loss or gradient, for a rank with fewer micro-batches than the others (FSDP's passes are collective)."""
    return MicroBatch(input_ids=torch.full((1, 2), pad_id), position_ids=torch.arange(2)[None],
                      attention_mask=None if packed else torch.ones(1, 2, dtype=torch.long),
                      fields={name: torch.zeros(1, 1) for name in field_names}, indices=[], spans=[])
