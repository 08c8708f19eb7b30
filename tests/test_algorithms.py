"""Advantage estimators, the PPO losses, KL controllers and batch alignment against plain reference computations."""

import math
import random

import pytest
import torch

from rlsys.algorithms.advantages import gae_advantages, gigpo_turn_advantages, grpo_advantages, reinforce_advantages, \
    starpo_advantages
from rlsys.algorithms.batch import per_turn_to_tokens, sequence_batch
from rlsys.algorithms.packing import micro_batches, pack_by_token_budget, pad_by_token_budget
from rlsys.algorithms.returns import discounted_turn_returns
from rlsys.algorithms.ppo import AdaptiveKLController, FixedKLController, aggregate_token_loss, clipped_value_loss, \
    kl_k3, kl_penalty, ppo_clip_loss, token_loss_weights
from rlsys.api import Trajectory


def test_grpo_normalises_within_each_group():
    adv = grpo_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "a", "a", "b", "b"])
    mean, std = 0.25, math.sqrt(0.25 * 0.75)
    expected = [(1 - mean) / std, -mean / std, -mean / std, -mean / std, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-4)  # group "b" is all equal: no signal


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_their_rounding(scale_by_std):
    # The mean of eight float32 0.1s is not 0.1; divided by a std of about 0 plus eps, that error became an
    # advantage of about 0.0075 per sample, and the learner computed the group as if it carried a signal.
    for reward in (0.1, 0.3, 0.7, 0.9, 1 / 3):
        adv = grpo_advantages([reward] * 8 + [0.0, 1.0], ["a"] * 8 + ["b"] * 2, scale_by_std=scale_by_std)
        assert adv[:8].tolist() == [0.0] * 8, (reward, adv)
        assert adv[8] < 0 < adv[9]


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


def two_trajectories():
    t = Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.25],
                   versions=[-1, -1, 3, 3], turn_ends=[4], turn_rewards=[1.0], reward=1.0, group_id="g",
                   stop_reason="stop")
    short = Trajectory(token_ids=[5, 9], loss_mask=[0, 1], logprobs=[0, -1.0], versions=[-1, 2], turn_ends=[2],
                       turn_rewards=[0.5], reward=0.5, group_id="g", stop_reason="length")
    return [t, short]


