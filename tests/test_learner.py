"""The learner on its own: PPO steps move probability toward the rewarded answer; weights are published."""

import asyncio
import dataclasses
import itertools
import math
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from experiments import AsyncPPOMATHConfig
from rlsys import protocol
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import Trajectory
from rlsys.api.messages import WorkerStatus, parse_published_weights
from rlsys.bus import InProcessBus
from rlsys.checkpoint import read_trainer_state
from rlsys.cpu_features import has_bf16_flag, native_bf16
from rlsys.engine.weights import WEIGHTS_FILE
from rlsys.training_step import packs, shares_prefixes
from rlsys.weight_checksum import weights_checksum
from rlsys.weight_transport import fetch
from rlsys.workers.inference_status import InferenceStatus
from rlsys.workers.learner import STOP_POLL_SECONDS, Learner, serve_until_stopped
from rlsys.workers.rollout_worker import RolloutWorker
from tests.helpers import save_random_tiny_model

PROMPT, GOOD, BAD = [4, 7, 8, 78, 9, 10, 86, 1, 5], [10, 12, 1], [11, 11, 1]


def answer_logprob(model, answer: list[int]) -> float:
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        return gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0, -len(answer):].sum().item()


def trajectory(model, answer: list[int], reward: float, staleness_shift: float = 0.0, version: int = 0,
               group_id: str = "g") -> Trajectory:
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        behaviour = gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0, -len(answer):]
    n = len(PROMPT)
    return Trajectory(token_ids=PROMPT + answer, loss_mask=[0] * n + [1] * len(answer),
                      logprobs=[0.0] * n + (behaviour - staleness_shift).tolist(),
                      versions=[-1] * n + [version] * len(answer),
                      turn_ends=[n + len(answer)], turn_rewards=[reward], reward=reward, group_id=group_id,
                      stop_reason="stop")


def learner_config(tmp_path) -> AsyncPPOMATHConfig:
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    return config


SETTINGS = {  # name -> (ppo overrides, expected mean |advantage| for rewards 1, 0, 1, 0)
    "grpo+kl": ({}, 1.0),
    "reinforce": ({"adv_estimator": "reinforce"}, 0.5),
    "dr-grpo+dual-clip+seq-mean": ({"grpo_scale_by_std": False, "dual_clip": 3.0,
                                    "loss_agg_mode": "seq-mean-token-mean"}, 0.5),
    "decoupled+adaptive-kl": ({"decoupled_loss": True, "target_kl": 1e-4, "kl_horizon": 10}, 1.0),
    "gae+whiten+padded": ({"adv_estimator": "gae", "whiten_advantages": True, "sequence_packing": False}, None),
    "gspo+clip-higher+decoupled+k2": ({"importance_sampling_level": "sequence", "pg_clip_high": 0.28,
                                       "decoupled_loss": True, "kl_estimator": "k2", "target_kl": 1e-4,
                                       "kl_horizon": 10, "loss_agg_mode": "seq-mean-token-mean"}, 1.0),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_ppo_steps_prefer_the_rewarded_answer(tmp_path, name):
    config = learner_config(tmp_path)
    config.ppo.lr, config.ppo.init_kl_coef = 1e-3, 0.1
    overrides, expected_advantage = SETTINGS[name]
    for key, value in overrides.items():
        setattr(config.ppo, key, value)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    good_before, bad_before = answer_logprob(learner.model, GOOD), answer_logprob(learner.model, BAD)
    shift = 0.3 if config.ppo.decoupled_loss else 0.0  # behaviour policy older than the learner's

    coefs = []
    for _ in range(5):
        batch = [trajectory(learner.model, GOOD, 1.0, shift), trajectory(learner.model, BAD, 0.0, shift)] * 2
        stats = learner.train_step(batch)
        coefs.append(stats["kl_coef"])
    assert answer_logprob(learner.model, GOOD) > good_before + 0.5
    assert answer_logprob(learner.model, BAD) < bad_before - 0.5
    assert stats["kl"] > 0 and stats["reward"] == 0.5 and stats["grad_norm"] > 0
    if expected_advantage is not None:
        assert abs(stats["advantage_abs_mean"] - expected_advantage) < 1e-3
    if config.ppo.adv_estimator == "gae":
        assert stats["critic/value_loss"] > 0 and stats["critic/grad_norm"] > 0
        assert abs(stats["advantage_mean"]) < 1e-5  # whitened
    assert ("dual_clip_fraction" in stats) == bool(config.ppo.dual_clip)
    if config.ppo.decoupled_loss:
        assert abs(stats["importance_weight_mean"] - torch.exp(torch.tensor(shift)).item()) < 1e-3
        assert coefs[-1] > coefs[0]  # KL above a tiny target: the adaptive coefficient grows
    else:
        assert coefs == [0.1] * 5


def test_learner_publishes_weights_for_inference_from_memory_and_on_disk(tmp_path):
    """The default stream: the announcement names the learner's weight server, which serves the version in the
    inference dtype with its checksum; with weights_transport=disk, a file and the checksum in the announcement."""
    config = learner_config(tmp_path)
    config.inference.dtype = "bfloat16"
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.version = 7
    learner.publish_weights()
    published = parse_published_weights(bus.get(protocol.WEIGHTS))
    assert published.version == 7 and published.path == "" and published.address.startswith("127.0.0.1:")
    received = fetch(published.address, published.token)
    state = learner.model.state_dict()
    assert received.version == 7 and received.checksum == weights_checksum(state, "bfloat16")
    assert all(torch.equal(received.weights[name], state[name].bfloat16()) for name in state)
    learner.weight_server.close()

    config.cluster.weights_transport = "disk"
    learner = Learner(config, bus, tmp_path / "run")
    learner.version = 8
    learner.publish_weights()
    published = bus.get(protocol.WEIGHTS)
    assert {k: published[k] for k in ("version", "path", "dtype")} == {
        "version": 8, "path": str(tmp_path / "run" / "weights" / "v8"), "dtype": "bfloat16"}
    assert published["checksum"] == weights_checksum(learner.model.state_dict(), "bfloat16")
    assert (tmp_path / "run" / "weights" / "v8" / WEIGHTS_FILE).exists() and learner.weight_server is None


def test_the_last_version_is_served_until_the_run_stops(tmp_path):
    """An inference worker started after the learner's last step (a restart, a lost Ray node) fetches the final
    version from the learner, which serves it until the run stops; the final evaluation waits for that version."""
    config = learner_config(tmp_path)
    config.max_steps = 0
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.version = 3
    learner.run()  # publishes version 3 and ends: nothing left to train
    assert bus.get(protocol.LEARNER_DONE) == 3
    serving = threading.Thread(target=serve_until_stopped, args=(bus, learner.weight_server))
    serving.start()
    published = parse_published_weights(bus.get(protocol.WEIGHTS))
    time.sleep(2 * STOP_POLL_SECONDS)
    assert fetch(published.address, published.token).version == 3
    bus.set(protocol.STOP, 1)
    serving.join(timeout=10 * STOP_POLL_SECONDS)
    assert not serving.is_alive()
    with pytest.raises(OSError):
        fetch(published.address, published.token)


def test_mini_batches_and_warm_up_drive_the_optimizer(tmp_path):
    config = learner_config(tmp_path)
    config.max_steps, config.ppo.lr = 10, 1e-3
    config.ppo.ppo_epochs, config.ppo.num_mini_batches, config.ppo.warmup_steps = 2, 2, 8
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    lrs = []
    for _ in range(3):
        batch = [trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)] * 2
        lrs.append(learner.train_step(batch)["lr"])
    state = learner.optimizer.state_dict()["state"]
    assert next(iter(state.values()))["step"].item() == 3 * 2 * 2  # steps x epochs x mini-batches
    assert lrs == pytest.approx([3 / 8 * 1e-3, 7 / 8 * 1e-3, 1e-3])  # lr of each step's last mini-batch


def test_a_step_takes_as_many_updates_as_mini_batches_of_balanced_sizes_whatever_its_sequences(tmp_path):
    """6 sequences in 4 mini-batches: cut into chunks of 2 they would be 3 (one optimizer step short of what the
    learning-rate schedule counts on); balanced, they are 2, 2, 1 and 1."""
    config = learner_config(tmp_path)
    config.ppo.ppo_epochs, config.ppo.num_mini_batches = 2, 4
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    sizes = []
    optimizer_step = learner.optimizer_step
    learner.optimizer_step = lambda mini_batch, *args: (sizes.append(len(mini_batch)),
                                                        optimizer_step(mini_batch, *args))[1]
    learner.train_step([trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)] * 3)
    assert sizes == [2, 2, 1, 1] * 2
    assert next(iter(learner.optimizer.state_dict()["state"].values()))["step"].item() == 2 * 4


def test_uniform_groups_are_filtered_and_give_their_gate_slot_back(tmp_path):
    config = learner_config(tmp_path)
    config.ppo.batch_size, config.ppo.filter_uniform_groups = 2, True
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.ledger.hold_slots(1)  # and the four admitted below take theirs

    def group(rewards):
        learner.ledger.admit(str(rewards), served_version=10)
        return {"group_id": str(rewards),
                "trajectories": [trajectory(learner.model, GOOD if r else BAD, r, group_id=str(rewards)).to_dict()
                                 for r in rewards]}

    for rewards in ([0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]):
        bus.stream_add(protocol.TRAJECTORIES, group(rewards))
    batch = learner.wait_for_batch()
    assert [[t.reward for t in g.trajectories] for g in batch] == [[1.0, 0.0], [0.0, 1.0]]
    assert learner.filtered_groups == 2
    assert learner.consumed_prompts == ["[0.0, 0.0]", "[1.0, 1.0]"]  # trained groups join after their step
    assert learner.ledger.slots_taken() == 3
    counts = learner.ledger.counts()
    assert counts["filtered"] == {"uniform_reward": 2} and counts["in_flight"] == 2
    # filtered groups are acknowledged (so deleted) at once; the batch's stay pending until their step
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 2
    assert bus.stream_length(protocol.TRAJECTORIES) == 2


