"""Advantage estimators over whole trajectories (one scalar per trajectory, spread over its tokens)."""

from collections import defaultdict

import torch


def grpo_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised outcome reward: (r - mean of its group) / (std of its group + eps).

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
        std = group.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0)
        adv[idx] = (group - group.mean()) / (std + eps)
    return adv