def test_sequence_fields_align_with_the_tokens_they_predict():
    batch = sequence_batch(two_trajectories())
    assert batch.token_ids.tolist() == [5, 6, 7, 8, 5, 9] and batch.lengths == [4, 2]
    # Position t predicts token t+1; each sequence's last position predicts nothing (0), and slot N pads.
    assert batch.fields["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0, 0]
    assert batch.fields["versions"].tolist() == [-1, 3, 3, -1, 2, -1, -1]
    assert [m.tolist() for m in batch.sequences("loss_mask")] == [[0, 1, 1], [1]]
    assert [b.tolist() for b in batch.sequences("behaviour_logprobs")] == [[0, -0.5, -0.25], [-1.0]]
    assert [r.tolist() for r in batch.sequences("token_rewards")] == [[0, 0, 1.0], [0.5]]  # on each turn's last token
    assert batch.num_tokens == 6
    assert batch.sequence_index.tolist() == [0, 0, 0, 0, 1, 1, 2]
    assert batch.predicts.tolist() == [True, True, True, False, True, False, False]
    swapped = batch.select([1, 0])
    assert swapped.token_ids.tolist() == [5, 9, 5, 6, 7, 8] and swapped.lengths == [2, 4]
    assert [m.tolist() for m in swapped.sequences("loss_mask")] == [[1], [0, 1, 1]]
    assert swapped.fields["loss_mask"].tolist() == [1, 0, 0, 1, 1, 0, 0]
    assert batch.flatten(batch.sequences("behaviour_logprobs")).tolist() == batch.fields["behaviour_logprobs"].tolist()
    padded = batch.padded(batch.fields["loss_mask"])
    assert padded.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.unpadded(padded).tolist() == batch.fields["loss_mask"].tolist()
    values = torch.tensor([0, 2.0, 4.0, 0, -1.0, 0, 0])
    assert batch.sequence_means(values, values != 0) == [3.0, -1.0]


def test_feedback_after_the_last_turn_is_not_computed():
    """Tokens after the last trained one (the feedback to a final answer) are context of nothing trained: the
    batch is the one of the trajectory without them, so the learner neither computes nor changes for them."""
    t, short = two_trajectories()
    told = Trajectory(token_ids=t.token_ids + [11, 12, 13], loss_mask=t.loss_mask + [0, 0, 0],
                      logprobs=t.logprobs + [0, 0, 0], versions=t.versions + [-1, -1, -1], turn_ends=t.turn_ends,
                      turn_rewards=t.turn_rewards, reward=t.reward, group_id="g", stop_reason="stop")
    cut, whole = sequence_batch([told, short]), sequence_batch([t, short])
    assert cut.lengths == whole.lengths == [4, 2]
    assert cut.token_ids.tolist() == whole.token_ids.tolist()
    assert {k: v.tolist() for k, v in cut.fields.items()} == {k: v.tolist() for k, v in whole.fields.items()}
    # A prompt with nothing generated (no turn, nothing trained) stays whole.
    empty = Trajectory(token_ids=[5, 6], loss_mask=[0, 0], logprobs=[0, 0], versions=[-1, -1], turn_ends=[],
                       turn_rewards=[], reward=0.0, group_id="g", stop_reason="stop")
    assert sequence_batch([empty]).lengths == [2]


def test_padded_and_packed_micro_batches_hold_the_same_fields():
    batch = sequence_batch(two_trajectories())
    padded = micro_batches(batch, budget=100, packed=False, pad_id=0)[0]
    assert padded.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert padded.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert padded.fields["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    packed = micro_batches(batch, budget=100, packed=True)[0]
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 5, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]  # restarts mark the sequences
    assert packed.attention_mask is None
    # The slot where sequence 1's last token "predicts" sequence 2's first is never trained on.
    assert packed.fields["loss_mask"].tolist() == [[0, 1, 1, 0, 1]]
    assert packed.fields["behaviour_logprobs"].tolist() == [[0, -0.5, -0.25, 0, -1.0]]
    for mb in (padded, packed):  # back into the batch's layout
        out = torch.zeros(batch.num_tokens + 1)
        mb.scatter(mb.fields["behaviour_logprobs"] + 1, out)
        assert [x.tolist() for x in batch.sequences(out * batch.predicts)] == [[1, 0.5, 0.75], [0.0]]
        assert mb.indices == [0, 1]
    reordered = micro_batches(batch, budget=100, packed=False, indices=[1, 0])[0]  # padding keeps the order
    assert reordered.input_ids.tolist() == [[5, 9, 0, 0], [5, 6, 7, 8]] and reordered.indices == [1, 0]
    assert reordered.fields["loss_mask"].tolist() == [[1, 0, 0], [0, 1, 1]]


def test_token_budgets_bound_the_micro_batches():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    packed = pack_by_token_budget(lengths, 64)
    assert sorted(i for b in packed for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in packed)
    assert len(packed) <= math.ceil(sum(lengths) / 64) + 2  # first-fit decreasing wastes little
    padded = pad_by_token_budget(lengths, 64)
    assert [i for b in padded for i in b] == list(range(40))  # order kept
    assert all(len(b) * max(lengths[i] for i in b) <= 64 for b in padded)
    assert pack_by_token_budget([100, 3], 64) == [[0], [1]]  # too long for the budget: a bin of its own


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_token_loss_weights_make_micro_batch_sums_equal_the_aggregate(agg):
    _, _, _, mask = random_ppo_inputs(3)
    token_loss = torch.randn_like(mask)
    rows = torch.arange(mask.shape[0])[:, None].expand_as(mask)
    weights = token_loss_weights(mask.flatten(), rows.flatten(), agg).view_as(mask)
    whole = aggregate_token_loss(token_loss, mask, agg)
    split = sum((token_loss[rows] * weights[rows]).sum() for rows in ([0, 1], [2], [3, 4]))
    assert split.item() == pytest.approx(whole.item(), abs=1e-12)


def test_clipped_value_loss_matches_reference_values_and_gradients():
    torch.manual_seed(1)
    values = torch.randn(20, dtype=torch.float64, requires_grad=True)
    old, returns = values.detach() + torch.randn(20, dtype=torch.float64) * 0.3, torch.randn(20, dtype=torch.float64)
    loss = clipped_value_loss(values, old, returns, clip=0.2)
    loss.sum().backward()
    for v, o, r, l, g in zip(values.tolist(), old.tolist(), returns.tolist(), loss.tolist(), values.grad.tolist()):
        clipped = o + min(max(v - o, -0.2), 0.2)
        assert l == pytest.approx(0.5 * max((v - r) ** 2, (clipped - r) ** 2))
        inside = abs(v - o) < 0.2
        expected_grad = v - r if (v - r) ** 2 >= (clipped - r) ** 2 or inside else 0.0
        assert g == pytest.approx(expected_grad)
    assert torch.equal(clipped_value_loss(values, old, returns, clip=0), 0.5 * (values - returns) ** 2)


# ---- plain-Python references -------------------------------------------------------------------------------------

def reference_grpo(rewards, group_ids, scale_by_std, eps=1e-6):
    out = []
    for r, g in zip(rewards, group_ids):
        group = [x for x, h in zip(rewards, group_ids) if h == g]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / len(group))
        out.append((r - mean) / (std + eps) if scale_by_std else r - mean)
    return out


def reference_whiten(values, eps=1e-6):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    return [(x - mean) / (std + eps) for x in values]


def reference_gae(rewards, values, mask, gamma, lambd):
    """One row: walks the generated positions right to left; tool/prompt positions are not steps at all."""
    steps = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    last_adv, next_value = 0.0, 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        last_adv = delta + gamma * lambd * last_adv
        adv[t], ret[t] = last_adv, last_adv + values[t]
        next_value = values[t]
    return adv, ret


def reference_token_loss(lp, old, a, clip, dual_clip=None, behaviour=None, cap=None):
    """(loss, d loss / d lp) of one token."""
    ratio = math.exp(lp - old)
    unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip)
    loss, grad = (unclipped, -a * ratio) if unclipped >= clipped else (clipped, 0.0)
    if dual_clip is not None and a < 0 and -a * dual_clip < loss:
        loss, grad = -a * dual_clip, 0.0
    if behaviour is not None:
        weight = math.exp(old - behaviour)
        if cap is not None and weight > cap:
            weight = 0.0
        loss, grad = loss * weight, grad * weight
    return loss, grad


def reference_ppo(logp, old, adv, mask, clip, agg="token-mean", dual_clip=None, behaviour=None, cap=None):
    """Loss and gradient w.r.t. logp, as nested lists, aggregated like the rlsys loss."""
    rows = len(mask)
    per_token = [[reference_token_loss(logp[b][t], old[b][t], adv[b][t], clip, dual_clip,
                                       None if behaviour is None else behaviour[b][t], cap) if mask[b][t] else (0, 0)
                  for t in range(len(mask[b]))] for b in range(rows)]
    counts = [sum(1 for m in row if m) for row in mask]
    total = sum(counts)
    nonempty = sum(1 for c in counts if c)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for b in range(rows):
        for t, (token_loss, token_grad) in enumerate(per_token[b]):
            if not mask[b][t]:
                continue
            if agg == "token-mean":
                scale = 1 / total
            elif agg == "seq-mean-token-mean":
                scale = 1 / (counts[b] * nonempty)
            else:
                scale = 1 / nonempty
            loss += token_loss * scale
            grad[b][t] = token_grad * scale
    return loss, grad


