"""Reward functions written for TRL's GRPOTrainer plug in unchanged (`reward_funcs=[module:function]`): called as TRL
calls them, weighted and summed, a failing one named in its episode's failure; a run trains with one."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from rlsys.cli import ConfigError, parse_config
from rlsys.impl.env.trl_rewards import TRLRewardFunctionsEnv
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.workers.episode_failure import EpisodeFailed, guard_env
from tests.helpers import child_pids, left_behind, small_run_overrides

# As a TRL user writes them (https://huggingface.co/docs/trl, "Using a custom reward function"): dataset columns
# arrive as keyword lists, one entry per completion; None where a function does not apply.
REWARDS = '''
import json, os, time

def accuracy_reward(completions, answer, **kwargs):
    """1 for the reference answer; plain completions where the prompt is a string."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

def length_reward(prompts, completions, **kwargs):
    return [len(c) / 10 for c in completions]

def prompt_length(prompts, completions, **kwargs):
    return [float(len(p)) for p in prompts]

def only_long_prompts(prompts, completions, **kwargs):
    return [1.0 if len(p) > 5 else None for p in prompts]

def chat_reward(prompts, completions, **kwargs):
    assert prompts[0][-1]["role"] == "user"
    return [1.0 if c[0]["content"] == "yes" else 0.0 for c in completions]

def raises(completions, **kwargs):
    raise ValueError("no reward for you")

def too_few(completions, **kwargs):
    return [1.0]

def hangs(completions, **kwargs):
    time.sleep(10)

def logged(prompts, completions, answer, **kwargs):
    """accuracy_reward that also records how it was called, from which process."""
    with open(os.environ["RLSYS_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "n": len(completions), "keys": sorted(kwargs) + ["answer"],
                            "prompt": prompts[0]}) + "\\n")
    return accuracy_reward(completions, answer)
