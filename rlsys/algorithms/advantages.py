"""Advantage estimators: per-trajectory scalars (GRPO, REINFORCE, StarPO), per-turn GiGPO and per-token GAE."""

import numpy as np
import torch

from rlsys.algorithms.returns import discounted_turn_returns


def grpo_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6,
                    scale_by_std: bool = True) -> torch.Tensor:
    """Group-normalised outcome reward: (r - mean of its group) / (std of its group + eps), or r - group mean.

    The std is the population std, so each group's advantages have std 1; TRL and verl divide by the sample std,
    sqrt(G/(G-1)) larger (docs/learner.md). Without the std this is RLOO's advantage times (G-1)/G.

    A group whose rewards are all equal gets exactly zero advantage: it carries no signal about which answer
    is better (and the learner leaves sequences of advantage 0 out of its passes: ppo.skip_zero_advantage).
    """
    # Whole-batch array operations on the host, in float64: a few calls for any number of groups, where a tensor
    # operation per group and statistic cost the learner about a hundred calls a default step.
    index: dict[str, int] = {}
    group = np.fromiter((index.setdefault(g, len(index)) for g in group_ids), dtype=np.int64, count=len(group_ids))
    r = np.asarray(rewards, dtype=np.float64)
    size = np.bincount(group, minlength=len(index))
    lowest, highest = np.full(len(index), np.inf), np.full(len(index), -np.inf)
    np.minimum.at(lowest, group, r)
    np.maximum.at(highest, group, r)
    varied = (highest > lowest)[group]  # a mean of equal values need not give that value back exactly: no rounding
    centred = np.where(varied, r - (np.bincount(group, weights=r, minlength=len(index)) / size)[group], 0.0)
    if scale_by_std:
        # Dr. GRPO (Liu et al. 2025) leaves this out: dividing by the group std up-weights groups that are almost
        # all right or all wrong (tiny std), a question-difficulty bias; the plain centred reward has none.
        std = np.sqrt(np.bincount(group, weights=centred ** 2, minlength=len(index)) / size)
        centred = centred / (std[group] + eps)
    return torch.from_numpy(centred.astype(np.float32))


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
    # Inputs are [B, T] in the same (shifted) layout as SequenceBatch's loss_mask; the caller puts each turn's reward
    # on the last trained token at or before the turn's end (batch.rewarded_tokens). Rewards at mask-0 positions are
    # ignored here. Advantages and returns are regression/policy-gradient targets, so nothing flows back into
    # `values`; they are computed in float32.
    # Every sequence ends in termination: V = 0 after its last generated token, also where the response was cut at
    # max_new_tokens or the episode at its turn or token budget (stop_reason "length", "truncated"). The environment
    # scored what it got and the episode is over; there is no later state whose value a bootstrap would stand for.
    # (verl and OpenRLHF do the same; a time limit inside a longer episode would call for V(s_T) instead.)
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


def starpo_advantages(turn_rewards: list[list[float]], group_ids: list[str], scale_by_std: bool = True,
                      eps: float = 1e-6) -> torch.Tensor:
    """StarPO (RAGEN; ROLL's trajectory-wise training): each episode's summed turn rewards, group-normalised."""
    return grpo_advantages([sum(rewards) for rewards in turn_rewards], group_ids, eps, scale_by_std)


def gigpo_turn_advantages(turn_rewards: list[list[float]], turn_keys: list[list[str]], group_ids: list[str],
                          step_gamma: float, step_weight: float = 1.0, scale_by_std: bool = True,
                          eps: float = 1e-6) -> list[list[float]]:
    """GiGPO (Feng et al. 2025): per turn, A = A_episode + step_weight * A_step.

    A_episode is StarPO's. A_step compares the turn's discounted return G_t = sum_k step_gamma**(k-t) r_k with
    the returns of every turn, in any episode of the same group, that acted on the same state (equal key): an
    anchor-state group, normalised like a GRPO group. A turn whose state no other turn saw gets A_step = 0,
    as does every turn of an episode that recorded no keys.
    """
    episode = starpo_advantages(turn_rewards, group_ids, scale_by_std, eps)
    returns, anchors = [], []
    for i, (rewards, keys, gid) in enumerate(zip(turn_rewards, turn_keys, group_ids)):
        returns += discounted_turn_returns(rewards, step_gamma)
        # The group id is part of the anchor: equal boards of different puzzles are different states.
        anchors += [repr((gid, keys[k])) if keys else repr((gid, i, k)) for k in range(len(rewards))]
    step = grpo_advantages(returns, anchors, eps, scale_by_std).tolist()
    advantages, offset = [], 0
    for i, rewards in enumerate(turn_rewards):
        advantages.append([episode[i].item() + step_weight * a for a in step[offset:offset + len(rewards)]])
        offset += len(rewards)
    return advantages


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked tokens; unmasked tokens are 0."""
    generated = mask > 0
    count = generated.sum().clamp(min=1)
    mean = torch.where(generated, values, 0.0).sum() / count
    std = (torch.where(generated, values - mean, 0.0).square().sum() / count).sqrt()
    return torch.where(generated, (values - mean) / (std + eps), 0.0)