def random_ppo_inputs(seed, rows=5, cols=7):
    torch.manual_seed(seed)
    logp = (torch.randn(rows, cols, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(rows, cols, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, cols, dtype=torch.float64)
    mask = (torch.rand(rows, cols) > 0.3).double()
    mask[-1] = 0  # a sequence without generated tokens
    mask[0, 0] = 1
    return logp, old, adv, mask


def check_against_reference(logp, old, adv, mask, clip, **kwargs):
    ref_kwargs = {"agg": kwargs.get("agg", "token-mean"), "dual_clip": kwargs.get("dual_clip"),
                  "cap": kwargs.get("imp_weight_cap")}
    if kwargs.get("behaviour_logprobs") is not None:
        ref_kwargs["behaviour"] = kwargs["behaviour_logprobs"].tolist()
    expected_loss, expected_grad = reference_ppo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip,
                                                 **ref_kwargs)
    logp.grad = None
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip, **kwargs)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-10)
    assert torch.allclose(logp.grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-10)
    return loss, stats


# ---- advantages ---------------------------------------------------------------------------------------------------

def test_grpo_with_and_without_std_scaling_matches_reference():
    rng = random.Random(0)
    rewards = [rng.random() for _ in range(12)]
    groups = [rng.choice("abc") for _ in range(12)] + ["single"]
    rewards.append(0.7)
    for scale in (True, False):
        adv = grpo_advantages(rewards, groups, scale_by_std=scale)
        assert torch.allclose(adv, torch.tensor(reference_grpo(rewards, groups, scale)), atol=1e-5)
    assert grpo_advantages(rewards, groups, scale_by_std=False)[-1].item() == 0  # a lone answer has no baseline
    assert torch.equal(grpo_advantages(rewards, groups), grpo_advantages(rewards, groups, scale_by_std=True))


def test_reinforce_baseline_and_whitening_match_reference():
    rng = random.Random(1)
    rewards = [rng.gauss(0, 2) for _ in range(10)]
    groups = [rng.choice("xy") for _ in range(10)]
    mean = sum(rewards) / len(rewards)
    assert torch.allclose(reinforce_advantages(rewards), torch.tensor([r - mean for r in rewards]), atol=1e-5)
    whitened = reinforce_advantages(rewards, whiten=True)
    assert torch.allclose(whitened, torch.tensor(reference_whiten(rewards)), atol=1e-5)
    assert abs(whitened.mean().item()) < 1e-5 and abs(whitened.std(unbiased=False).item() - 1) < 1e-4
    grouped = reinforce_advantages(rewards, groups)
    assert torch.allclose(grouped, torch.tensor(reference_grpo(rewards, groups, False)), atol=1e-5)
    grouped_whitened = reinforce_advantages(rewards, groups, whiten=True)
    expected = reference_whiten(reference_grpo(rewards, groups, False))
    assert torch.allclose(grouped_whitened, torch.tensor(expected), atol=1e-5)
    assert reinforce_advantages([1.0, 1.0, 1.0], whiten=True).abs().max().item() == 0  # no signal, no blow-up


@pytest.mark.parametrize("whiten", [False, True])
def test_reinforce_baseline_centres_each_groups_rewards_and_whitens_over_the_batch(whiten):
    """ppo.adv_estimator=reinforce_baseline: r - its group's mean on each generated token, then (with
    ppo.whiten_advantages, REINFORCE++-baseline) one batch-wide mean and std."""
    from types import SimpleNamespace

    from rlsys.algorithms.estimators import ADVANTAGE_ESTIMATORS

    def answer(group, reward):
        return Trajectory(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0, -1.0, -1.0], versions=[-1, 0, 0],
                          turn_ends=[3], turn_rewards=[reward], reward=reward, group_id=group, stop_reason="stop")

    trajectories = [answer("a", 1.0), answer("a", 0.0), answer("b", 1.0), answer("b", 1.0)]
    batch = sequence_batch(trajectories)
    out = ADVANTAGE_ESTIMATORS["reinforce_baseline"](trajectories, batch, SimpleNamespace(whiten_advantages=whiten))
    centred = [0.5, -0.5, 0.0, 0.0]  # the uniform group b gets 0, as under grpo
    expected = reference_whiten(centred) if whiten else centred
    assert torch.cat(batch.sequences(out["advantages"])).tolist() == pytest.approx([e for e in expected for _ in "ab"])


def test_gae_skips_tool_output_between_turns():
    # Two turns of two generated tokens each, separated by two tool-output tokens, rewards at turn ends.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0.5, 9, 9, 0, 1.0, 9]])  # the 9s sit on non-generated positions: ignored
    values = torch.tensor([[0.1, 0.2, 5, 5, 0.3, 0.4, 5]])
    gamma, lambd = 0.9, 0.8
    adv, ret = gae_advantages(rewards, values, mask, gamma, lambd)
    expected_adv, expected_ret = reference_gae(rewards[0].tolist(), values[0].tolist(), mask[0].tolist(), gamma,
                                               lambd)
    assert torch.allclose(adv[0], torch.tensor(expected_adv), atol=1e-6)
    assert torch.allclose(ret[0], torch.tensor(expected_ret), atol=1e-6)
    assert adv[0, 2:4].tolist() == [0, 0] and ret[0, 6].item() == 0
    # With lambd = 0 the end of turn 1 is bootstrapped by the first generated token of turn 2, not by the tool
    # tokens' values, and is discounted once.
    adv0, _ = gae_advantages(rewards, values, mask, gamma, 0.0)
    assert adv0[0, 1].item() == pytest.approx(0.5 + gamma * 0.3 - 0.2, abs=1e-6)
    # gamma = lambd = 1 with zero values: every generated token's advantage is its reward-to-go.
    adv1, ret1 = gae_advantages(rewards, torch.zeros_like(values), mask, 1.0, 1.0)
    assert adv1[0].tolist() == pytest.approx([1.5, 1.5, 0, 0, 1.0, 1.0, 0])
    assert torch.equal(adv1, ret1)