'''


@pytest.fixture
def rewards_file(tmp_path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def scores(functions, row, answers, weights=None):
    env = TRLRewardFunctionsEnv(functions, weights)

    async def episode():
        await env.reset(options=row)
        return (await env.step(("q", answers)))[1]

    return asyncio.run(episode())


def test_functions_are_called_as_trl_calls_them_and_their_weighted_rewards_summed(rewards_file):
    row = {"prompt": "12+34=", "answer": "46"}
    assert scores([f"{rewards_file}:accuracy_reward"], row, ["46", "45", " 46 "]) == [1.0, 0.0, 1.0]
    both = scores([f"{rewards_file}:accuracy_reward", f"{rewards_file}:length_reward"], row, ["46", "4"], [2.0, 0.5])
    assert both == pytest.approx([2.0 + 0.5 * 0.2, 0.5 * 0.1])
    # None: the function does not apply to that completion, and adds nothing (TRL's nansum)
    assert scores([f"{rewards_file}:only_long_prompts"], {"prompt": "1+2="}, ["3", "4"]) == [0.0, 0.0]
    assert scores([f"{rewards_file}:only_long_prompts"], {"prompt": "12+34="}, ["3"]) == [1.0]
    # a conversational prompt gets conversational completions
    chat = {"prompt": [{"role": "user", "content": "Is 2 even?"}]}
    assert scores([f"{rewards_file}:chat_reward"], chat, ["yes", "no"]) == [1.0, 0.0]


def test_functions_get_the_prompt_as_the_dataset_file_gives_it(rewards_file, tmp_path):
    """A TRL dataset's rows reach the functions in its own form: a conversation stays chat messages (TRL's functions
    for chat data read `prompts[i][-1]["content"]`), without rlsys's system prompt and template."""
    from rlsys.data.dataset import RowFormat, load_rows, rows_fingerprint

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Is 2 even?"}], "answer": "yes"}) + "\n"
                    + json.dumps({"prompt": "12+34=", "answer": "46"}) + "\n")
    chat, plain = load_rows(path, RowFormat(system_prompt="Think first.", prompt_template="Q: {prompt}"))
    assert scores([f"{rewards_file}:chat_reward"], chat, ["yes", "no"]) == [1.0, 0.0]
    assert scores([f"{rewards_file}:prompt_length"], chat, ["yes"]) == [1.0]  # one message: no system prompt added
    assert scores([f"{rewards_file}:prompt_length"], plain, ["46"]) == [6.0]  # "12+34=", not "Q: 12+34="
    assert rows_fingerprint([chat]) == rows_fingerprint([{k: v for k, v in chat.items() if k != "given_prompt"}])


@pytest.mark.parametrize("name,problem", [("raises", "raised ValueError: no reward for you"),
                                          ("too_few", "returned [1.0]; expected a list of 2 rewards")])
def test_a_failing_function_fails_its_episode_with_its_name(rewards_file, name, problem):
    env = guard_env(TRLRewardFunctionsEnv([f"{rewards_file}:{name}"]), timeout=10)

    async def episode():
        await env.reset(options={"prompt": "1+1=", "answer": "2"})
        await env.step(("q", ["2", "3"]))

    with pytest.raises(EpisodeFailed) as failure:
        asyncio.run(episode())
    assert failure.value.reason == "env_error"
    assert f"reward function {rewards_file}:{name} {problem}" in failure.value.detail


def test_hung_functions_fail_their_episodes_and_leave_the_event_loop_s_threads_free(rewards_file):
    """More hung calls than the default executor has threads: each episode ends with env_timeout, and the rollout
    worker's bus calls (asyncio.to_thread) still get a thread."""
    async def episodes():
        reasons = []
        for _ in range(min(32, (os.cpu_count() or 1) + 4) + 1):  # the default executor's threads, and one more
            env = guard_env(TRLRewardFunctionsEnv([f"{rewards_file}:hangs"]), timeout=0.05)
            await env.reset(options={"prompt": "1+1="})
            with pytest.raises(EpisodeFailed) as failure:
                await env.step(("q", ["2"]))
            reasons.append(failure.value.reason)
        return set(reasons), await asyncio.wait_for(asyncio.to_thread(lambda: "answered"), 5)

    assert asyncio.run(episodes()) == ({"env_timeout"}, "answered")


def test_reward_funcs_are_checked_when_the_run_is_configured(rewards_file):
    config = parse_config([f"reward_funcs=[{rewards_file}:accuracy_reward,{rewards_file}:length_reward]",
                           "reward_weights=[1.0,0.5]"])
    assert config.env.name == "trl-reward-funcs" and config.eval_envs == {"trl-reward-funcs": config.env}
    with pytest.raises(ConfigError, match=r"has no \(plain, not async\) function 'accuracy'; there: accuracy_reward"):
        parse_config([f"reward_funcs=[{rewards_file}:accuracy]"])
    with pytest.raises(ConfigError, match="1 reward_weights for 2 reward_funcs"):
        parse_config([f"reward_funcs=[{rewards_file}:raises,{rewards_file}:too_few]", "reward_weights=[2]"])
    with pytest.raises(ConfigError, match="scored by its own environment"):
        parse_config(["experiment=async-ppo-math-tools", f"reward_funcs=[{rewards_file}:accuracy_reward]"])


def test_a_run_trains_with_a_trl_reward_function(cache_dir, tmp_path, rewards_file, monkeypatch):
    existing = child_pids()
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("RLSYS_TEST_REWARD_LOG", str(calls))
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "max_steps=3", "inference.engine=transformers", f"reward_funcs=[{rewards_file}:logged]"])
    summary = launch(config)
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3] and summary["prompts_accounted"]
    assert summary["prompts"]["failed"] == {} and summary["final_reward_of_ended"] is not None
    # the functions' rewards are scores, not verdicts: the run reports their held-out mean, and no accuracy
    assert summary["initial_accuracy"] is summary["final_accuracy"] is None
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert os.getpid() not in {c["pid"] for c in logged}  # in the rollout worker, not here
    assert all(set(c["keys"]) == {"answer", "completion_ids"} for c in logged)  # the row's column, and TRL's own
    assert {c["n"] for c in logged} == {1, config.group_size}  # greedy evaluation asks for one answer, training a group
    assert all(c["prompt"].endswith("=") for c in logged)
    assert left_behind(tmp_path, existing) == []