def test_under_starpo_uniform_groups_are_those_whose_summed_turn_rewards_are_equal(tmp_path):
    """starpo's baseline compares each episode's summed turn rewards, not its `reward` (equal for the built-in agents,
    not for a plugin that scores turns apart from the episode). The filter compared `reward`: it dropped a group
    starpo trains on and kept one it gives advantage 0 everywhere."""
    from rlsys.algorithms.advantages import starpo_advantages

    config = learner_config(tmp_path)
    config.ppo.batch_size, config.ppo.filter_uniform_groups, config.ppo.adv_estimator = 1, True, "starpo"
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")

    def group(name, rewards, turn_rewards):
        learner.ledger.admit(name, served_version=10)
        return {"group_id": name, "trajectories": [
            dataclasses.replace(trajectory(learner.model, GOOD, r, group_id=name), turn_rewards=[turn]).to_dict()
            for r, turn in zip(rewards, turn_rewards)]}

    equal_sums, different_sums = ([1.0, 0.0], [0.5, 0.5]), ([1.0, 1.0], [1.0, 0.0])
    assert starpo_advantages([[t] for t in equal_sums[1]], ["g", "g"]).tolist() == [0.0, 0.0]  # nothing to train
    trained = starpo_advantages([[t] for t in different_sums[1]], ["g", "g"])
    assert trained.abs().tolist() == pytest.approx([1, 1], abs=1e-5)
    for name, (rewards, turns) in (("equal_sums", equal_sums), ("different_sums", different_sums)):
        bus.stream_add(protocol.TRAJECTORIES, group(name, rewards, turns))
    batch = learner.wait_for_batch()
    assert [g.group_id for g in batch] == ["different_sums"] and learner.filtered_groups == 1
    assert learner.ledger.counts()["filtered"] == {"uniform_reward": 1}


def test_a_stop_ends_the_wait_for_a_batch_and_takes_no_group(tmp_path):
    """The wait reads STOP with the bus server's id in one round trip before each read of the stream: a stop set while
    groups wait still ends it, with none of them taken."""
    config = learner_config(tmp_path)
    config.ppo.batch_size = 2
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.ledger.admit("g", served_version=10)
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "g", "trajectories": [
        trajectory(learner.model, GOOD, 1.0, group_id="g").to_dict()]})
    bus.set(protocol.STOP, 1)
    assert learner.wait_for_batch() is None
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 0
    assert bus.stream_length(protocol.TRAJECTORIES) == 1 and learner.consumed_prompts == []


def test_the_gate_lets_a_slow_episode_fall_behind_and_the_learner_refuses_it_as_too_stale(tmp_path):
    """The staleness gate bounds how many prompts are in flight, not how old one is: the learner takes groups in
    the order their episodes end, so a slow one admitted at version 0 outlives the newer prompts admitted as the
    served version rises. The learner refuses it (filtered as too_stale) and its gate slot refills at once."""
    config = learner_config(tmp_path)
    config.ppo.batch_size, config.max_head_offpolicyness = 2, 1
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    gate, status = RolloutWorker(config, bus, 0), InferenceStatus(bus, 0)
    admitted_at: dict[str, int] = {}  # prompt -> the version inference served when the gate admitted it

    def serve(version: int) -> None:  # the inference worker's heartbeat, as the gate reads it
        status.publish(WorkerStatus(epoch=1, beat=version, version=version, load=0))
        gate.router.workers.refresh()

    prompts = (SimpleNamespace(qid=f"p{i}") for i in itertools.count())

    def admit_while_the_gate_opens() -> list[str]:
        new = []
        while prompt := asyncio.run(gate.admit(prompts)):
            new.append(prompt.qid)
            admitted_at[prompt.qid] = gate.router.workers.served_version()
        assert gate.ledger.slots_taken() == gate.ledger.capacity(gate.router.workers.served_version())
        return new

    def episode_ends(qid: str) -> None:  # generated by the version served when it was admitted
        group = [trajectory(learner.model, answer, reward, version=admitted_at[qid], group_id=qid)
                 for answer, reward in ((GOOD, 1.0), (BAD, 0.0))]
        bus.stream_add(protocol.TRAJECTORIES, {"group_id": qid, "trajectories": [t.to_dict() for t in group]})

    serve(0)
    slow, *running = admit_while_the_gate_opens()  # (0 + eta + 1) * batch_size = 4 prompts
    staleness = []
    for step in range(4):
        if step == 3:
            episode_ends(slow)  # it ends at last, 3 versions after the one that generated it
        for qid in running[:2]:  # the others end in the order they were admitted
            episode_ends(qid)
        running = running[2:]
        batch = learner.wait_for_batch()
        staleness += [learner.version - admitted_at[group.group_id] for group in batch]
        for group in batch:  # what Learner.run does once the step is trained
            learner.ledger.trained(group.group_id)
            learner.inbox.ack([group.entry_id])
        learner.version += 1
        serve(learner.version)
        running += admit_while_the_gate_opens()
    assert max(staleness) <= config.max_head_offpolicyness, staleness
    counts = learner.ledger.counts()
    assert counts["filtered"] == {"too_stale": 1} and slow in learner.consumed_prompts
    # its slot was given back and taken by a replacement: the gate still holds (version + eta + 1) * batch_size
    assert learner.ledger.slots_taken() == (learner.version + config.max_head_offpolicyness + 1) * 2
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 0


def mixed_length_batch(model, rng, groups: int = 0) -> list[Trajectory]:
    """Trajectories of 3 to 40 tokens, two turns each, with random rewards and stale behaviour logprobs; with
    `groups`, the trajectories of a group share its prompt, as a GRPO group's samples do."""
    batch = []
    prompts = [[rng.randint(4, 90) for _ in range(rng.randint(1, 10))] for _ in range(groups)]
    for i in range(12):
        prompt = prompts[i % groups] if groups else [rng.randint(4, 90) for _ in range(rng.randint(2, 10))]
        answers = [[rng.randint(4, 90) for _ in range(rng.randint(1, 15))] for _ in range(2)]
        feedback = [rng.randint(4, 90) for _ in range(3)]
        ids = prompt + answers[0] + feedback + answers[1]
        mask = [0] * len(prompt) + [1] * len(answers[0]) + [0] * len(feedback) + [1] * len(answers[1])
        with torch.no_grad():
            full = torch.tensor([ids])
            logp = gather_logprobs(next_token_logits(model, full, torch.ones_like(full)), full)[0].tolist()
        behaviour = [0.0] + [lp - 0.1 * rng.random() if m else 0.0 for lp, m in zip(logp, mask[1:])]
        first_end = len(prompt) + len(answers[0])
        rewards = [rng.random(), float(rng.random() > 0.5)]
        batch.append(Trajectory(token_ids=ids, loss_mask=mask, logprobs=behaviour,
                                versions=[v if m else -1 for v, m in zip([0] * len(ids), mask)],
                                turn_ends=[first_end, len(ids)], turn_rewards=rewards, reward=sum(rewards),
                                group_id=f"g{i % 3}", stop_reason="stop"))
    return batch


def accumulated_gradients(learner, trajectories) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one mini-batch through the learner's own micro-batching, without a step."""
    loss = learner.mini_batch_gradients(learner.prepare_batch(trajectories))["loss"]
    models = [learner.model] + ([learner.critic] if learner.critic is not None else [])
    return loss, {f"{i}.{n}": p.grad.clone() for i, m in enumerate(models) for n, p in m.named_parameters()}


@pytest.mark.parametrize("ppo", [
    {"loss_agg_mode": "token-mean", "init_kl_coef": 0.1, "entropy_loss_coef": 0.01},
    {"loss_agg_mode": "seq-mean-token-mean", "decoupled_loss": True, "dual_clip": 3.0},
    {"loss_agg_mode": "seq-mean-token-sum", "adv_estimator": "gae"},
])
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(tmp_path, ppo):
    import random

    results = {}
    for packing, budget in ((True, 64), (False, 64), (False, 10_000)):  # small budgets: many micro-batches
        config = learner_config(tmp_path)
        for key, value in {**ppo, "sequence_packing": packing, "max_tokens_per_micro_batch": budget}.items():
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = mixed_length_batch(learner.model, random.Random(0))
        assert len(learner.micro_batches(learner.prepare_batch(batch))) > (1 if budget == 64 else 0)
        results[(packing, budget)] = accumulated_gradients(learner, batch)
    reference_loss, reference_grads = results[(False, 10_000)]  # one padded micro-batch: no accumulation
    for loss, grads in (results[(True, 64)], results[(False, 64)]):
        assert loss == pytest.approx(reference_loss, abs=1e-5)
        for name, grad in grads.items():
            assert torch.allclose(grad, reference_grads[name], atol=1e-5), name
    assert any(g.abs().max() > 1e-3 for g in reference_grads.values())