def test_gae_matches_reference_on_random_multi_turn_batches():
    torch.manual_seed(3)
    rows, cols = 6, 12
    mask = (torch.rand(rows, cols) > 0.35).float()
    mask[0] = torch.tensor([0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0])  # prompt, turn, tool, turn, padding
    rewards = torch.randn(rows, cols) * (torch.rand(rows, cols) > 0.6)
    values = torch.randn(rows, cols, requires_grad=True)
    adv, ret = gae_advantages(rewards, values, mask, 0.97, 0.9)
    assert not adv.requires_grad and not ret.requires_grad  # targets, not part of the graph
    for b in range(rows):
        expected_adv, expected_ret = reference_gae(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), 0.97,
                                                   0.9)
        assert torch.allclose(adv[b], torch.tensor(expected_adv), atol=1e-5)
        assert torch.allclose(ret[b], torch.tensor(expected_ret), atol=1e-5)


def test_discounted_turn_returns():
    assert discounted_turn_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    rng = random.Random(4)
    rewards = [rng.random() for _ in range(6)]
    expected = [sum(0.9 ** (j - k) * rewards[j] for j in range(k, 6)) for k in range(6)]
    assert discounted_turn_returns(rewards, 0.9) == pytest.approx(expected)
    assert discounted_turn_returns([], 0.9) == []


def reference_normalise(values: list[float], scale_by_std: bool, eps: float = 1e-6) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if len(values) > 1 else 0.0
    return [(v - mean) / (std + eps) if scale_by_std else v - mean for v in values]


def random_episodes(rng, n: int) -> tuple[list[list[float]], list[list[str]], list[str]]:
    """Episodes of 1-5 turns in 3 groups; states drawn from a few boards so that some repeat (anchor states)."""
    turn_rewards = [[rng.choice([0.0, 0.0, -0.1, 1.0]) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    keys = [[rng.choice("abcd") for _ in rewards] for rewards in turn_rewards]
    return turn_rewards, keys, [f"g{i % 3}" for i in range(n)]


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_starpo_normalises_summed_turn_rewards_within_groups(scale_by_std):
    turn_rewards, _, groups = random_episodes(random.Random(5), 24)
    adv = starpo_advantages(turn_rewards, groups, scale_by_std)
    for g in set(groups):
        members = [i for i, gid in enumerate(groups) if gid == g]
        expected = reference_normalise([sum(turn_rewards[i]) for i in members], scale_by_std)
        assert adv[members].tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_gigpo_adds_anchor_state_step_advantages_to_the_episode_advantage(scale_by_std):
    turn_rewards, keys, groups = random_episodes(random.Random(6), 30)
    keys[0] = []  # an episode without state keys: its turns anchor nothing
    gamma, weight = 0.9, 0.7
    adv = gigpo_turn_advantages(turn_rewards, keys, groups, gamma, weight, scale_by_std)

    # Plain reference: episode term from summed rewards per group; step term per (group, state) over all turns.
    episode = {}
    for g in set(groups):
        members = [i for i, gid in enumerate(groups) if gid == g]
        episode.update(zip(members, reference_normalise([sum(turn_rewards[i]) for i in members], scale_by_std)))
    returns = {(i, t): sum(gamma ** (k - t) * turn_rewards[i][k] for k in range(t, len(turn_rewards[i])))
               for i in range(len(turn_rewards)) for t in range(len(turn_rewards[i]))}
    anchors = {}
    for (i, t) in returns:
        anchors.setdefault((groups[i], keys[i][t]) if keys[i] else (i, t), []).append((i, t))
    step = {}
    for members in anchors.values():
        step.update(zip(members, reference_normalise([returns[m] for m in members], scale_by_std)))
    assert any(len(m) > 1 for m in anchors.values())
    for i, per_turn in enumerate(adv):
        assert per_turn == pytest.approx([episode[i] + weight * step[(i, t)] for t in range(len(per_turn))], abs=1e-5)
    assert adv[0] == pytest.approx([episode[0]] * len(adv[0]), abs=1e-6)


def test_gigpo_prefers_the_action_that_leads_on_from_a_shared_state():
    # Two episodes of one puzzle both start on board "s"; one moves on to win, the other bumps and stays.
    adv = gigpo_turn_advantages([[0.0, 1.0], [0.0, 0.0]], [["s", "t"], ["s", "s"]], ["g", "g"], step_gamma=1.0)
    assert adv[0][0] > adv[1][0] and adv[0][0] > 0 > adv[1][1]


def test_a_reward_after_an_untrained_token_goes_to_the_last_action_before_it():
    """GAE reads rewards on trained tokens only. A turn whose end counts the environment's feedback put its reward on
    a feedback token, where GAE dropped it: the episode below trained on rewards of 0. The reward belongs to the last
    token the policy generated before it, as if the turn had ended there."""
    from types import SimpleNamespace

    from rlsys.algorithms.estimators import ADVANTAGE_ESTIMATORS

    # prompt 0-1, turn 1 generates 2-3, feedback 4-5, turn 2 generates 6, feedback 7-8; each turn end counts its
    # feedback (6 and 9), the rewards 0.5 and 1.0 arrive with it.
    def episode(turn_ends):
        return Trajectory(token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13], loss_mask=[0, 0, 1, 1, 0, 0, 1, 0, 0],
                          logprobs=[0, 0, -1.0, -1.0, 0, 0, -1.0, 0, 0], versions=[-1, -1, 0, 0, -1, -1, 0, -1, -1],
                          turn_ends=turn_ends, turn_rewards=[0.5, 1.0], reward=1.5, group_id="g", stop_reason="stop")

    told, ended = sequence_batch([episode([6, 9])]), sequence_batch([episode([4, 7])])
    # Cut after token 6, the last trained one; position k - 1 predicts token k: 0.5 on token 3, 1.0 on token 6.
    assert told.lengths == ended.lengths == [7]
    assert told.sequences("token_rewards")[0].tolist() == [0, 0, 0.5, 0, 0, 1.0]
    assert {k: v.tolist() for k, v in told.fields.items()} == {k: v.tolist() for k, v in ended.fields.items()}
    # By hand, gamma 0.9, lambda 1, V = 0: token 6: 1.0; token 3: 0.5 + 0.9 * 1.0 = 1.4; token 2: 0.9 * 1.4 = 1.26.
    ppo = SimpleNamespace(gamma=0.9, lambd=1.0, whiten_advantages=False)
    told.fields["old_values"] = torch.zeros(told.num_tokens + 1)
    out = ADVANTAGE_ESTIMATORS["gae"]([episode([6, 9])], told, ppo)
    assert told.sequences(out["advantages"])[0].tolist() == pytest.approx([0, 1.26, 1.4, 0, 0, 1.0])
    # A trajectory that records no turn has its episode reward (what grpo and reinforce read) on its last trained
    # token; a reward no trained token precedes rewards no action.
    plain = Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 1, 1, 0], logprobs=[0, -1.0, -1.0, 0],
                       versions=[-1, 0, 0, -1], turn_ends=[], turn_rewards=[], reward=2.0, group_id="g",
                       stop_reason="stop")
    assert sequence_batch([plain]).sequences("token_rewards")[0].tolist() == [0, 2.0]
    early = Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1.0, -1.0],
                       versions=[-1, -1, 0, 0], turn_ends=[2, 4], turn_rewards=[3.0, 1.0], reward=4.0, group_id="g",
                       stop_reason="stop")
    assert sequence_batch([early]).sequences("token_rewards")[0].tolist() == [0, 0, 1.0]


