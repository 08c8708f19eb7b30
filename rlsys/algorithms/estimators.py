"""The advantage estimators `ppo.adv_estimator` names, in one table: name -> per-token fields of a batch.

Each takes the step's trajectories, their SequenceBatch (with `old_values` for gae) and the ppo settings,
and returns per-token fields in the batch's flat layout (rlsys/algorithms/batch.py): always `advantages`, zero
where the loss mask is 0; gae also the critic's regression targets, `returns`.
"""

import torch

from rlsys.algorithms.advantages import gae_advantages, gigpo_turn_advantages, grpo_advantages, \
    reinforce_advantages, starpo_advantages, whiten
from rlsys.algorithms.batch import SequenceBatch, per_turn_to_tokens
from rlsys.api import Trajectory

PerToken = dict[str, torch.Tensor]


def _on_generated_tokens(scalars: torch.Tensor, batch: SequenceBatch) -> PerToken:
    """One scalar per trajectory, on each of its generated tokens."""
    return {"advantages": batch.per_sequence(scalars) * batch.fields["loss_mask"]}


def grpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(grpo_advantages([t.reward for t in trajectories], [t.group_id for t in trajectories],
                                                scale_by_std=ppo.grpo_scale_by_std), batch)


def reinforce(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(reinforce_advantages([t.reward for t in trajectories], whiten=ppo.whiten_advantages),
                                batch)


def reinforce_baseline(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    rewards, groups = [t.reward for t in trajectories], [t.group_id for t in trajectories]
    return _on_generated_tokens(reinforce_advantages(rewards, groups, whiten=ppo.whiten_advantages), batch)


def starpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    return _on_generated_tokens(starpo_advantages([t.turn_rewards for t in trajectories],
                                                  [t.group_id for t in trajectories], ppo.grpo_scale_by_std), batch)


def gigpo(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    per_turn = gigpo_turn_advantages([t.turn_rewards for t in trajectories], [t.turn_obs_keys for t in trajectories],
                                     [t.group_id for t in trajectories], ppo.gigpo_step_gamma, ppo.gigpo_step_weight,
                                     ppo.grpo_scale_by_std)
    masks = batch.sequences(batch.fields["loss_mask"].cpu())
    return {"advantages": batch.flatten([per_turn_to_tokens(t.turn_ends, a, m)
                                         for t, a, m in zip(trajectories, per_turn, masks)])}


def compared_rewards(trajectories: list[Trajectory], adv_estimator: str) -> list[float]:
    """What a group baseline (choices.GROUP_BASELINES) compares among a group's trajectories: under starpo the sum of
    each one's turn rewards, under grpo and reinforce_baseline its `reward`. They are equal for the built-in agents,
    not for an agent that scores its turns apart from the episode; ppo.filter_uniform_groups drops a group where these
    are all equal, which is where the estimator gives it advantage 0."""
    if adv_estimator == "starpo":
        return [sum(t.turn_rewards) for t in trajectories]  # as starpo_advantages sums them
    return [t.reward for t in trajectories]


def gae(trajectories: list[Trajectory], batch: SequenceBatch, ppo) -> PerToken:
    """GAE over each sequence's generated tokens, rewards at turn ends, V from the pre-update critic."""
    mask = batch.fields["loss_mask"]
    padded = [batch.padded(batch.fields[name]) for name in ("token_rewards", "old_values", "loss_mask")]
    advantages, returns = (batch.unpadded(rows) for rows in gae_advantages(*padded, gamma=ppo.gamma, lambd=ppo.lambd))
    if ppo.whiten_advantages:
        advantages = whiten(advantages, mask)
    return {"advantages": advantages, "returns": returns}

# Keyed on the names rlsys/algorithms/choices.py lists for the config.
ADVANTAGE_ESTIMATORS = {"grpo": grpo, "reinforce": reinforce, "reinforce_baseline": reinforce_baseline, "gae": gae,
                        "starpo": starpo, "gigpo": gigpo}