@pytest.mark.parametrize("decoupled", [False, True])
def test_a_mini_batchs_statistics_are_those_of_one_pass_however_it_is_split(tmp_path, decoupled):
    """Each micro-batch's statistics are its part of the mini-batch's (means weighted by its tokens' share): added up,
    they are one unsplit pass's, maxima included."""
    import random

    stats = {}
    for packing, budget in ((True, 64), (False, 64), (False, 10_000)):
        config = learner_config(tmp_path)
        for key, value in {"init_kl_coef": 0.1, "decoupled_loss": decoupled, "dual_clip": 3.0,
                           "sequence_packing": packing, "max_tokens_per_micro_batch": budget}.items():
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = learner.prepare_batch(mixed_length_batch(learner.model, random.Random(0)))
        # behaviour logprobs 0 to 1.5 below the policy's: ratios of 1 to 4.5, clipped and dual-clipped
        lower = torch.rand(batch.num_tokens + 1, generator=torch.Generator().manual_seed(0)) * 1.5
        batch.fields["behaviour_logprobs"] = batch.fields["behaviour_logprobs"] - lower * batch.fields["loss_mask"]
        assert len(learner.micro_batches(batch)) > (1 if budget == 64 else 0)
        stats[(packing, budget)] = learner.mini_batch_gradients(batch)
    reference = stats[(False, 10_000)]
    shown = ("importance_weight_mean", "importance_weight_max", "importance_weight_capped_fraction") if decoupled \
        else ("clip_fraction", "dual_clip_fraction")
    assert {"importance_ratio", "entropy", "kl", "policy_loss", "loss", *shown} <= set(reference)
    assert all(reference[key] > 0.01 for key in shown if key != "importance_weight_capped_fraction"), reference
    for split in (stats[(True, 64)], stats[(False, 64)]):
        assert split.keys() == reference.keys()
        for key, value in reference.items():
            assert split[key] == pytest.approx(value, abs=1e-5), key


@pytest.mark.parametrize("ppo", [
    {"loss_agg_mode": "token-mean", "init_kl_coef": 0.1, "entropy_loss_coef": 0.01},
    {"loss_agg_mode": "seq-mean-token-mean", "decoupled_loss": True, "adv_estimator": "gae"},
])
def test_shared_prefixes_give_the_loss_and_gradients_of_unshared_rows(tmp_path, ppo):
    """A group's prompt computed once, its samples attending to it, against every sample computing its own."""
    import random

    results, passes = {}, {}
    for share, budget in (("true", 64), ("true", 10_000), ("false", 10_000)):
        config = learner_config(tmp_path)
        for key, value in {**ppo, "share_prefixes": share, "max_tokens_per_micro_batch": budget}.items():
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        assert learner.share_prefixes == (share == "true")
        batch = mixed_length_batch(learner.model, random.Random(0), groups=3)
        passes[(share, budget)] = learner.micro_batches(learner.prepare_batch(batch))
        results[(share, budget)] = accumulated_gradients(learner, batch)
    shared, small = passes[("true", 10_000)], passes[("true", 64)]
    assert len(small) > 1 and len(shared) == 1 and shared[0].contexts is not None
    computed, unshared = shared[0].num_tokens, sum(mb.num_tokens for mb in passes[("false", 10_000)])
    assert computed < 0.8 * unshared, (computed, unshared)  # each group's prompt once, not four times
    reference_loss, reference_grads = results[("false", 10_000)]
    for loss, grads in (results[("true", 64)], results[("true", 10_000)]):
        assert loss == pytest.approx(reference_loss, abs=1e-5)
        for name, grad in grads.items():
            assert torch.allclose(grad, reference_grads[name], atol=1e-5), name
    assert any(g.abs().max() > 1e-3 for g in reference_grads.values())


def test_sequences_with_no_untrained_prefix_are_balanced_over_the_ranks(tmp_path):
    """A sequence whose first trained token is its first or second has no prefix to share. With shared prefixes on
    (packed rows on a CPU), every such sequence had the empty prefix's id, one group that went to one rank whole: the
    other ranks computed nothing."""
    from rlsys.algorithms.batch import sequence_batch
    from rlsys.distributed import Ranks

    learner = Learner(learner_config(tmp_path), InProcessBus(), tmp_path / "run")
    assert learner.share_prefixes
    learner.ranks = Ranks(0, 2)  # shares() reads only how many ranks there are
    batch = sequence_batch([Trajectory(token_ids=[4 + i] + [10] * (3 + i % 3), loss_mask=[0] + [1] * (3 + i % 3),
                                       logprobs=[0.0] + [-1.0] * (3 + i % 3), versions=[-1] + [0] * (3 + i % 3),
                                       turn_ends=[4 + i % 3], turn_rewards=[1.0], reward=1.0, group_id="g",
                                       stop_reason="stop") for i in range(6)])
    assert batch.prefix_lengths == [0] * 6
    parts = learner.shares(batch)
    assert sorted(i for part in parts for i in part) == list(range(6))
    assert [sum(batch.lengths[i] for i in part) for part in parts] == [15, 15]
    # sequences that do share a prompt still go to one rank together, so that it is computed once
    shared = sequence_batch([trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)] * 2)
    assert sorted(map(len, learner.shares(shared))) == [0, 4]


@pytest.mark.parametrize("ppo", [
    {"loss_agg_mode": "token-mean"},
    {"loss_agg_mode": "seq-mean-token-mean", "decoupled_loss": True, "dual_clip": 3.0,
     "max_tokens_per_micro_batch": 64},
])
def test_a_group_whose_samples_got_one_reward_is_not_computed_and_the_gradients_are_the_same(tmp_path, ppo):
    """Zero-advantage sequences add nothing to a loss that is the policy term alone: left out of the passes, the
    mini-batch's loss and gradients are those of computing them."""
    import dataclasses
    import random

    results, computed = {}, {}
    for skip in (True, False):
        config = learner_config(tmp_path)
        for key, value in {**ppo, "init_kl_coef": 0.0}.items():
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = [dataclasses.replace(t, reward=1.0) if t.group_id == "g0" else t
                 for t in mixed_length_batch(learner.model, random.Random(0), groups=3)]
        prepared = learner.prepare_batch(batch)  # its proximal pass, if any, computes every sequence
        moving = learner.sequences_to_compute(prepared)
        assert moving == [i for i, t in enumerate(batch) if t.group_id != "g0"]
        passes = learner.micro_batches
        learner.micro_batches = lambda mini_batch: computed.setdefault(skip, passes(mini_batch))
        loss = learner.mini_batch_gradients(prepared, moving if skip else None)["loss"]
        results[skip] = loss, {n: p.grad.clone() for n, p in learner.model.named_parameters()}
    assert sum(len(mb.indices) for mb in computed[True]) == 8  # g0's 4 of 12 left out
    assert sum(len(mb.indices) for mb in computed[False]) == 12
    (loss, grads), (reference_loss, reference_grads) = results[True], results[False]
    assert loss == pytest.approx(reference_loss, abs=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grad, reference_grads[name], atol=1e-6), name
    assert any(g.abs().max() > 1e-3 for g in reference_grads.values())
    uniform = learner.prepare_batch([dataclasses.replace(t, reward=1.0) for t in batch])
    assert learner.sequences_to_compute(uniform) == []  # none can move the policy: none is computed


def recorded(micro_batches, passes: list):
    """The learner's micro_batches, each pass it returns also appended to `passes`."""
    def recording(*args, **kwargs):
        out = micro_batches(*args, **kwargs)
        passes.extend(out)
        return out
    return recording


def test_an_update_no_sequence_of_which_can_move_the_policy_computes_none_and_leaves_the_same_weights(tmp_path):
    """Every group's samples got one reward: every advantage is 0, so is every gradient, and no pass computes them.
    The update is still taken, and AdamW's moments and weight decay move the weights exactly as computing every
    sequence (ppo.skip_zero_advantage=false) does."""
    import random

    learners, computed = {}, {}
    for skip in ("auto", "false"):
        config = learner_config(tmp_path)
        config.ppo.init_kl_coef, config.ppo.weight_decay, config.ppo.skip_zero_advantage = 0.0, 0.1, skip
        learner = learners[skip] = Learner(config, InProcessBus(), tmp_path / skip)
        batch = mixed_length_batch(learner.model, random.Random(0), groups=3)
        learner.train_step(batch)  # every sequence computed: the moments the next step moves by
        before = [p.detach().clone() for p in learner.model.parameters()]
        learner.micro_batches = recorded(learner.micro_batches, computed.setdefault(skip, []))
        stats = learner.train_step([dataclasses.replace(t, reward=1.0) for t in batch])
        assert stats["grad_norm"] == 0.0
        assert not all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    assert sum(len(mb.indices) for mb in computed["auto"]) == 0  # no pass at all
    assert sum(len(mb.indices) for mb in computed["false"]) == 2 * 12  # each of the 2 epochs' updates, every one
    auto, every = learners["auto"], learners["false"]
    for (name, a), b in zip(auto.model.named_parameters(), every.model.parameters()):
        assert torch.equal(a, b), name
        moments = zip(auto.optimizer.state[a].values(), every.optimizer.state[b].values())
        assert all(torch.equal(x, y) for x, y in moments), name
    assert auto.scheduler.last_epoch == every.scheduler.last_epoch == 4