def test_per_turn_values_land_on_each_turns_generated_tokens():
    # prompt(2) turn1(2) feedback(2) turn2(3): token ids 0..8; shifted positions 0..7 predict tokens 1..8.
    loss_mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
    values = per_turn_to_tokens([4, 9], [0.5, -2.0], loss_mask)
    assert values.tolist() == [0, 0.5, 0.5, 0, 0, -2.0, -2.0, -2.0]


# ---- PPO loss -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_aggregation_modes_match_reference_values_and_gradients(agg):
    logp, old, adv, mask = random_ppo_inputs(5)
    check_against_reference(logp, old, adv, mask, 0.2, agg=agg)


def test_ppo_defaults_are_unchanged():
    logp, old, adv, mask = random_ppo_inputs(6)
    default, stats = ppo_clip_loss(logp, old, adv, mask, 0.2)
    explicit, explicit_stats = ppo_clip_loss(logp, old, adv, mask, 0.2, dual_clip=None, agg="token-mean",
                                             behaviour_logprobs=None, imp_weight_cap=None)
    assert default.item() == explicit.item() and set(stats) == {"clip_fraction", "importance_ratio"} == set(
        explicit_stats)
    # Decoupled with behaviour == proximal: every weight is 1, the loss is the plain PPO loss.
    decoupled, decoupled_stats = ppo_clip_loss(logp, old, adv, mask, 0.2, behaviour_logprobs=old.clone())
    assert decoupled.item() == pytest.approx(default.item(), abs=1e-12)
    assert decoupled_stats["importance_weight_mean"] == decoupled_stats["importance_weight_max"] == 1


