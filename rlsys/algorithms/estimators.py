"""The advantage estimators `ppo.adv_estimator` names, in one table: name -> per-token fields of a batch.

Each takes the step's trajectories, their SequenceBatch (with `old_values` for gae) and the ppo settings,
and returns per-sequence [n-1] tensors: always `advantages`, zero where the loss mask is 0; gae also the
critic's regression targets, `returns`.
"""

import torch
from torch.nn.utils.rnn import pad_sequence

from rlsys.algorithms.advantages import gae_advantages, gigpo_turn_advantages, grpo_advantages, \
    reinforce_advantages, starpo_advantages, whiten
from rlsys.algorithms.batch import SequenceBatch, per_turn_to_tokens
from rlsys.api import Trajectory

PerToken = dict[str, list[torch.Tensor]]


def _on_generated_tokens(scalars: torch.Tensor, batch: SequenceBatch) -> PerToken:
    """One scalar per trajectory, on each of its generated tokens."""
    return {"advantages": [a * m for a, m in zip(scalars.tolist(), batch.fields["loss_mask"])]}


def grpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(grpo_advantages([t.reward for t in trajectories], [t.group_id for t in trajectories],
                                                scale_by_std=ppo.grpo_scale_by_std), batch)


def reinforce(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(reinforce_advantages([t.reward for t in trajectories], whiten=ppo.whiten_advantages),
                                batch)


def starpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(starpo_advantages([t.turn_rewards for t in trajectories],
                                                  [t.group_id for t in trajectories], ppo.grpo_scale_by_std), batch)


def gigpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    per_turn = gigpo_turn_advantages([t.turn_rewards for t in trajectories], [t.turn_obs_keys for t in trajectories],
                                     [t.group_id for t in trajectories], ppo.gigpo_step_gamma, ppo.gigpo_step_weight,
                                     ppo.grpo_scale_by_std)
    return {"advantages": [per_turn_to_tokens(t.turn_ends, a, m)
                           for t, a, m in zip(trajectories, per_turn, batch.fields["loss_mask"])]}


def gae(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    """GAE over each sequence's generated tokens, rewards at turn ends, V from the pre-update critic."""
    masks = batch.fields["loss_mask"]
    lengths = [len(m) for m in masks]
    padded = [pad_sequence(batch.fields[name], batch_first=True) for name in ("token_rewards", "old_values", "loss_mask")]
    advantages, returns = gae_advantages(*padded, gamma=ppo.gamma, lambd=ppo.lambd)
    advantages = [row[:n] for row, n in zip(advantages, lengths)]
    if ppo.whiten_advantages:
        advantages = whiten(advantages, masks)
    return {"advantages": advantages, "returns": [row[:n] for row, n in zip(returns, lengths)]}


ADVANTAGE_ESTIMATORS = {"grpo": grpo, "reinforce": reinforce, "gae": gae, "starpo": starpo, "gigpo": gigpo}
NEEDS_CRITIC = {"gae"}
