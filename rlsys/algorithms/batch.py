"""The step's sequences end to end in flat tensors, selected, packed and padded by index.

Sequence i holds positions offsets[i] .. offsets[i] + n_i - 1 of `token_ids` [N]. A per-token field has one
value per position, `field[p]` belonging to the token at p + 1 (the token position p predicts), so a
sequence's last position predicts nothing and holds 0. Every field has one more slot, N, always 0: padding
gathers from it. A mini-batch, a packed row and a padded block are then one gather per field, with the
index computed on the host: a step costs a handful of tensor operations however many sequences it has
(on a GPU every tensor operation is a launch, and per-sequence tensors made the learner host-bound).
"""

from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, islice

import numpy as np
import torch

from rlsys.api import Trajectory
from rlsys.host_copy import to_device


@dataclass
class SequenceBatch:
    token_ids: torch.Tensor  # [N]
    lengths: list[int]  # n_i, tokens of each sequence
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [N + 1] each, see the module docstring
    # Host-side, per sequence: which shared prefix it has (sequences with equal ids begin with the same
    # `prefix_lengths` tokens, none of whose predictions is trained: the prompt), or None if not known.
    prefix_ids: list[int] | None = None
    prefix_lengths: list[int] | None = None
    # Host-side, [sequences, 2]: each sequence's tokens trained on, and of them those that can move the policy, once
    # the learner knows its advantages (PolicyTrainer.count_tokens); None before.
    token_counts: np.ndarray | None = None
    # Host-side, [N]: where each position was in the batch this one was selected from, through every selection;
    # None: this is that batch, or has its layout (a selection of every sequence in order).
    origin: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @cached_property
    def offsets(self) -> np.ndarray:
        """Where each sequence starts."""
        return np.concatenate([[0], np.cumsum(self.lengths[:-1], dtype=np.int64)]).astype(np.int64)

    def positions(self, indices) -> np.ndarray:
        """The flat positions of sequences `indices`, end to end."""
        lengths = np.asarray(self.lengths, dtype=np.int64)[indices]
        if not len(lengths):
            return np.zeros(0, dtype=np.int64)
        starts = np.repeat(self.offsets[indices] - np.concatenate([[0], np.cumsum(lengths[:-1])]), lengths)
        return starts + np.arange(lengths.sum())

    @cached_property
    def sequence_index(self) -> torch.Tensor:
        """[N + 1]: which sequence each position belongs to; the padding slot belongs to none (len(self))."""
        index = np.repeat(np.arange(len(self)), self.lengths)
        return to_device(np.append(index, len(self)), self.device)

    @cached_property
    def predicts(self) -> torch.Tensor:
        """[N + 1]: True where a position predicts a token of its own sequence (all but each last and padding)."""
        mask = np.ones(self.num_tokens + 1, dtype=bool)
        mask[self.offsets + np.asarray(self.lengths) - 1] = False
        mask[-1] = False
        return to_device(mask, self.device)

    def select(self, indices: list[int], fields=None) -> "SequenceBatch":
        """The sequences `indices`, in that order, with the fields named in `fields` (all by default): one gather per
        tensor, none when `indices` are every sequence in order (the same tensors then)."""
        names = self.fields if fields is None else [name for name in fields if name in self.fields]
        if list(indices) == list(range(len(self))):
            whole = SequenceBatch(self.token_ids, self.lengths, {name: self.fields[name] for name in names},
                                  self.prefix_ids, self.prefix_lengths, self.token_counts, self.origin)
            for cached in ("offsets", "sequence_index", "predicts"):  # computed once, shared
                if cached in self.__dict__:
                    whole.__dict__[cached] = self.__dict__[cached]
            return whole
        positions = self.positions(indices)
        index = to_device(np.append(positions, self.num_tokens), self.device)
        return SequenceBatch(self.token_ids[index[:-1]], [self.lengths[i] for i in indices],
                             {name: self.fields[name][index] for name in names},
                             *(None if ids is None else [ids[i] for i in indices]
                               for ids in (self.prefix_ids, self.prefix_lengths)),
                             None if self.token_counts is None else self.token_counts[indices],
                             positions if self.origin is None else self.origin[positions])

    def write_into(self, values: torch.Tensor, field: torch.Tensor) -> None:
        """Adds [N + 1] `values` into `field`, a field of the batch this one was selected from, at the positions they
        were selected from (where `field` holds 0 for them)."""
        if self.origin is None:
            field += values
        else:
            field.index_add_(0, to_device(self.origin, self.device), values[:-1])

    def padded_source(self, indices, width: int | None = None) -> np.ndarray:
        """[len(indices), width] flat positions of the sequences right-padded to `width` (the longest by
        default); padding points at slot N."""
        lengths = np.asarray(self.lengths, dtype=np.int64)[indices]
        width = int(lengths.max()) if width is None else width
        columns = np.arange(width)
        source = self.offsets[indices][:, None] + columns
        return np.where(columns < lengths[:, None], source, self.num_tokens)

    def padded(self, values: torch.Tensor) -> torch.Tensor:
        """[B, T] per-token `values` ([N + 1]), one row per sequence, T = the longest sequence's n - 1."""
        return values[to_device(self.padded_source(np.arange(len(self)))[:, :-1], self.device)]

    def unpadded(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of `padded`: [B, T] -> [N + 1], positions that predict nothing 0."""
        source = to_device(self.padded_source(np.arange(len(self)))[:, :-1], self.device)
        out = torch.zeros(self.num_tokens + 1, dtype=rows.dtype, device=self.device)
        out[source] = rows
        return out * self.predicts

    def per_sequence(self, scalars: torch.Tensor) -> torch.Tensor:
        """[B] -> [N + 1]: each sequence's value on all its positions, 0 on padding."""
        scalars = to_device(scalars, self.device)
        return torch.cat([scalars, scalars.new_zeros(1)])[self.sequence_index]

    def sequence_means(self, values: torch.Tensor, where: torch.Tensor) -> list[float]:
        """Each sequence's mean of [N + 1] `values` over the positions `where` is true (0 if none): one read back."""
        bins = len(self) + 1  # the padding slot's sequence is the last bin
        where = where.to(values.dtype)
        sums = values.new_zeros(bins).index_add_(0, self.sequence_index, values * where)
        counts = values.new_zeros(bins).index_add_(0, self.sequence_index, where)
        return (sums / counts.clamp(min=1))[:-1].tolist()

    def sequences(self, name_or_values) -> list[torch.Tensor]:
        """A field (or [N + 1] values) as one [n - 1] tensor per sequence: views, for inspection and tests."""
        values = self.fields[name_or_values] if isinstance(name_or_values, str) else name_or_values
        return [values[o:o + n - 1] for o, n in zip(self.offsets.tolist(), self.lengths)]

    def flatten(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """One [n - 1] tensor per sequence -> [N + 1] in this batch's layout."""
        zero = per_sequence[0].new_zeros(1) if per_sequence else torch.zeros(1)
        return to_device(torch.cat([*chain.from_iterable((v, zero) for v in per_sequence), zero]), self.device)

    def to(self, device) -> "SequenceBatch":
        return SequenceBatch(to_device(self.token_ids, device), self.lengths,
                             {name: to_device(values, device) for name, values in self.fields.items()},
                             self.prefix_ids, self.prefix_lengths, self.token_counts, self.origin)


def trained_length(trajectory: Trajectory) -> int:
    """Tokens up to the last one trained on (every reward sits on a trained token: rewarded_tokens). What follows (the
    feedback after a final answer) is context of no trained token, so a causal model's loss, logprobs and values are
    the same without it."""
    mask = trajectory.loss_mask
    return len(mask) - mask[::-1].index(1) if 1 in mask else len(mask)


def rewarded_tokens(trajectory: Trajectory) -> list[tuple[int, float]]:
    """(token, reward) of each turn: its reward on the last trained token at or before the turn's last one (token
    end - 1), the last action the policy took before the reward came. Tokens the policy did not produce are not steps
    of the MDP (gae_advantages carries its values across them), so a reward on one of them, where a turn's end counts
    the environment's feedback or the turn's own tokens are all untrained, would otherwise be lost. A trajectory that
    records no turn has its `reward` on its last trained token, as one turn: the reward GRPO and REINFORCE read. A
    reward with no trained token before it (in the prompt) rewards no action and is left out."""
    mask = trajectory.loss_mask
    turns = (zip(trajectory.turn_ends, trajectory.turn_rewards) if trajectory.turn_ends
             else [(len(mask), trajectory.reward)])
    out = []
    for end, reward in turns:
        token = min(end, len(mask)) - 1
        while token > 0 and not mask[token]:  # one look in the usual case: a turn ends on a generated token
            token -= 1
        if token > 0:  # token 0 is predicted by nothing, so never trained
            out.append((token, reward))
    return out


def untrained_prefix(trajectory: Trajectory) -> int:
    """How many leading tokens no trained prediction depends on as a target: all before the token that predicts
    the first trained one. Two trajectories that begin with the same such tokens (a group's prompt) have the same
    keys and values there in a causal model, so a packed row may compute them once for both (packing.py)."""
    mask = trajectory.loss_mask
    return max(mask.index(1) - 1, 0) if 1 in mask else 0


def sequence_batch(trajectories: list[Trajectory]) -> SequenceBatch:
    """loss_mask, behaviour_logprobs, versions (-1: not generated) and token_rewards (each turn's reward on its
    last trained token: rewarded_tokens), each trajectory cut to its `trained_length`, and each one's untrained
    prefix. Built from flat Python lists: a few tensors however many trajectories."""
    lengths = [trained_length(t) for t in trajectories]
    token_ids = np.fromiter(chain.from_iterable(islice(t.token_ids, n) for t, n in zip(trajectories, lengths)),
                            dtype=np.int64, count=sum(lengths))
    prefix_lengths = [max(min(untrained_prefix(t), n - 1), 0) for t, n in zip(trajectories, lengths)]
    # A sequence with no untrained prefix shares nothing: an id of its own (keyed by its place), not one empty
    # prefix's for all such sequences, which would keep them together (on one learner rank: PolicyTrainer.shares).
    prefixes: dict[tuple[int, ...] | int, int] = {}
    prefix_ids = [prefixes.setdefault(tuple(islice(t.token_ids, k)) if k else i, len(prefixes))
                  for i, (t, k) in enumerate(zip(trajectories, prefix_lengths))]
    batch = SequenceBatch(torch.from_numpy(token_ids), lengths, prefix_ids=prefix_ids, prefix_lengths=prefix_lengths)

    def shifted(values_of, fill, dtype) -> torch.Tensor:
        # Token t+1 is predicted at position t, so per-token targets drop the first token; `fill` ends each.
        flat = chain.from_iterable(chain(islice(values_of(t), 1, n), (fill,)) for t, n in zip(trajectories, lengths))
        return torch.from_numpy(np.fromiter(chain(flat, (fill,)), dtype=dtype, count=sum(lengths) + 1))

    rewards = np.zeros(sum(lengths) + 1, dtype=np.float32)
    for offset, t in zip(batch.offsets.tolist(), trajectories):
        for token, reward in rewarded_tokens(t):
            rewards[offset + token - 1] += reward  # token k is predicted at position k - 1
    batch.fields = {"loss_mask": shifted(lambda t: t.loss_mask, 0, np.float32),
                    "behaviour_logprobs": shifted(lambda t: t.logprobs, 0, np.float32),
                    "versions": shifted(lambda t: t.versions, -1, np.int64),
                    "token_rewards": torch.from_numpy(rewards)}
    return batch


def per_turn_to_tokens(turn_ends: list[int], turn_values: list[float], loss_mask: torch.Tensor) -> torch.Tensor:
    """Each turn's value on the generated tokens of that turn, in the shifted layout of `loss_mask` ([n-1])."""
    values = torch.zeros_like(loss_mask, dtype=torch.float32)
    start = 0
    for end, value in zip(turn_ends, turn_values):
        values[max(start - 1, 0):end - 1] = value  # tokens start..end-1 are predicted at positions start-1..end-2
        start = end
    return values * loss_mask