def test_an_untrained_token_leaves_the_loss_and_its_gradient_finite():
    """Off the trained tokens old_logp is whatever the trajectory recorded (the checks on a trajectory admit any
    finite logprob). A learner logprob above it by more than about 88 made exp(logp - old_logp) inf there, and the
    0 advantage and 0 loss weight turned it into a NaN loss, NaN gradients and a NaN importance_ratio: every update
    with such a token was skipped as non-finite. In float32, as the learner computes them."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-1.1, -200.0, -0.4]], dtype=torch.float32)  # token 1 untrained: 198 below the learner
    adv = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float32)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float32)
    for kwargs in ({}, {"dual_clip": 3.0}, {"behaviour_logprobs": old.clone()}):
        logp.grad = None
        loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, **kwargs)
        loss.backward()
        # By hand, token-mean over tokens 0 and 2, both inside the clip range:
        # token 0: A = 1, r = e^0.1, loss -e^0.1; token 2: A = -1, r = e^-0.1, loss e^-0.1.
        assert loss.item() == pytest.approx((-math.exp(0.1) + math.exp(-0.1)) / 2, abs=1e-6)
        assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.1) / 2, 0.0, math.exp(-0.1) / 2], abs=1e-6)
        assert stats["importance_ratio"].item() == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2, abs=1e-6)


def test_a_trained_token_the_policy_moved_by_more_than_e88_leaves_the_loss_and_gradients_finite():
    """On a trained token exp(logp - old_logp) overflowed float32 past a gap of about 88: with A < 0 the loss was inf,
    with A > 0 the clip picked the finite branch but the gradient was 0 * inf = NaN, and k3 against a reference the
    policy fell 100 below was inf. Each skipped the whole update as non-finite. The log-ratio and k3's exponent are
    clamped to +-20 (verl's bound): past it the token passes no gradient; ordinary values are unchanged."""
    logp = torch.tensor([[0.0, 0.0, -1.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-100.0, -100.0, -1.1]], dtype=torch.float32)  # tokens 0 and 1: e^100 more likely now
    adv = torch.tensor([[-1.0, 1.0, 1.0]], dtype=torch.float32)
    mask = torch.ones(1, 3)
    for kwargs, token0 in (({}, math.exp(20)), ({"dual_clip": 3.0}, 3.0)):
        logp.grad = None
        loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, **kwargs)
        loss.backward()
        # By hand: token 0, A = -1, ratio clamped to e^20 (or the dual bound 3); token 1, A = 1, clipped at 1.2;
        # token 2 inside the clip, ratio e^0.1, gradient -A * ratio / 3.
        assert loss.item() == pytest.approx((token0 - 1.2 - math.exp(0.1)) / 3, rel=1e-6)
        assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -math.exp(0.1) / 3], abs=1e-6)
        assert stats["importance_ratio"].item() == pytest.approx((2 * math.exp(20) + math.exp(0.1)) / 3, rel=1e-6)
    logp = torch.tensor([[-100.0, -1.0, -1.0]], requires_grad=True)  # token 0: 99.5 below the reference
    ref = torch.tensor([[-0.5, -1.0, -1.5]])
    kl = kl_k3(logp, ref, mask)
    kl.sum().backward()
    # By hand: k3 = e^d - d - 1 with d = ref - logp clamped to 20, gradient 1 - e^d inside the bound, 0 past it.
    assert kl[0].tolist() == pytest.approx([math.exp(20) - 21, 0.0, math.exp(-0.5) + 0.5 - 1], rel=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, 1 - math.exp(-0.5)], abs=1e-6)
    assert torch.isfinite(kl_penalty(logp, ref, mask))


