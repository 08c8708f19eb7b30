"""Turns trajectories into per-sequence tensors aligned with the tokens each position predicts."""

from dataclasses import dataclass

import torch

from rlsys.api import Trajectory


@dataclass
class SequenceBatch:
    """One entry per trajectory: token ids [n] and per-token fields [n-1], field[t] belonging to token t+1."""

    token_ids: list[torch.Tensor]
    fields: dict[str, list[torch.Tensor]]

    def __len__(self) -> int:
        return len(self.token_ids)

    def select(self, indices: list[int]) -> "SequenceBatch":
        return SequenceBatch([self.token_ids[i] for i in indices],
                             {name: [values[i] for i in indices] for name, values in self.fields.items()})

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def sequence_batch(trajectories: list[Trajectory]) -> SequenceBatch:
    """loss_mask, behaviour_logprobs, versions and token_rewards (each turn's reward on its last token)."""
    fields: dict[str, list[torch.Tensor]] = {"loss_mask": [], "behaviour_logprobs": [], "versions": [],
                                             "token_rewards": []}
    for t in trajectories:
        # Token t+1 is predicted at position t, so per-token targets drop the first token.
        fields["loss_mask"].append(torch.tensor(t.loss_mask[1:], dtype=torch.float32))
        fields["behaviour_logprobs"].append(torch.tensor(t.logprobs[1:], dtype=torch.float32))
        fields["versions"].append(torch.tensor(t.versions[1:]))
        rewards = torch.zeros(len(t.token_ids) - 1)
        for end, reward in zip(t.turn_ends, t.turn_rewards):
            rewards[end - 2] += reward  # the turn's last token, token end-1, is predicted at position end-2
        fields["token_rewards"].append(rewards)
    return SequenceBatch([torch.tensor(t.token_ids) for t in trajectories], fields)


def per_turn_to_tokens(turn_ends: list[int], turn_values: list[float], loss_mask: torch.Tensor) -> torch.Tensor:
    """Each turn's value on the generated tokens of that turn, in the shifted layout of `loss_mask` ([n-1])."""
    values = torch.zeros_like(loss_mask, dtype=torch.float32)
    start = 0
    for end, value in zip(turn_ends, turn_values):
        values[max(start - 1, 0):end - 1] = value  # tokens start..end-1 are predicted at positions start-1..end-2
        start = end
    return values * loss_mask
