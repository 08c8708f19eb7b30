"""GRPO advantages, the PPO clipped loss and batch alignment against plain reference computations."""

import math

import torch

from rlsys.algorithms.advantages import grpo_advantages
from rlsys.algorithms.batch import build_batch
from rlsys.algorithms.ppo import kl_penalty, ppo_clip_loss
from rlsys.api import Trajectory


def test_grpo_normalises_within_each_group():
    adv = grpo_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "a", "a", "b", "b"])
    mean, std = 0.25, math.sqrt(0.25 * 0.75)
    expected = [(1 - mean) / std, -mean / std, -mean / std, -mean / std, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-4)  # group "b" is all equal: no signal


def reference_ppo_loss(logp, old, adv, mask, clip):
    total, count = 0.0, 0
    for lp, o, a, m in zip(logp.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(),
                           mask.flatten().tolist()):
        if m:
            ratio = math.exp(lp - o)
            total += max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
            count += 1
    return total / count


def test_ppo_clip_loss_matches_reference_values_and_gradients():
    torch.manual_seed(0)
    logp = (torch.randn(4, 6) * 0.3 - 1).requires_grad_()
    old, adv = torch.randn(4, 6) * 0.3 - 1, torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip=0.2)
    assert abs(loss.item() - reference_ppo_loss(logp, old, adv, mask, 0.2)) < 1e-5
    loss.backward()
    ratio = torch.exp(logp.detach() - old)
    clipped_out = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    expected_grad = torch.where(clipped_out, 0.0, -adv * ratio) * mask / mask.sum()
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)
    assert 0 < stats["clip_fraction"] < 1


def test_kl_penalty_is_zero_only_at_the_reference():
    logp, mask = torch.randn(2, 5), torch.ones(2, 5)
    assert kl_penalty(logp, logp, mask).item() == 0
    assert kl_penalty(logp, logp + 0.1, mask).item() > 0


def test_batch_aligns_targets_with_the_tokens_the_model_produced():
    t = Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.25],
                   versions=[-1, -1, 3, 3], turn_ends=[4], turn_rewards=[1.0], reward=1.0, group_id="g",
                   stop_reason="stop")
    short = Trajectory(token_ids=[5, 9], loss_mask=[0, 1], logprobs=[0, -1.0], versions=[-1, 2], turn_ends=[2],
                       turn_rewards=[0.0], reward=0.0, group_id="g", stop_reason="length")
    batch = build_batch([t, short], torch.tensor([2.0, -1.0]), pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]  # position t predicts token t+1
    assert batch.behaviour_logprobs.tolist() == [[0, -0.5, -0.25], [-1.0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 2, 2], [-1, 0, 0]]
    assert batch.versions.tolist() == [[-1, 3, 3], [2, -1, -1]]
    assert batch.num_tokens == 6