def test_kl_estimators_match_their_definitions_by_hand():
    """ppo.kl_estimator, verl's kl_loss_type: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = e^(ref - logp) -
    (ref - logp) - 1; each 0 where the mask is 0, with its gradient there."""
    from rlsys.algorithms import choices
    from rlsys.algorithms.ppo import KL_ESTIMATORS

    assert tuple(KL_ESTIMATORS) == choices.KL_ESTIMATORS == ("k1", "k2", "k3")
    ref = torch.tensor([[-1.0, -1.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    d = [0.5, -0.5, 0.0]  # logp - ref on the trained tokens
    expected = {  # estimator: (per-token values, d value / d logp), by hand
        "k1": ([0.5, -0.5, 0.0], [1.0, 1.0, 1.0]),
        "k2": ([0.125, 0.125, 0.0], [0.5, -0.5, 0.0]),
        "k3": ([math.exp(-x) + x - 1 for x in d], [1 - math.exp(-x) for x in d]),
    }
    for name, (values, grads) in expected.items():
        logp = torch.tensor([[-0.5, -1.5, -2.0, -300.0]], dtype=torch.float64, requires_grad=True)
        kl = KL_ESTIMATORS[name](logp, ref, mask)
        kl.sum().backward()
        assert kl[0].tolist() == pytest.approx(values + [0.0]), name
        assert logp.grad[0].tolist() == pytest.approx(grads + [0.0]), name
        assert kl_penalty(logp, ref, mask, name).item() == pytest.approx(sum(values) / 3), name


def test_a_behaviour_weight_past_e88_without_a_cap_leaves_the_loss_and_gradients_finite():
    """Decoupled PPO's behaviour weight exp(old_logp - behaviour_logprobs) overflowed float32 past a log gap of about
    88: with behaviour_imp_weight_cap=0 (no cap) the token's loss was inf (NaN where its loss was 0) and the whole
    update was skipped as non-finite. Its exponent is clamped to +-20 as the PPO log-ratio's is."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.1]])  # the ratio is 1 on tokens 0 and 1, e^0.1 on token 2
    behaviour = torch.tensor([[-100.0, -100.0, -1.0]])  # tokens 0 and 1: e^99 less likely to the sampler
    adv = torch.tensor([[1.0, 0.0, 1.0]])  # token 1's loss is 0: 0 * inf was NaN
    loss, stats = ppo_clip_loss(logp, old, adv, torch.ones(1, 3), 0.2, behaviour_logprobs=behaviour)
    loss.backward()
    # By hand: token 0, -A * 1 * e^20; token 1, 0; token 2, -A * e^0.1 * e^-0.1 = -1; the mean over 3 tokens.
    assert loss.item() == pytest.approx((-math.exp(20) - 1) / 3, rel=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(20) / 3, 0.0, -1 / 3], rel=1e-6)
    assert stats["importance_weight_max"].item() == pytest.approx(math.exp(20), rel=1e-6)


def test_aggregate_token_loss_rejects_unknown_modes():
    with pytest.raises(ValueError):
        aggregate_token_loss(torch.ones(2, 3), torch.ones(2, 3), "seq-sum")
    with pytest.raises(ValueError):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2, dual_clip=1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_dual_clip_matches_reference_on_random_data(agg):
    logp, old, adv, mask = random_ppo_inputs(7)
    old = logp.detach() - torch.randn_like(old).abs() * 1.5  # ratios well above 1 + clip: bound often active
    _, stats = check_against_reference(logp, old, adv, mask, 0.2, dual_clip=2.0, agg=agg)
    assert 0 < stats["dual_clip_fraction"] < 1


def test_dual_clip_bounds_negative_advantage_loss():
    # Token 0: A = -1, ratio e^2 ~ 7.39: PPO's max() gives 7.39, the dual clip bounds it at -A*c = 3, no gradient.
    # Token 1: A = +1, same ratio: the ordinary clip applies (loss -1.2), the dual clip never touches A > 0.
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, 0.2)
    assert plain.item() == pytest.approx((math.exp(2) - 1.2) / 2)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    assert stats["dual_clip_fraction"] == 0.5


def test_clip_higher_raises_only_the_upper_bound_and_composes_with_dual_clip_and_decoupled():
    """DAPO's clip-higher (ppo.pg_clip_high): the ratio is clipped to [1 - pg_clip, 1 + pg_clip_high]."""
    logp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    # Ratios e^0.24 (inside 1.28, over 1.2), e^0.3 (over both), e^-0.25 (under 0.8) and e^2 (A < 0: dual clip)
    old = torch.tensor([[-0.24, -0.3, 0.25, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    for kwargs, weight in (({}, 1.0), ({"behaviour_logprobs": old - 0.5}, math.exp(0.5))):
        logp.grad = None
        loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, clip_high=0.28, dual_clip=3.0, **kwargs)
        loss.backward()
        # By hand: token 0 unclipped, -e^0.24; token 1 at the upper bound, -2 * 1.28; token 2 at the lower bound,
        # 0.8 (as without clip-higher); token 3 the dual bound, 3. Only token 0 has a gradient, -A r / 4.
        expected = (-math.exp(0.24) - 2 * 1.28 + 0.8 + 3.0) / 4
        assert loss.item() == pytest.approx(weight * expected)
        assert logp.grad[0].tolist() == pytest.approx([-weight * math.exp(0.24) / 4, 0.0, 0.0, 0.0])
        assert stats["clip_fraction"].item() == pytest.approx(2 / 4)  # tokens 1 and 2 (token 3's ratio is unclipped)
        assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 4)
    symmetric, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, dual_clip=3.0)
    assert symmetric.item() == pytest.approx((-1.2 - 2 * 1.2 + 0.8 + 3.0) / 4)
    assert stats["clip_fraction"].item() == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="clip_high must be positive"):
        ppo_clip_loss(logp, old, adv, mask, 0.2, clip_high=-0.1)


def test_sequence_level_ratio_is_gspos_one_ratio_per_packed_sequence():
    """ppo.importance_sampling_level=sequence (GSPO, Zheng et al. 2025): each sequence's ratio is exp(mean over its
    trained tokens of logp - old_logp), on every one of its tokens, clipped with the same bounds. One packed row of two
    sequences and padding; an untrained token of sequence 0, 199 above its recorded logprob, stays out of its mean."""
    logp = torch.zeros(1, 7, dtype=torch.float64, requires_grad=True)
    # sequence 0: positions 0-3, trained 1 and 2 (log-ratios 0.1 and 0.3: mean 0.2); sequence 1: positions 4-5,
    # both trained (0.2 and -0.4: mean -0.1); position 6 padding (index 2)
    old = torch.tensor([[0.0, -0.1, -0.3, -199.0, -0.2, 0.4, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 1.0, 1.0, 0.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    index = torch.tensor([[0, 0, 0, 0, 1, 1, 2]])
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    for clip_high, loss0, grad0 in ((None, -1.2, 0.0), (0.28, -s0, -s0 / 4)):
        logp.grad = None
        loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, clip_high=clip_high, sequence_index=index,
                                    sequences=3)
        loss.backward()
        # By hand, token-mean over 4 tokens: sequence 0 (A = 1) at s0 = e^0.2, over the upper bound 1.2 (clipped, no
        # gradient) and under 1.28; sequence 1 (A = -1) at s1 = e^-0.1 inside, loss s1 a token. d s / d logp_t is
        # s / 2 for each of a sequence's two trained tokens, so each of them gets 2 * (-A) * s / 2 / 4.
        assert loss.item() == pytest.approx((2 * loss0 + 2 * s1) / 4)
        assert logp.grad[0].tolist() == pytest.approx([0, grad0, grad0, 0, s1 / 4, s1 / 4, 0])
        assert stats["importance_ratio"].item() == pytest.approx((2 * s0 + 2 * s1) / 4)
        assert stats["clip_fraction"].item() == pytest.approx(0.5 if clip_high is None else 0.0)
    token_level, _ = ppo_clip_loss(logp, old, adv, mask, 0.2)  # e^0.1 and e^0.3; e^0.2 and e^-0.4
    assert token_level.item() == pytest.approx((-math.exp(0.1) - 1.2 + math.exp(0.2) + 0.8) / 4)


def test_decoupled_loss_matches_reference_values_and_gradients():
    logp, old, adv, mask = random_ppo_inputs(8)
    behaviour = old - torch.randn_like(old) * 0.5
    for agg in ("token-mean", "seq-mean-token-sum"):
        _, stats = check_against_reference(logp, old, adv, mask, 0.2, agg=agg, behaviour_logprobs=behaviour)
        weights = [math.exp(o - b) for o, b, m in zip(old.flatten().tolist(), behaviour.flatten().tolist(),
                                                       mask.flatten().tolist()) if m]
        assert stats["importance_weight_mean"] == pytest.approx(sum(weights) / len(weights))
        assert stats["importance_weight_max"] == pytest.approx(max(weights))
    cap = sorted(w for w in weights if w > 1)[0] + 1e-6  # every weight above the smallest one over 1 is dropped
    _, stats = check_against_reference(logp, old, adv, mask, 0.2, behaviour_logprobs=behaviour, imp_weight_cap=cap)
    dropped = sum(1 for w in weights if w > cap) / len(weights)
    assert stats["importance_weight_capped_fraction"] == pytest.approx(dropped) and 0 < dropped < 1


def test_decoupled_weight_cap_masks_a_token():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    proximal = torch.tensor([[-1.1, -0.9, -1.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.1, -3.0, -1.2]], dtype=torch.float64)  # token 1: weight e^2.1 ~ 8.2 > cap 5
    adv = torch.tensor([[1.0, 2.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = ppo_clip_loss(logp, proximal, adv, mask, 0.2, behaviour_logprobs=behaviour, imp_weight_cap=5.0)
    loss.backward()
    token0 = -1.0 * math.exp(0.1) * 1.0  # ratio e^0.1 inside the clip range, weight 1
    token2 = 0.5 * 1.0 * math.exp(0.2)  # ratio 1, weight e^0.2
    assert loss.item() == pytest.approx((token0 + token2) / 3)  # capped token: 0, still counted in the mean
    assert logp.grad[0, 1].item() == 0 and logp.grad[0, 0].item() != 0 and logp.grad[0, 2].item() != 0
    assert stats["importance_weight_max"] == pytest.approx(math.exp(2.1))
    assert stats["importance_weight_capped_fraction"] == pytest.approx(1 / 3)
    uncapped, _ = ppo_clip_loss(logp, proximal, adv, mask, 0.2, behaviour_logprobs=behaviour)
    assert uncapped.item() == pytest.approx((token0 - 2.0 * math.exp(-0.1) * math.exp(2.1) + token2) / 3)


# ---- KL controllers -----------------------------------------------------------------------------------------------

def test_adaptive_kl_controller_follows_the_reference_and_moves_kl_to_target():
    controller = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    expected = 0.1
    for kl in (12.0, 6.3, 5.0, 0.1):
        expected *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 256 / 10000
        assert controller.update(kl, 256) == pytest.approx(expected)
    assert controller.value == pytest.approx(expected)
    saturated = AdaptiveKLController(1.0, target_kl=1.0, horizon=100)
    assert saturated.update(50.0, 100) == pytest.approx(1.2)  # error clipped to +0.2
    assert saturated.update(0.0, 100) == pytest.approx(1.2 * 0.8)  # and to -0.2
    # A policy whose KL falls as the penalty rises (KL = 1 / beta): the controller drives KL to the target.
    controller, kl = AdaptiveKLController(0.05, target_kl=4.0, horizon=1000), 20.0
    gaps = []
    for _ in range(300):
        controller.update(kl, 100)
        kl = 1 / controller.value
        gaps.append(abs(kl - 4.0))
    assert gaps[-1] < 0.05 < gaps[0] and all(b <= a + 1e-9 for a, b in zip(gaps, gaps[1:]))


def test_adaptive_kl_coefficient_stays_positive_over_steps_of_many_horizons():
    """A step of 60 sequences at kl_horizon 10: the linear factor 1 - 0.2 * 6 would make beta negative, a KL penalty
    turned into a reward for leaving the reference; per horizon beta moves by 20% at most, so by 0.8 or 1.2 ** 6."""
    low, high = (AdaptiveKLController(0.1, target_kl=1.0, horizon=10) for _ in range(2))
    assert low.update(0.0, 60) == pytest.approx(0.1 * 0.8 ** 6) and low.value > 0
    assert high.update(50.0, 60) == pytest.approx(0.1 * 1.2 ** 6)
    assert low.update(0.0, 25) == pytest.approx(0.1 * 0.8 ** 8 * (1 - 0.2 * 0.5))  # two horizons and a half


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 1000) == 0.05 and controller.value == 0.05


def test_lr_schedules_warm_up_then_decay_to_zero():
    from rlsys.algorithms.schedule import lr_multiplier

    assert [lr_multiplier(s, 4, 12, "constant") for s in (0, 2, 4, 12)] == [0.0, 0.5, 1.0, 1.0]
    assert [lr_multiplier(s, 4, 12, "linear") for s in (4, 8, 12)] == [1.0, 0.5, 0.0]
    assert [round(lr_multiplier(s, 0, 10, "cosine"), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    # The learner's update k takes multiplier k (docs/learner.md): over a run of 12 updates with 4 of warm-up the
    # first has rate 0 and the last, update 11, 1/8 (linear) or (1 + cos(7/8 pi)) / 2 (cosine), 0 only after it.
    assert lr_multiplier(0, 4, 12, "linear") == 0 and lr_multiplier(11, 4, 12, "linear") == 1 / 8
    assert lr_multiplier(11, 4, 12, "cosine") == pytest.approx((1 + math.cos(7 / 8 * math.pi)) / 2)


def test_every_choice_the_config_accepts_has_an_implementation():
    """The config checks ppo.adv_estimator and ppo.loss_agg_mode against rlsys/algorithms/choices.py (no torch);
    the learner looks them up in the tables that implement them."""
    from rlsys.algorithms import choices
    from rlsys.algorithms.estimators import ADVANTAGE_ESTIMATORS

    assert tuple(ADVANTAGE_ESTIMATORS) == choices.ADVANTAGE_ESTIMATORS
    assert choices.NEEDS_CRITIC <= set(choices.ADVANTAGE_ESTIMATORS)
    mask, index = torch.ones(3), torch.zeros(3, dtype=torch.long)  # one sequence of 3 generated tokens
    sums = [token_loss_weights(mask, index, mode).sum().item() for mode in choices.LOSS_AGG_MODES]
    assert sums == pytest.approx([1.0, 1.0, 3.0])  # token-mean, seq-mean-token-mean, seq-mean-token-sum
