"""Contract tests of the built-in agents: real episode router, bus and inference worker, scripted model."""

import asyncio

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from rlsys.api import (NOT_GENERATED, AgentAbstraction, EnvironmentService, EnvServiceAbstraction, GenerationConfig,
                       Prompt, make_agent, make_env)
from rlsys.cli import parse_config
from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids
from rlsys.workers.rollout_worker import held_out_accuracy
from tests.scripted import run_scripted_episode
from tests.scripted_engine import ScriptedEngine


def test_math_single_step_scores_each_sample_and_masks_the_prompt(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    answers = ["46", "45", "x"]
    eos = tokenizer.eos_token_id

    def policy(prompt_ids, gconfig, i):
        return tokenizer(answers[i], add_special_tokens=False)["input_ids"] + [eos]

    gconfig = GenerationConfig(n=3, max_new_tokens=8, stop_token_ids=[eos])
    agent = make_agent(AgentAbstraction("math-single-step", {"gconfig": gconfig, "tokenizer_path": str(tmp_path)}))
    env = make_env(EnvServiceAbstraction("math-code-single-step"))
    prompt = Prompt("q1", chat_prompt_ids(tokenizer, "12+34="), {"prompt": "12+34=", "answer": "46"})
    engine = ScriptedEngine(policy, logprob=-0.25)
    trajectories = asyncio.run(run_scripted_episode(agent, env, prompt, policy, engine))

    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0]
    assert engine.requests == [(prompt.token_ids, gconfig)]
    n = len(prompt.token_ids)
    for t, answer in zip(trajectories, answers):
        generated = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
        assert t.token_ids == prompt.token_ids + generated
        assert t.loss_mask == [0] * n + [1] * len(generated)
        assert t.logprobs == [0.0] * n + [-0.25] * len(generated)
        assert t.versions == [NOT_GENERATED] * n + [0] * len(generated)
        assert t.group_id == "q1" and t.stop_reason == "stop" and t.turn_ends == [len(t.token_ids)]
    assert [t.metrics["success"] for t in trajectories] == [1.0, 0.0, 0.0]  # the verifier's verdicts

    # An environment whose rewards are scores says nothing of success: the episodes record none, and a held-out set of
    # them has no accuracy (the run reports their mean reward), where the verifier's has one.
    class Scores(EnvironmentService):
        async def reset(self, seed=None, options=None):
            return None, {}

        async def step(self, action):
            return None, [0.9, -0.4, 0.1], True, False, {"statuses": ["ok"] * 3}

    scored = asyncio.run(run_scripted_episode(agent, Scores(), prompt, policy, ScriptedEngine(policy, logprob=-0.25)))
    assert [t.reward for t in scored] == [0.9, -0.4, 0.1] and all("success" not in t.metrics for t in scored)

    # A user's gym-like environment that returns one reward, not one per answer: the episode fails saying what to return
    class OneReward(EnvironmentService):
        async def step(self, action):
            return None, 1.0, True, False, {}

    class TwoRewards(OneReward):
        async def step(self, action):
            return None, [1.0, 0.0], True, False, {}

    for env, returned in ((OneReward(), "1.0"), (TwoRewards(), r"\[1.0, 0.0\]")):
        with pytest.raises(TypeError, match=rf"{type(env).__name__}.step returned the reward {returned} for 3 answers: "
                                            r"the math agents step the environment with \(qid, \[answer, \.\.\.\]\) "
                                            r"and need a list of one reward per answer"):
            asyncio.run(run_scripted_episode(agent, env, prompt, policy, ScriptedEngine(policy)))
    score = parse_config(["experiment=async-ppo-math"]).held_out_score
    assert held_out_accuracy(score, [scored], "accuracy") == {}
    assert held_out_accuracy(score, [trajectories], "accuracy") == {"accuracy": pytest.approx(1 / 3)}
    assert held_out_accuracy(score, [], "accuracy") == {"accuracy": 0.0}  # every episode failed
    # An episode counts once however many trajectories it gave (an openai-agent run whose client rewrote its history
    # gives several, each with the run's success); one that gave none failed (invalid_output), and counts unsolved.
    solved, unsolved = trajectories[0], trajectories[1]
    assert held_out_accuracy(score, [[solved, solved], [unsolved]], "accuracy") == {"accuracy": 0.5}
    assert held_out_accuracy(score, [[solved]], "accuracy", failed=1) == {"accuracy": 0.5}
