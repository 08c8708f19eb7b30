"""Advantage estimators: per-trajectory scalars (GRPO, REINFORCE) and per-token GAE for multi-turn trajectories."""

from collections import defaultdict

import torch


def grpo_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6,
                    scale_by_std: bool = True) -> torch.Tensor:
    """Group-normalised outcome reward: (r - mean of its group) / (std of its group + eps), or r - group mean.

    A group whose rewards are all equal gets zero advantage: it carries no signal about which answer
    is better.
    """
    members = defaultdict(list)
    for i, gid in enumerate(group_ids):
        members[gid].append(i)
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = torch.zeros_like(r)
    for idx in members.values():
        group = r[idx]
        if not scale_by_std:
            # Dr. GRPO (Liu et al. 2025): dividing by the group std up-weights groups that are almost all
            # right or all wrong (tiny std), a question-difficulty bias; the plain centred reward has none.
            adv[idx] = group - group.mean()
            continue
        std = group.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0)
        adv[idx] = (group - group.mean()) / (std + eps)
    return adv


def reinforce_advantages(rewards: list[float], group_ids: list[str] | None = None, whiten: bool = False,
                         eps: float = 1e-6) -> torch.Tensor:
    """A = r - b, b = batch (or group) mean; whiten: A <- (A - mean(A)) / (std(A) + eps) over the batch."""
    r = torch.tensor(rewards, dtype=torch.float32)
    if group_ids is None:
        # A constant baseline leaves the policy gradient unbiased and only lowers its variance.
        adv = r - r.mean()
    else:
        # REINFORCE++-baseline: the per-prompt mean is a better baseline than the batch mean when prompts
        # differ in difficulty; unlike GRPO the scale is then normalised over the whole batch, not per group.
        adv = grpo_advantages(rewards, group_ids, scale_by_std=False)
    if whiten:
        # REINFORCE++ (Hu 2025): one batch-wide mean/std (population std, as in grpo_advantages) keeps the step
        # size comparable across batches without the per-group scaling that amplifies near-uniform groups.
        adv = (adv - adv.mean()) / (adv.std(unbiased=False) + eps)
    return adv


def gae_advantages(rewards_per_token: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A_t = d_t + gamma*lambd*A_n, d_t = r_t + gamma*V_n - V_t, n = next mask-1 position; returns = A + V."""
    # Inputs are [B, T] in the same (shifted) layout as TrainingBatch.loss_mask; the caller puts each turn's reward
    # on the last generated token of that turn. Rewards at mask-0 positions are ignored. Advantages and returns
    # are regression/policy-gradient targets, so nothing flows back into `values`; they are computed in float32.
    with torch.no_grad():
        rewards = rewards_per_token.detach().float()
        values = values.detach().float()
        generated = mask.detach() > 0
        advantages = torch.zeros_like(values)
        next_value = torch.zeros_like(values[:, 0])  # after the final generated token the episode ends: V = 0
        next_advantage = torch.zeros_like(values[:, 0])
        for t in reversed(range(values.shape[1])):
            # Positions with mask 0 (prompt, tool output between turns, padding) are not actions of the policy,
            # so they are not time steps of the MDP: we carry next_value/next_advantage across them unchanged.
            # The last token of turn k is then bootstrapped by the value of the first generated token of turn
            # k+1, i.e. V of the state that already contains the tool's answer, and gamma is applied once per
            # generated token, never per tool-output token (the environment's tokens do not cost discounting).
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lambd * next_advantage
            here = generated[:, t]
            advantages[:, t] = torch.where(here, advantage, 0.0)
            next_value = torch.where(here, values[:, t], next_value)
            next_advantage = torch.where(here, advantage, next_advantage)
        returns = torch.where(generated, advantages + values, 0.0)
    return advantages, returns


def discounted_turn_returns(turn_rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1} over the turns of one trajectory, G after the last turn = 0."""
    returns, running = [0.0] * len(turn_rewards), 0.0
    for k in reversed(range(len(turn_rewards))):
        running = turn_rewards[k] + gamma * running
        returns[k] = running
    return returns


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """(x - mean) / (std + eps) over all masked tokens of all sequences; unmasked tokens stay 0."""
    flat = torch.cat([v[m > 0] for v, m in zip(values, masks)])
    if flat.numel() == 0:
        return values
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [torch.where(m > 0, (v - mean) / (std + eps), 0.0) for v, m in zip(values, masks)]