@pytest.mark.parametrize("ppo", [{"decoupled_loss": True}, {"tis_cap": 2.0}])
def test_the_proximal_pass_leaves_out_what_no_optimizer_step_computes_and_the_update_is_the_same(tmp_path, ppo):
    """A zero-advantage sequence's proximal logprobs are never read when no step computes it: left out of the
    proximal pass, the policy after a whole train step (2 epochs of 2 mini-batches) is the one computing them gives.
    Nor does the pass compute the first mini-batch's sequences, whose own forward passes fill them in."""
    import dataclasses
    import random

    policies, proximal_passes = {}, {}
    for skip in ("auto", "false"):
        config = learner_config(tmp_path)
        for key, value in {**ppo, "init_kl_coef": 0.0, "skip_zero_advantage": skip, "num_mini_batches": 2}.items():
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = [dataclasses.replace(t, reward=1.0) if t.group_id == "g0" else t
                 for t in mixed_length_batch(learner.model, random.Random(0), groups=3)]
        per_token = learner.per_token  # the proximal pass is the step's only one without gradients here
        learner.per_token = lambda forward, b, sequences=None, _f=per_token: (
            proximal_passes.setdefault(skip, sequences), _f(forward, b, sequences))[1]
        torch.manual_seed(0)  # the same mini-batches
        first = set(torch.randperm(len(batch)).tolist()[:len(batch) // 2])  # train_step's first draw, the same
        torch.manual_seed(0)
        learner.train_step(batch)
        policies[skip] = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    assert proximal_passes["auto"] == [i for i, t in enumerate(batch) if t.group_id != "g0" and i not in first]
    assert proximal_passes["false"] == sorted(set(range(12)) - first)
    for name, weights in policies["auto"].items():
        assert torch.allclose(weights, policies["false"][name], atol=1e-6), name
    assert any((w - Learner(config, InProcessBus(), tmp_path / "run2").model.state_dict()[n]).abs().max() > 1e-4
               for n, w in policies["auto"].items()), "the step must move the policy, or this test proves nothing"


@pytest.mark.parametrize("ppo", [{"decoupled_loss": True}, {"tis_cap": 2.0}])
def test_with_one_mini_batch_the_first_steps_passes_are_the_proximal_ones_and_the_update_is_a_separate_passs(
        tmp_path, ppo):
    """Before a step's first update the policy is the proximal one: with one mini-batch (the default) no pass without
    gradients runs, and the policy after the step (2 epochs) is the one a separate proximal pass gives."""
    import random

    policies, passes = {}, {}
    for separate in (False, True):
        config = learner_config(tmp_path)
        for key, value in {**ppo, "init_kl_coef": 0.0, "lr": 1e-3}.items():  # the second epoch's ratios move
            setattr(config.ppo, key, value)
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = mixed_length_batch(learner.model, random.Random(0), groups=3)
        per_token = learner.per_token
        learner.per_token = lambda forward, b, sequences=None, _f=per_token: (
            passes.setdefault(separate, []).append(sequences), _f(forward, b, sequences))[1]
        if separate:  # the proximal pass over every sequence, before the step, as without mini-batches given
            prepare = learner.prepare_batch
            learner.prepare_batch = lambda trajectories, mini_batches=None: prepare(trajectories)
        torch.manual_seed(0)
        learner.train_step(batch)
        policies[separate] = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    assert False not in passes and passes[True] == [list(range(12))]
    for name, weights in policies[False].items():
        assert torch.allclose(weights, policies[True][name], atol=1e-6), name
    assert any((w - Learner(config, InProcessBus(), tmp_path / "run2").model.state_dict()[n]).abs().max() > 1e-3
               for n, w in policies[False].items()), "the step must move the policy, or this test proves nothing"


@pytest.mark.parametrize("settings", [
    {},  # the CPU's defaults: packed rows, each group's prompt computed once
    {"ppo.sequence_packing": False, "ppo.decoupled_loss": False},  # padded rows, no proximal logprobs to fill
    {"ppo.num_mini_batches": 2, "gen.temperature": 0.7, "ppo.max_tokens_per_micro_batch": 64},
])
def test_the_probe_is_scored_by_the_first_updates_passes_as_a_separate_pass_would(tmp_path, monkeypatch, settings):
    """The probe (rlsys/alarms.py): a sequence of the step's batch with its logprobs under the weights the step
    trained from, at temperature 1, whatever the layout or sampling temperature, and with no pass of its own. The
    first group got one reward, so its sequences are not computed and the probe is another group's."""
    import dataclasses
    import random

    from rlsys import training_step

    monkeypatch.setattr(training_step, "PROBE_TOKENS", 12)
    config = learner_config(tmp_path)
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    config.ppo.init_kl_coef = 0.0
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = [dataclasses.replace(t, reward=1.0) if t.group_id == "g0" else t
             for t in mixed_length_batch(learner.model, random.Random(0), groups=3)]
    before = {}
    for t in batch:
        ids = torch.tensor([t.token_ids[:12]])
        with torch.no_grad():
            before[tuple(t.token_ids[:12])] = gather_logprobs(next_token_logits(learner.model, ids, None), ids)[0]
    per_token = learner.per_token
    passes = []
    learner.per_token = lambda forward, b, sequences=None: (passes.append(sequences), per_token(forward, b,
                                                                                                sequences))[1]
    learner.version = 5
    learner.train_step(batch)
    probe = learner.probe
    assert probe.version == 5 and len(probe.token_ids) == 12 and len(probe.logprobs) == 11
    assert probe.token_ids in [t.token_ids[:12] for t in batch if t.group_id != "g0"]
    assert torch.allclose(torch.tensor(probe.logprobs), before[tuple(probe.token_ids)], atol=1e-5)
    assert all(sequences is not None and sequences != list(range(len(batch))) for sequences in passes), \
        "no pass over the whole batch without gradients: the probe came from the step's own"


@pytest.mark.parametrize("ppo", [{"init_kl_coef": 0.1}, {"init_kl_coef": 0.0, "entropy_loss_coef": 0.01},
                                 {"init_kl_coef": 0.0, "adv_estimator": "gae"},
                                 {"init_kl_coef": 0.0, "skip_zero_advantage": "false"}])
def test_every_sequence_is_computed_when_the_loss_has_a_term_besides_the_policy_or_when_told(tmp_path, ppo):
    """A KL, entropy or value term has gradients where the advantage is 0; ppo.skip_zero_advantage=true is refused
    with one."""
    import dataclasses
    import random

    config = learner_config(tmp_path)
    for key, value in ppo.items():
        setattr(config.ppo, key, value)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = [dataclasses.replace(t, reward=1.0) for t in mixed_length_batch(learner.model, random.Random(0), groups=3)]
    assert learner.sequences_to_compute(learner.prepare_batch(batch)) == list(range(12))
    if "skip_zero_advantage" not in ppo:
        with pytest.raises(ValueError, match="skip_zero_advantage=true needs a loss that is the policy term alone"):
            dataclasses.replace(config.ppo, skip_zero_advantage="true")


def test_gae_places_turn_rewards_and_the_critic_is_checkpointed(tmp_path):
    import random

    config = learner_config(tmp_path)
    config.ppo.adv_estimator, config.ppo.gamma, config.ppo.lambd = "gae", 1.0, 1.0
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    trajectories = mixed_length_batch(learner.model, random.Random(1))
    batch = learner.prepare_batch(trajectories)
    for t, advantages, returns, values, mask in zip(trajectories, *map(batch.sequences, (
            "advantages", "returns", "old_values", "loss_mask"))):
        generated = mask > 0
        # gamma = lambda = 1: the return of a token is every reward from its turn on; A = R - V.
        first_turn = torch.arange(len(mask)) < t.turn_ends[0] - 1
        expected = torch.where(first_turn, sum(t.turn_rewards), t.turn_rewards[1])
        assert torch.allclose(returns[generated], expected[generated], atol=1e-5)
        assert torch.allclose(advantages[generated], (expected - values)[generated], atol=1e-5)
    learner.train_step(trajectories)
    learner.step = 1
    checkpoint = learner.save()
    assert read_trainer_state(checkpoint)["initial_model_path"] == config.model.path
    config.resume_from_checkpoint = str(checkpoint)
    resumed = Learner(config, InProcessBus(), tmp_path / "run")
    for (name, a), b in zip(learner.critic.state_dict().items(), resumed.critic.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.critic_optimizer.state_dict()["state"]  # Adam moments came back too


def test_a_step_whose_loss_was_nan_leaves_the_adaptive_kl_coefficient_as_it_was(tmp_path):
    """A NaN loss skips the step's updates and is counted; the step's KL is then NaN too, which must not reach the
    adaptive coefficient: a NaN coefficient would make every later loss NaN, and no update would be taken again."""
    import math
    import random

    config = learner_config(tmp_path)
    config.ppo.init_kl_coef, config.ppo.target_kl, config.ppo.kl_horizon = 0.1, 0.05, 10
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = mixed_length_batch(learner.model, random.Random(0))
    hook = learner.reference.lm_head.register_forward_hook(lambda module, args, out: out.fill_(float("nan")))
    stats = learner.train_step(batch)
    hook.remove()
    assert stats["updates/skipped_non_finite"] == 2 and math.isnan(stats["kl_step_mean"])
    assert learner.kl_controller.value == 0.1
    stats = learner.train_step(batch)
    assert stats["updates/skipped_non_finite"] == 2 and math.isfinite(stats["loss"])
    assert math.isfinite(learner.kl_controller.value) and learner.kl_controller.value != 0.1


@pytest.mark.parametrize("packing", [True, False])
def test_the_kl_term_is_finite_where_untrained_positions_have_logprobs_far_below_the_reference(tmp_path, packing):
    """The reference logprobs are 0 where nothing is trained (a sequence's last position, padding), so there k3's
    exp(ref - logp) overflows once logp is below about -88: a sharp policy's, or at a low temperature (this tiny
    model's flat logits at 0.005 give logprobs of hundreds below 0). The KL of the policy against itself is 0, the loss
    and gradients finite."""
    import random

    config = learner_config(tmp_path)
    config.ppo.init_kl_coef, config.ppo.sequence_packing, config.gen.temperature = 0.1, packing, 0.005
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = learner.prepare_batch(mixed_length_batch(learner.model, random.Random(0)))
    untrained = (batch.fields["loss_mask"] == 0) & (batch.fields["ref_logprobs"] == 0)
    assert untrained.any()
    stats = learner.mini_batch_gradients(batch)
    assert float(stats["kl"]) == 0 and float(stats["loss"]) == float(stats["policy_loss"])
    assert all(torch.isfinite(p.grad).all() for p in learner.model.parameters())


@pytest.mark.parametrize("estimator,expected", [("k1", -0.5), ("k2", 0.125), ("k3", math.exp(0.5) - 1.5)])
def test_the_kl_term_is_the_estimator_chosen(tmp_path, estimator, expected):
    """ppo.kl_estimator picks the KL term's per-token estimate. Before any update the policy is the reference; with
    the reference's logprobs raised by 0.5 on the trained tokens, logp - ref = -0.5 on each, and the step's KL (a
    token mean) is k1 = -0.5, k2 = 0.5 * 0.5^2 or k3 = e^0.5 - 0.5 - 1."""
    import random

    config = learner_config(tmp_path)
    config.ppo.init_kl_coef, config.ppo.kl_estimator = 0.1, estimator
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = learner.prepare_batch(mixed_length_batch(learner.model, random.Random(0)))
    batch.fields["ref_logprobs"] = batch.fields["ref_logprobs"] + 0.5 * batch.fields["loss_mask"]
    stats = learner.mini_batch_gradients(batch)
    assert float(stats["kl"]) == pytest.approx(expected, abs=1e-4)
    assert float(stats["loss"]) == pytest.approx(float(stats["policy_loss"]) + 0.1 * expected, abs=1e-4)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_a_sequence_level_ratio_takes_each_sequences_own_tokens_in_any_layout(tmp_path, packing):
    """ppo.importance_sampling_level=sequence through the learner's passes: several micro-batches, packed rows (with
    shared prompts) or padded ones. The policy loss is GSPO's, computed here sequence by sequence by hand."""
    import random

    config = learner_config(tmp_path)
    config.ppo.importance_sampling_level, config.ppo.sequence_packing = "sequence", packing
    config.ppo.max_tokens_per_micro_batch = 64
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    batch = learner.prepare_batch(mixed_length_batch(learner.model, random.Random(0), groups=3))
    torch.manual_seed(0)
    f = batch.fields
    f["behaviour_logprobs"] = f["behaviour_logprobs"] - 0.6 * torch.rand_like(f["loss_mask"]) * f["loss_mask"]
    logp = learner.per_token(learner._policy_logprobs(learner.model), batch)
    expected = {"sequence": 0.0, "token": 0.0}
    trained = f["loss_mask"].sum().item()
    for lp, old, adv, mask in zip(*(batch.sequences(values) for values in (logp, f["behaviour_logprobs"],
                                                                          f["advantages"], f["loss_mask"]))):
        on = mask > 0
        if not on.any():
            continue
        ratios = {"sequence": math.exp((lp - old)[on].mean().item()), "token": None}
        for a, r in zip(adv[on].tolist(), (lp - old)[on].exp().tolist()):
            for level in expected:
                ratio = ratios[level] or r
                expected[level] += max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)) / trained
    stats = learner.mini_batch_gradients(batch)
    assert len(learner.micro_batches(batch)) > 2
    assert float(stats["policy_loss"]) == pytest.approx(expected["sequence"], abs=1e-6)
    assert abs(expected["sequence"] - expected["token"]) > 1e-4  # the level acts
    learner.ppo.importance_sampling_level = "token"  # the same passes (no update was taken), token by token
    assert float(learner.mini_batch_gradients(batch)["policy_loss"]) == pytest.approx(expected["token"], abs=1e-6)


def test_the_adaptive_kl_coefficient_follows_the_steps_kl_not_its_last_updates(tmp_path):
    """Each update's KL is a mean over its mini-batch's trained tokens; the controller reads them all, weighted by
    those tokens. The first update's policy is the reference (KL 0), so the last update's KL is the step's highest."""
    import random

    config = learner_config(tmp_path)
    config.ppo.init_kl_coef, config.ppo.target_kl, config.ppo.kl_horizon = 0.1, 0.05, 10
    config.ppo.num_mini_batches, config.ppo.ppo_epochs, config.ppo.lr = 2, 2, 1e-2
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    updates, read = [], []
    optimizer_step, update = learner.optimizer_step, learner.kl_controller.update

    def each_update(mini_batch, *args):
        stats = optimizer_step(mini_batch, *args)
        updates.append((float(stats["kl"]), float(mini_batch.token_counts[:, 0].sum())))
        return stats

    learner.optimizer_step = each_update
    learner.kl_controller.update = lambda kl, n_steps: (read.append(kl), update(kl, n_steps))[1]
    stats = learner.train_step(mixed_length_batch(learner.model, random.Random(0)))
    assert len(updates) == 4 and updates[0][0] == 0 and updates[-1][0] > 2 * read[0]
    expected = sum(kl * tokens for kl, tokens in updates) / sum(tokens for _, tokens in updates)
    assert read == [pytest.approx(expected, rel=1e-5)] and stats["kl_step_mean"] == read[0]
    assert stats["kl"] == pytest.approx(updates[-1][0]) and stats["kl_coef"] == 0.1


def test_a_resumed_learner_continues_its_adaptive_kl_coefficient_and_counters(tmp_path):
    config = learner_config(tmp_path)
    config.ppo.init_kl_coef, config.ppo.target_kl = 0.1, 0.05
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.step = learner.version = 1
    # as training left them: the coefficient adapted, a group filtered, an update skipped
    learner.kl_controller.value, learner.filtered_groups, learner.skipped_updates = 0.37, 5, 2
    learner.inbox.duplicates, learner.inbox.dead_letters = 3, 1  # logged every step as trajectories/*
    bus.incr(protocol.WEIGHT_CHECKS, 3)  # the run's counters, which a resume takes back to these (rlsys/run_start.py)
    bus.stream_add(protocol.DEAD_LETTERS, {"reason": "a message the learner could not use"})
    config.resume_from_checkpoint = str(learner.save())
    assert {k: read_trainer_state(config.resume_from_checkpoint)[k] for k in ("weight_checks", "dead_letters")} == \
        {"weight_checks": 3, "dead_letters": 1}
    resumed = Learner(config, InProcessBus(), tmp_path / "run")
    assert resumed.kl_controller.value == 0.37
    assert (resumed.filtered_groups, resumed.skipped_updates) == (5, 2)
    assert {k: resumed.delivery_metrics()[k] for k in ("trajectories/duplicates", "trajectories/dead_letters")} == \
        {"trajectories/duplicates": 3, "trajectories/dead_letters": 1}  # a resumed learner logged 0 and 0


@pytest.mark.parametrize("target_kl", [0.0, 0.05])
def test_a_kl_coefficient_set_on_resume_from_a_run_whose_coefficient_was_fixed_is_taken(tmp_path, target_kl):
    """A fixed coefficient is a setting, not state: resumed with another ppo.init_kl_coef (here a KL term added to a
    run without one), the learner trains with the configured one, fixed or the adaptive controller's start."""
    config = learner_config(tmp_path)
    learner = Learner(config, InProcessBus(), tmp_path / "run")  # ppo.init_kl_coef 0: no KL term
    learner.step = learner.version = 1
    config.resume_from_checkpoint = str(learner.save())
    config.ppo.init_kl_coef, config.ppo.target_kl = 0.1, target_kl
    resumed = Learner(config, InProcessBus(), tmp_path / "run")
    assert resumed.reference is not None and resumed.kl_controller.value == 0.1


def test_a_resumed_learner_goes_on_from_its_schedules_position_at_the_configured_rates(tmp_path):
    config = learner_config(tmp_path)
    config.ppo.lr, config.ppo.warmup_steps, config.ppo.weight_decay = 1e-5, 4, 0.0
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    for _ in range(3):  # three updates into the warm-up: 3/4 of the rate
        learner.optimizer.step()
        learner.scheduler.step()
    learner.step = learner.version = 1
    config.resume_from_checkpoint = str(learner.save())
    same = Learner(config, InProcessBus(), tmp_path / "run")
    assert same.optimizer.param_groups[0]["lr"] == pytest.approx(0.75e-5) == same.scheduler.get_last_lr()[0]
    config.ppo.lr, config.ppo.weight_decay = 2e-5, 0.1  # changed on resume: taken, not silently overridden
    changed = Learner(config, InProcessBus(), tmp_path / "run")
    assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-5)
    assert changed.optimizer.param_groups[0]["weight_decay"] == 0.1
    changed.optimizer.step()
    changed.scheduler.step()
    assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(2e-5)  # the warm-up's end, at the new rate


