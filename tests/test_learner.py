"""The learner on its own: PPO steps move probability toward the rewarded answer; weights are published."""

import pytest
import torch

from experiments import AsyncPPOMATHConfig
from rlsys import protocol
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import Trajectory
from rlsys.bus import InProcessBus
from rlsys.engine.weights import WEIGHTS_FILE
from rlsys.workers.learner import Learner
from tests.helpers import save_random_tiny_model

PROMPT, GOOD, BAD = [4, 7, 8, 78, 9, 10, 86, 1, 5], [10, 12, 1], [11, 11, 1]


def answer_logprob(model, answer: list[int]) -> float:
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        return gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0, -len(answer):].sum().item()


def trajectory(model, answer: list[int], reward: float, staleness_shift: float = 0.0) -> Trajectory:
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        behaviour = gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0, -len(answer):]
    n = len(PROMPT)
    return Trajectory(token_ids=PROMPT + answer, loss_mask=[0] * n + [1] * len(answer),
                      logprobs=[0.0] * n + (behaviour - staleness_shift).tolist(), versions=[-1] * n + [0] * len(answer),
                      turn_ends=[n + len(answer)], turn_rewards=[reward], reward=reward, group_id="g",
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
    assert abs(stats["advantage_abs_mean"] - expected_advantage) < 1e-3
    assert ("dual_clip_fraction" in stats) == bool(config.ppo.dual_clip)
    if config.ppo.decoupled_loss:
        assert abs(stats["importance_weight_mean"] - torch.exp(torch.tensor(shift)).item()) < 1e-3
        assert coefs[-1] > coefs[0]  # KL above a tiny target: the adaptive coefficient grows
    else:
        assert coefs == [0.1] * 5


def test_learner_publishes_weights_for_inference(tmp_path):
    config = learner_config(tmp_path)
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    learner.version = 7
    learner.publish_weights()
    assert bus.get(protocol.WEIGHTS) == {"version": 7, "path": str(tmp_path / "run" / "weights" / "v7")}
    assert (tmp_path / "run" / "weights" / "v7" / WEIGHTS_FILE).exists()


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


def test_uniform_groups_are_filtered_and_give_their_gate_slot_back(tmp_path):
    config = learner_config(tmp_path)
    config.ppo.batch_size, config.ppo.filter_uniform_groups = 2, True
    bus = InProcessBus()
    bus.set(protocol.ADMITTED, 5)
    learner = Learner(config, bus, tmp_path / "run")

    def group(rewards):
        return {"group_id": str(rewards),
                "trajectories": [trajectory(learner.model, GOOD if r else BAD, r).to_dict() for r in rewards]}

    bus.put_many(protocol.TRAJECTORIES, [group([0.0, 0.0]), group([1.0, 0.0]), group([1.0, 1.0]), group([0.0, 1.0])])
    batch = learner.wait_for_batch()
    assert [[t.reward for t in g] for g in batch] == [[1.0, 0.0], [0.0, 1.0]]
    assert learner.filtered_groups == 2
    assert learner.consumed_prompts == ["[0.0, 0.0]", "[1.0, 1.0]"]  # trained groups join after their step
    assert bus.get(protocol.ADMITTED) == 3
