"""The learner on its own: PPO steps move probability toward the rewarded answer; weights are published."""

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


def trajectory(model, answer: list[int], reward: float) -> Trajectory:
    ids = torch.tensor([PROMPT + answer])
    with torch.no_grad():
        behaviour = gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0, -len(answer):]
    n = len(PROMPT)
    return Trajectory(token_ids=PROMPT + answer, loss_mask=[0] * n + [1] * len(answer),
                      logprobs=[0.0] * n + behaviour.tolist(), versions=[-1] * n + [0] * len(answer),
                      turn_ends=[n + len(answer)], turn_rewards=[reward], reward=reward, group_id="g",
                      stop_reason="stop")


def test_ppo_steps_prefer_the_rewarded_answer_and_publish_weights(tmp_path):
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.ppo.lr, config.ppo.init_kl_coef = 1e-3, 0.1
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    good_before, bad_before = answer_logprob(learner.model, GOOD), answer_logprob(learner.model, BAD)

    for _ in range(5):
        batch = [trajectory(learner.model, GOOD, 1.0), trajectory(learner.model, BAD, 0.0)] * 2
        stats = learner.train_step(batch)
    assert answer_logprob(learner.model, GOOD) > good_before + 0.5
    assert answer_logprob(learner.model, BAD) < bad_before - 0.5
    assert stats["kl"] > 0 and stats["reward"] == 0.5 and stats["grad_norm"] > 0

    learner.version = 7
    learner.publish_weights()
    published = bus.get(protocol.WEIGHTS)
    assert published["version"] == 7
    assert (tmp_path / "run" / "weights" / "v7" / WEIGHTS_FILE).exists()