def test_a_resumed_learner_takes_the_step_an_uninterrupted_one_takes_bit_for_bit(tmp_path):
    """Model, optimizer moments, schedule, RNG (the mini-batches' order), critic and adaptive KL coefficient all
    come back: the step after a resume equals the step the run would have taken, to the last bit."""
    config = learner_config(tmp_path)
    config.max_steps, config.ppo.lr, config.ppo.warmup_steps, config.ppo.num_mini_batches = 10, 1e-3, 3, 2
    config.ppo.adv_estimator, config.ppo.init_kl_coef, config.ppo.target_kl = "gae", 0.1, 0.05
    learner = Learner(config, InProcessBus(), tmp_path / "run")

    def batch():
        return [trajectory(learner.model, answer, reward) for answer, reward in
                ((GOOD, 1.0), (BAD, 0.0), (GOOD, 0.0), (BAD, 1.0))]

    learner.train_step(batch())
    learner.step = learner.version = 1
    config.resume_from_checkpoint = config.model.path = str(learner.save())  # as rlsys/assets.py sets them
    second = batch()
    learner.train_step(second)
    resumed = Learner(config, InProcessBus(), tmp_path / "run")
    resumed.train_step(second)
    assert (resumed.step, resumed.version) == (1, 1)
    for a, b in ((learner.model, resumed.model), (learner.critic, resumed.critic)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for a, b in ((learner.optimizer, resumed.optimizer), (learner.critic_optimizer, resumed.critic_optimizer)):
        moments = [(a.state[p], b.state[q]) for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"])]
        assert all(torch.equal(x[key], y[key]) for x, y in moments for key in x)
    assert resumed.scheduler.last_epoch == learner.scheduler.last_epoch == 2 * config.ppo.ppo_epochs * 2
    assert resumed.kl_controller.value == learner.kl_controller.value != 0.1


def test_save_total_limit_keeps_the_newest_checkpoints_of_the_line_a_resume_continues(tmp_path):
    config = learner_config(tmp_path)
    config.save_total_limit = 2
    checkpoints = tmp_path / "run" / "checkpoints"
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    for step in (2, 4, 6, 8):
        learner.step = learner.version = step
        learner.save()
    assert {d.name for d in checkpoints.iterdir()} == {"step_6", "step_8"}
    config.resume_from_checkpoint = str(checkpoints / "step_6")  # back to an earlier step: step_8 is abandoned
    resumed = Learner(config, InProcessBus(), tmp_path / "run")
    resumed.step = resumed.version = 7
    resumed.save()
    assert {d.name for d in checkpoints.iterdir()} == {"step_6", "step_7"}  # the one resumed from stays
    resumed.step = resumed.version = 9
    resumed.save()
    assert {d.name for d in checkpoints.iterdir()} == {"step_7", "step_9"}
    assert [step for step, _ in read_trainer_state(checkpoints / "step_9")["lineage"]] == [2, 4, 6, 7]
    with pytest.raises(ValueError, match="save_total_limit must be at least 0, got -1"):
        AsyncPPOMATHConfig(save_total_limit=-1)


def test_a_learner_starting_deletes_what_crashed_saves_left_and_nothing_else(tmp_path):
    config = learner_config(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    learner.step = learner.version = 2
    config.resume_from_checkpoint = str(learner.save())
    left = ["step_4.tmp", "step_2.old", "step_6.deleting"]  # a killed save, a replaced copy, a killed deletion
    for name in left + ["step_8.mine", "notes.tmp"]:
        shutil.copytree(checkpoints / "step_2", checkpoints / name)
    Learner(config, InProcessBus(), tmp_path / "run")
    assert {d.name for d in checkpoints.iterdir()} == {"step_2", "step_8.mine", "notes.tmp"}


class _RunsCode:
    def __reduce__(self):
        return (print, ("a tampered checkpoint ran code",))


def test_a_checkpoint_whose_index_names_other_code_is_refused_before_loading(tmp_path, capsys):
    import pickle

    from rlsys.checkpoint import SHARDED_STATE

    config = learner_config(tmp_path)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    learner.step = 1
    checkpoint = learner.save()
    config.resume_from_checkpoint = str(checkpoint)
    Learner(config, InProcessBus(), tmp_path / "run")  # the index rlsys wrote passes the check
    (checkpoint / SHARDED_STATE / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ValueError, match="builtins.print"):
        Learner(config, InProcessBus(), tmp_path / "run")
    assert "ran code" not in capsys.readouterr().out


def test_gigpo_puts_each_turns_advantage_on_that_turns_tokens(tmp_path):
    import dataclasses
    import random

    from rlsys.algorithms.advantages import gigpo_turn_advantages

    config = learner_config(tmp_path)
    config.ppo.adv_estimator, config.ppo.gigpo_step_gamma = "gigpo", 0.9
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    rng = random.Random(2)
    trajectories = [dataclasses.replace(t, turn_obs_keys=[rng.choice("ab"), rng.choice("ab")])
                    for t in mixed_length_batch(learner.model, rng)]
    batch = learner.prepare_batch(trajectories)
    expected = gigpo_turn_advantages([t.turn_rewards for t in trajectories], [t.turn_obs_keys for t in trajectories],
                                     [t.group_id for t in trajectories], 0.9)
    for t, advantages, mask, per_turn in zip(trajectories, batch.sequences("advantages"),
                                             batch.sequences("loss_mask"), expected):
        first_turn = torch.arange(len(mask)) < t.turn_ends[0] - 1
        assert torch.allclose(advantages, torch.where(first_turn, per_turn[0], per_turn[1]) * mask)
    assert len({round(a[0] - a[1], 6) for a in expected}) > 1  # the step term really differs between turns
    assert learner.train_step(trajectories)["grad_norm"] > 0


def test_void_trajectories_count_in_the_baseline_but_not_in_the_loss(tmp_path):
    import dataclasses

    config = learner_config(tmp_path)
    config.ppo.mask_void_trajectories, config.ppo.init_kl_coef = True, 0.1
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    good, bad = trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)
    batch = [good, bad, dataclasses.replace(bad, void=True), dataclasses.replace(bad, void=True)]
    prepared = learner.prepare_batch(batch)
    assert [m.sum().item() for m in prepared.sequences("loss_mask")] == [3, 3, 0, 0]
    # Rewards 1, 0, 0, 0: the void ones still pull the group mean down to 0.25.
    mean, std = 0.25, (0.25 * 0.75) ** 0.5
    assert prepared.sequences("advantages")[0].max().item() == pytest.approx((1 - mean) / std, rel=1e-4)
    assert prepared.sequences("advantages")[1].min().item() == pytest.approx(-mean / std, rel=1e-4)
    # With a KL term every trained sequence is computed; the void ones add 0 to every term, so no pass computes them.
    assert learner.sequences_to_compute(prepared) == [0, 1]
    stats = learner.train_step(batch)
    assert stats["void_fraction"] == 0.5 and stats["response_length"] == 3
    assert stats["sequences/skipped_zero_advantage"] == 2

    all_void = [dataclasses.replace(t, void=True) for t in (good, bad)]
    before = [p.clone() for p in learner.model.parameters()]
    stats = learner.train_step(all_void)  # nothing left to learn from: no change, but the step goes on
    assert stats["void_fraction"] == 1.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))


