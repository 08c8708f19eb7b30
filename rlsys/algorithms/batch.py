"""Turns trajectories into the padded, shifted tensors the policy loss works on."""

import dataclasses
from dataclasses import dataclass

import torch

from rlsys.api import Trajectory


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1]: 1 where the predicted token was produced by the model
    behaviour_logprobs: torch.Tensor  # [B, T-1] logprob the inference engine gave each predicted token
    advantages: torch.Tensor  # [B, T-1]
    versions: torch.Tensor  # [B, T-1] weight version of each predicted token (-1 if not generated)

    def select(self, rows: torch.Tensor) -> "TrainingBatch":
        return TrainingBatch(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})

    def to(self, device) -> "TrainingBatch":
        return TrainingBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def build_batch(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int) -> TrainingBatch:
    width = max(len(t.token_ids) for t in trajectories)

    def padded(values: list, fill) -> list:
        return list(values) + [fill] * (width - len(values))

    ids = torch.tensor([padded(t.token_ids, pad_id) for t in trajectories])
    attention = torch.tensor([padded([1] * len(t.token_ids), 0) for t in trajectories])
    # Token t+1 is predicted at position t, so per-token targets drop the first column.
    loss_mask = torch.tensor([padded(t.loss_mask, 0) for t in trajectories], dtype=torch.float32)[:, 1:]
    behaviour = torch.tensor([padded(t.logprobs, 0.0) for t in trajectories], dtype=torch.float32)[:, 1:]
    versions = torch.tensor([padded(t.versions, -1) for t in trajectories])[:, 1:]
    return TrainingBatch(ids, attention, loss_mask, behaviour, advantages[:, None] * loss_mask, versions)