def test_learner_settings_act_or_are_refused(tmp_path, monkeypatch):
    import random

    from rlsys.cli import parse_config

    results = []
    for checkpointing in (False, True):  # recomputed activations: the same loss and gradients
        config = learner_config(tmp_path)
        config.learner.gradient_checkpointing = checkpointing
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        assert learner.model.is_gradient_checkpointing == checkpointing
        results.append(accumulated_gradients(learner, mixed_length_batch(learner.model, random.Random(0))))
    (loss, grads), (loss_checkpointed, grads_checkpointed) = results
    assert loss == pytest.approx(loss_checkpointed, abs=1e-6)
    assert all(torch.allclose(grads[name], grads_checkpointed[name], atol=1e-6) for name in grads)

    config = learner_config(tmp_path)
    config.ppo.sequence_packing, config.learner.attn_implementation = False, "eager"
    assert Learner(config, InProcessBus(), tmp_path / "run").model.config._attn_implementation == "eager"
    config.learner.dtype = "bfloat16"
    monkeypatch.setattr("experiments.common.native_bf16", lambda: True)  # a CPU with bf16 arithmetic
    config.learner.check_device("cpu")
    config.learner.check_device("cuda:0", ranks=2)
    with pytest.raises(ValueError, match="bfloat16 on CPUs is for one learner rank.*cluster.n_learner_ranks=1"):
        config.learner.check_device("cpu", ranks=2)
    monkeypatch.setattr("experiments.common.native_bf16", lambda: False)
    with pytest.raises(ValueError, match="bfloat16 on a CPU needs bf16 arithmetic in its hardware"
                                         ".*learner.dtype=float32"):
        Learner(config, InProcessBus(), tmp_path / "run")
    with pytest.raises(ValueError, match="would attend across the sequences of a packed row"):
        parse_config(["learner.attn_implementation=sdpa", "ppo.sequence_packing=true"])
    assert parse_config(["ppo.sequence_packing=false"]).ppo.sequence_packing == "false"
    with pytest.raises(ValueError, match="ppo.sequence_packing must be one of"):
        parse_config(["ppo.sequence_packing=maybe"])
    # auto: packed where one attention call serves a packed row, padded where it would take one call per length
    # and on a GPU in bfloat16, where both layouts take one call a row, measured (None)
    assert packs("auto", "cpu", "float32", "auto") and packs("auto", "cuda:0", "bfloat16", "auto") is None
    assert not packs("auto", "cuda:0", "float32", "auto") and not packs("auto", "cpu", "float32", "sdpa")
    assert packs(True, "cuda:0", "float32", "auto") and not packs("false", "cpu", "float32", "auto")
    # shared prompts: auto on packed CPU rows; true wherever rows are packed under rlsys's attention, else refused
    assert shares_prefixes("auto", True, "cpu", "auto") and not shares_prefixes("auto", True, "cuda:0", "auto")
    assert shares_prefixes("true", True, "cuda:0", "auto") and not shares_prefixes("false", True, "cpu", "auto")
    with pytest.raises(ValueError, match="share_prefixes=true needs packed rows.*padded"):
        shares_prefixes("true", False, "cuda:0", "auto")
    with pytest.raises(ValueError, match="share_prefixes=true shares prefixes within packed rows"):
        parse_config(["ppo.share_prefixes=true", "ppo.sequence_packing=false"])
    with pytest.raises(ValueError, match="ppo.share_prefixes must be one of"):
        parse_config(["ppo.share_prefixes=sometimes"])


def test_bf16_arithmetic_is_read_from_the_cpus_flags():
    assert has_bf16_flag("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n", "x86_64")
    assert has_bf16_flag("flags\t\t: fpu avx512f amx_bf16 amx_tile\n", "x86_64")
    assert not has_bf16_flag("flags\t\t: fpu avx2 avx512f avx512bw\n", "x86_64")  # emulated there
    assert has_bf16_flag("Features\t: fp asimd bf16 i8mm\n", "aarch64")
    assert not has_bf16_flag("Features\t: fp asimd\n", "aarch64") and not has_bf16_flag("", "x86_64")


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no bf16 arithmetic: learner.dtype=bfloat16 is refused")
def test_bf16_on_a_cpu_computes_the_matmuls_in_bf16_and_attention_in_float32_and_learns(tmp_path, monkeypatch):
    import random

    from rlsys.model import varlen_attention

    attention_dtypes = set()  # what sdpa computed in: its output's dtype (autocast casts float32 inputs inside)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        attention_dtypes.add(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded_sdpa)
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = learner_config(tmp_path)
        config.learner.dtype = dtype
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = mixed_length_batch(learner.model, random.Random(0), groups=3)
        logprobs = learner.per_token(learner._policy_logprobs(learner.model), learner.prepare_batch(batch))
        results[dtype] = (logprobs.tolist(), *accumulated_gradients(learner, batch))
    assert attention_dtypes == {torch.float32}  # varlen_attention's float32 under bf16's autocast too
    assert varlen_attention.ATTN_IMPLEMENTATION == learner.model.config._attn_implementation
    (lp32, loss32, grads32), (lp16, loss16, grads16) = results["float32"], results["bfloat16"]
    diffs = [abs(a - b) for a, b in zip(lp32, lp16) if a]
    assert 1e-4 < sum(diffs) / len(diffs) < 0.02  # bf16 matmuls: close, not equal
    assert loss16 == pytest.approx(loss32, abs=1e-3)
    flat32, flat16 = (torch.cat([g.flatten() for g in grads.values()]) for grads in (grads32, grads16))
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.999
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in learner.model.parameters())

    config = learner_config(tmp_path)
    config.learner.dtype, config.ppo.lr = "bfloat16", 1e-3
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    good_before, bad_before = answer_logprob(learner.model, GOOD), answer_logprob(learner.model, BAD)
    for _ in range(5):
        learner.train_step([trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)] * 2)
    assert answer_logprob(learner.model, GOOD) > good_before + 0.5
    assert answer_logprob(learner.model, BAD) < bad_before - 0.5


@pytest.mark.parametrize("packing", [True, False])
def test_a_step_reads_back_from_its_tensors_as_often_however_many_micro_batches_it_takes(tmp_path, packing):
    """On a GPU every read back (.item(), .tolist(), a bool of a tensor) waits for the queued kernels: the step may
    read per optimizer step, never per micro-batch. Counted here as the reads torch records on the CPU."""
    import random

    reads = []
    for budget in (4096, 40):
        config = learner_config(tmp_path)
        config.ppo.sequence_packing, config.ppo.max_tokens_per_micro_batch = packing, budget
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        trajectories = mixed_length_batch(learner.model, random.Random(0))
        passes = len(learner.micro_batches(learner.prepare_batch(trajectories)))
        learner.train_step(trajectories)  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            learner.train_step(trajectories)
        reads.append((passes, sum(e.name == "aten::_local_scalar_dense" for e in profile.events())))
    (few, few_reads), (many, many_reads) = reads
    assert many > few + 4, "the small budget must split the batch into more passes, or this test proves nothing"
    assert many_reads == few_reads


@pytest.mark.parametrize("ppo", [{}, {"adv_estimator": "gae", "init_kl_coef": 0.1, "entropy_loss_coef": 0.01}])
def test_an_update_reads_nothing_back_its_figures_and_whether_it_was_taken_are_read_once_a_step(
        tmp_path, monkeypatch, ppo):
    """On one rank an optimizer step (its passes, the clipping, the fused AdamW's skip of a non-finite update) leaves
    every figure on the device; the train step reads them back together at its end (settle)."""
    import random

    config = learner_config(tmp_path)
    for key, value in ppo.items():
        setattr(config.ppo, key, value)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    trajectories = mixed_length_batch(learner.model, random.Random(0))
    batch = learner.prepare_batch(trajectories)
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name, **k: (reads.append(_n),
                                                                                             _m(self, *a, **k))[1])
    stats = learner.optimizer_step(batch)
    assert reads == [] and isinstance(stats["loss"], torch.Tensor) and learner.updates
    assert learner.scheduler.last_epoch == 1
    settled = learner.settle(stats)
    assert not any(isinstance(value, torch.Tensor) for value in settled.values()) and not learner.updates
    assert settled["updates/skipped_non_finite"] == 0 and settled["grad_norm"] > 0


@pytest.mark.parametrize("slower", ["packed", "padded"])
def test_a_measured_layout_is_the_faster_one_and_the_step_is_that_layouts(tmp_path, monkeypatch, slower):
    """Where ppo.sequence_packing=auto measures (a GPU in bfloat16, tests/test_gpu.py), the first step times a pass in
    each layout over its first sequences up to a micro-batch's tokens, and keeps the faster: here a clock makes one
    slower by half a second a pass. The step trained after the measurement is the one a learner set to that layout
    from the start takes: the measuring passes leave no trace. A later step measures again only once the mean length
    has doubled or halved."""
    import random
    import types

    from rlsys import training_step

    parameters, measured = {}, []
    for packing in ("auto", "false" if slower == "packed" else "true"):
        config = learner_config(tmp_path)
        config.ppo.sequence_packing, config.ppo.share_prefixes = packing, "false"
        config.ppo.max_tokens_per_micro_batch = 64
        learner = Learner(config, InProcessBus(), tmp_path / "run")
        batch = mixed_length_batch(learner.model, random.Random(0))
        if packing == "auto":
            learner.measures_layout = True  # as on a GPU in bfloat16
            readings, cut = [], learner.micro_batches

            def clock(learner=learner, readings=readings):
                """A timed pass starts at 0 and ends at 0.1 s, in the slower layout at 0.6 s."""
                layout = "packed" if learner.packed else "padded"
                readings.append(0.0 if len(readings) % 2 == 0 else 0.1 + 0.5 * (layout == slower))
                return readings[-1]

            def cut_in_passes(batch, sequences=None, cut=cut, readings=readings):
                if len(readings) % 2:  # between a timed pass's start and end
                    measured.append(sequences)
                return cut(batch, sequences)

            monkeypatch.setattr(training_step, "time", types.SimpleNamespace(perf_counter=clock))
            monkeypatch.setattr(learner, "micro_batches", cut_in_passes)
        torch.manual_seed(0)
        stats = learner.train_step(batch)
        parameters[packing] = [p.detach().clone() for p in learner.model.parameters()]
        if packing == "auto":
            faster = "padded" if slower == "packed" else "packed"
            assert (stats[f"layout/{slower}_seconds"], stats[f"layout/{faster}_seconds"]) == (0.6, 0.1)
            assert learner.packed == (slower == "padded")
            lengths = [len(t.token_ids) for t in batch]
            first = max(n for n in range(len(batch) + 1) if sum(lengths[:n]) <= 64)
            assert 0 < first < len(batch) and measured == [list(range(first))] * 4
            assert "layout/packed_seconds" not in learner.train_step(batch) and len(readings) == 8
            longer = [twice_over(t) for t in batch]
            assert "layout/packed_seconds" in learner.train_step(longer) and len(readings) == 16
            first = max(n for n in range(len(batch) + 1) if 2 * sum(lengths[:n]) <= 64)
            assert 0 < first and measured[4:] == [list(range(first))] * 4
    auto, set_so = parameters.values()
    assert all(torch.equal(a, b) for a, b in zip(auto, set_so))


def test_a_layout_timed_on_a_batch_is_not_timed_again_on_the_same_batch(tmp_path):
    """Trajectories as long again after their last trained token (a closing message of the environment): the step
    computes half their tokens, and the batch it timed the layouts on is the same batch the next step gets."""
    import random

    config = learner_config(tmp_path)
    config.ppo.sequence_packing, config.ppo.share_prefixes = "auto", "false"
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    learner.measures_layout = True  # as on a GPU in bfloat16
    batch = [dataclasses.replace(t, token_ids=t.token_ids * 2, loss_mask=t.loss_mask + [0] * len(t.token_ids),
                                 logprobs=t.logprobs + [0.0] * len(t.token_ids),
                                 versions=t.versions + [-1] * len(t.token_ids))
             for t in mixed_length_batch(learner.model, random.Random(0))]
    assert "layout/packed_seconds" in learner.train_step(batch)
    assert "layout/packed_seconds" not in learner.train_step(batch)


def twice_over(t: Trajectory) -> Trajectory:
    """One trajectory of `t`'s turns played twice."""
    n = len(t.token_ids)
    return dataclasses.replace(t, token_ids=t.token_ids * 2, loss_mask=t.loss_mask * 2, logprobs=t.logprobs * 2,
                               versions=t.versions * 2, turn_ends=t.turn_ends + [n + end for end in t.turn_ends],
                               turn_rewards=t.turn_rewards * 2, reward=2 * t.reward)


def test_the_micro_batch_budget_is_the_devices_unless_set(tmp_path):
    import random

    from rlsys.algorithms.batch import sequence_batch
    from rlsys.cli import parse_config

    config = learner_config(tmp_path)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    assert learner.micro_batch_tokens == 2048  # on a CPU; tests/test_gpu.py checks a GPU's 16384
    mb = learner.micro_batches(sequence_batch(mixed_length_batch(learner.model, random.Random(0))))
    assert all(len(m.indices) for m in mb) and max(m.input_ids.numel() for m in mb) <= 2048
    config.ppo.max_tokens_per_micro_batch = 40
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    mb = learner.micro_batches(sequence_batch(mixed_length_batch(learner.model, random.Random(0))))
    assert len(mb) > 1 and max(m.input_ids.numel() for m in mb) <= 40
    with pytest.raises(ValueError, match="must be 0 \\(by device\\) or a number of tokens"):
        parse_config(["ppo.max_tokens_per_micro_batch=-1"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_mini_batchs_loss_and_gradients_are_those_of_a_plain_per_sequence_computation(tmp_path, agg):
    """The whole loss (decoupled PPO with dual clip and the behaviour weight's cap, entropy bonus, k3 KL) against one
    written out sequence by sequence, each its own unpadded forward pass, from the definitions: GRPO advantages over
    each group (population std), the policy term aggregated by `agg` over the mini-batch's sequences, the KL and
    entropy terms token means over all its trained tokens. Small micro-batches, so the learner accumulates."""
    import math
    import random

    config = learner_config(tmp_path)
    for key, value in {"loss_agg_mode": agg, "init_kl_coef": 0.1, "entropy_loss_coef": 0.01, "decoupled_loss": True,
                       "dual_clip": 1.3, "behaviour_imp_weight_cap": 1.5, "max_tokens_per_micro_batch": 64}.items():
        setattr(config.ppo, key, value)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    trajectories = mixed_length_batch(learner.model, random.Random(0), groups=3)
    for t in trajectories:  # behaviour logprobs up to 0.6 below: weights up to 1.8, some over the cap
        t.logprobs = [lp - 0.6 * random.Random(len(t.token_ids) + k).random() if m else lp
                      for k, (lp, m) in enumerate(zip(t.logprobs, t.loss_mask))]
    batch = learner.prepare_batch(trajectories)
    # proximal logprobs moved off the policy's, so that ratios are clipped and dual-clipped
    shifts = [torch.tensor([0.4 * math.sin(7 * i + 3 * k) for k in range(n - 1)]) for i, n in enumerate(batch.lengths)]
    batch.fields["proximal_logprobs"] = batch.fields["proximal_logprobs"] + batch.flatten(shifts)
    assert len(learner.micro_batches(batch)) > 1
    loss = learner.mini_batch_gradients(batch)["loss"]
    grads = {n: p.grad.clone() for n, p in learner.model.named_parameters()}

    learner.model.zero_grad()
    rewards, groups = [t.reward for t in trajectories], [t.group_id for t in trajectories]
    advantages = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        advantages.append((r - mean) / (std + 1e-6))
    policy_terms, kl_sum, entropy_sum, tokens, sequences = [], 0.0, 0.0, 0, 0
    exercised = {"clipped": 0, "dual_clipped": 0, "capped": 0}
    for i, t in enumerate(trajectories):
        ids = torch.tensor([t.token_ids])
        logits = learner.model(input_ids=ids).logits[0, :-1].float()
        distributions = torch.log_softmax(logits, -1)
        logp = distributions.gather(-1, ids[0, 1:, None])[:, 0]
        with torch.no_grad():
            ref = torch.log_softmax(learner.reference(input_ids=ids).logits[0, :-1].float(), -1).gather(
                -1, ids[0, 1:, None])[:, 0]
        proximal = logp.detach() + shifts[i]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
        behaviour = torch.tensor(t.logprobs[1:])
        a = advantages[i]
        ratio = torch.exp(logp - proximal)
        token_loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        exercised["clipped"] += int((((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0)))[mask > 0].sum())
        if a < 0:
            exercised["dual_clipped"] += int((token_loss > -a * 1.3)[mask > 0].sum())
            token_loss = torch.minimum(token_loss, torch.full_like(token_loss, -a * 1.3))
        weight = torch.exp(proximal - behaviour)
        exercised["capped"] += int((weight > 1.5)[mask > 0].sum())
        token_loss = token_loss * torch.where(weight > 1.5, 0.0, weight) * mask
        n = mask.sum()
        policy_terms.append((token_loss.sum(), n))
        kl_sum = kl_sum + ((torch.exp(ref - logp) - (ref - logp) - 1) * mask).sum()
        entropy_sum = entropy_sum - ((distributions.exp() * distributions).sum(-1) * mask).sum()
        tokens, sequences = tokens + n, sequences + (n > 0)
    if agg == "token-mean":
        policy = sum(s for s, _ in policy_terms) / tokens
    elif agg == "seq-mean-token-mean":
        policy = sum(s / n for s, n in policy_terms) / sequences
    else:
        policy = sum(s for s, _ in policy_terms) / sequences
    expected = policy - 0.01 * entropy_sum / tokens + 0.1 * kl_sum / tokens
    expected.backward()
    assert float(loss) == pytest.approx(expected.item(), abs=1e-5)
    for name, p in learner.model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=1e-4), name
    assert max(g.abs().max() for g in grads.values()) > 1e-3
    assert min(exercised.values()) > 0, exercised


def test_a_model_with_windowed_attention_is_refused_by_rlsys_attention(tmp_path):
    """rlsys's attention spans whole sequences: a model with sliding-window layers (Gemma's, Qwen2's with
    use_sliding_window) trained with it would get other logprobs than its own past the window, unseen."""
    import json
    from pathlib import Path

    from transformers import MistralConfig

    from rlsys.model.loading import check_full_attention

    config = learner_config(tmp_path)
    model_config = json.loads((Path(config.model.path) / "config.json").read_text())
    layers = model_config["num_hidden_layers"]
    model_config.update(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention"] * layers)
    (Path(config.model.path) / "config.json").write_text(json.dumps(model_config))
    with pytest.raises(NotImplementedError, match=r"learner.attn_implementation=auto \(rlsys's attention\) runs "
                                                  r"full-attention models only; this one has layers of types "
                                                  r"\['sliding_attention'\]: set learner.attn_implementation=sdpa"):
        Learner(config, InProcessBus(), tmp_path / "run")
    # A window as long as the sequences never binds (Mistral's 4096 at max_model_len 4096)
    check_full_attention(MistralConfig(sliding_window=4096), 4096, "x", "y")
    with pytest.raises(NotImplementedError, match="sliding window of 4096 tokens.*set inference.max_model_len=4096"):
        check_full_attention(MistralConfig(sliding_window=4096), 8192, "x", "y")


@pytest.mark.parametrize("family, dropout", [("gpt2", {"resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5}),
                                             ("llama", {"attention_dropout": 0.5})])
def test_the_learner_s_models_score_in_train_mode_without_dropout_and_keep_their_config(tmp_path, family, dropout):
    """Trained in train mode, a model with dropout scored each pass with other units dropped: logprobs unlike the
    engine's and ratios other than 1 on-policy. GPT-2's dropout is modules, Llama's attention keeps a rate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlsys.model.loading import load_critic, load_policy

    shape = (dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32) if family == "gpt2" else
             dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=32))
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **shape, **dropout)).save_pretrained(tmp_path)
    ids = torch.arange(12).reshape(2, 6)
    for model in (load_policy(str(tmp_path), "sdpa").train(), load_critic(str(tmp_path), "sdpa").train()):
        torch.manual_seed(0)
        first = model(ids).logits
        assert torch.equal(first, model(ids).logits)
        assert all(getattr(model.config, key) == value for key, value in dropout.items())  # what a save writes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_critic_started_from_a_policy_predicts_zero_whatever_its_head_is_named(tmp_path, family):
    """The head a policy's checkpoint lacks starts at zero (load_critic): Llama's is `score`, GPT-2's `classifier`,
    which was left at its random initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlsys.model.loading import load_critic

    shape = (dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32) if family == "gpt2" else
             dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=32))
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **shape))
    policy.save_pretrained(tmp_path)
    critic = load_critic(str(tmp_path), "sdpa")
    with torch.no_grad():
        values = critic(torch.arange(12).reshape(2, 6)).logits
    assert values.shape == (2, 6, 1) and torch.equal(values, torch.zeros_like(values))
    backbone = getattr(critic, critic.base_model_prefix).state_dict()
    assert all(torch.equal(backbone[key], value) for key, value in policy.base_model.state_dict().items())


def test_a_step_that_saves_logs_the_save_s_time(tmp_path):
    """A checkpoint's time fell in no time/* figure: the report's "where the time went" left it out."""
    from rlsys.metrics import read_jsonl_metrics

    config = learner_config(tmp_path)
    config.max_steps, config.save_steps, config.ppo.batch_size = 2, 2, 1
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    for step in range(2):
        learner.ledger.admit(f"p{step}", served_version=10)
        group = [trajectory(learner.model, answer, reward, group_id=f"p{step}").to_dict()
                 for answer, reward in ((GOOD, 1.0), (BAD, 0.0))]
        bus.stream_add(protocol.TRAJECTORIES, {"group_id": f"p{step}", "trajectories": group})
    learner.run()
    rows = read_jsonl_metrics(tmp_path / "logs" / "learner.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["time/save"] < 0.01 < rows[1]["time/save"]  # step 2 saved a checkpoint
