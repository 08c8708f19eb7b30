"""Fault injection into a short real run (real Redis, vLLM inference worker, rollout worker, learner).

One run carries every fault of the rollout and delivery side, each on a fixed share of the prompts
(chosen by the last digit of the reference answer, so about a tenth each): an environment whose reset
raises, a reward (env.step) that raises, an env.step that hangs past env_timeout, and an agent that
raises. While it trains, poisoned messages are written into the trajectory stream. The run must finish
its steps, set the poison aside with reasons, count every admitted prompt in exactly one outcome, log
one line per fault, and leave no process behind.
"""

import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest

from rlsys import protocol
from rlsys.bus import EmbeddedRedis, RedisBus
from rlsys.cli import parse_config
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.prompt_ledger import accounted, describe
from rlsys.errors import RoleFailed
from tests.helpers import child_pids, command_line_run, left_behind, role_process, small_run_overrides

FAULTY_PLUGIN = '''
import asyncio
import atexit
import dataclasses
import multiprocessing
import os

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction, register_agent, register_environment
from rlsys.impl.agent.math_single_step import MathSingleStepAgent
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv


class FaultyEnv(MathCodeSingleStepEnv):
    async def reset(self, seed=None, options=None):
        if options["answer"].endswith("4"):
            raise KeyError("the env cannot start on this problem")
        return await super().reset(seed, options)

    async def step(self, action):
        if self.reference.endswith("1"):
            raise ZeroDivisionError("the reward function divided by zero")
        if self.reference.endswith("2"):
            await asyncio.sleep(3600)
        return await super().step(action)


class FaultyAgent(MathSingleStepAgent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        if prompt.data["answer"].endswith("3"):
            raise RuntimeError("the agent has a bug on this problem")
        return await super().collect_trajectory(prompt, env, obs_queue, act_queue)


register_environment("faulty-env", FaultyEnv)
register_agent("faulty-agent", FaultyAgent)
if multiprocessing.current_process().name == "rollout0":  # the plugin crashes its process on the way out
    atexit.register(os._exit, 7)


@dataclasses.dataclass
class FaultyExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("faulty-agent", dict(super().agent.args))

    @property
    def env(self):
        return EnvServiceAbstraction("faulty-env")


register_experiment("faulty-experiment", FaultyExperiment)
'''

# A plugin file is imported once per process: each test that loads one has its own, with its own names.
BROKEN_ENV_PLUGIN = '''
import dataclasses

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import EnvServiceAbstraction, register_environment
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv


class BrokenEnv(MathCodeSingleStepEnv):
    async def step(self, action):
        raise ImportError("the reward package is not installed")


register_environment("always-failing-env", BrokenEnv)


@dataclasses.dataclass
class AlwaysFailingExperiment(AsyncPPOMATHConfig):
    @property
    def env(self):
        return EnvServiceAbstraction("always-failing-env")


register_experiment("always-failing-experiment", AlwaysFailingExperiment)
'''

# A user's reward written as a plain function, synchronous, that blocks on some problems.
BLOCKING_REWARD_PLUGIN = '''
import dataclasses
import re
import time

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import EnvServiceAbstraction, register_environment
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv


def last_number_reward(answer, reference):
    if reference.endswith("2"):
        time.sleep(3600)  # a reward service that never answers, called synchronously
    return float(re.findall(r"-?\\d+", answer)[-1:] == [reference])


class BlockingRewardEnv(MathCodeSingleStepEnv):
    def step(self, action):
        answers = action[1]
        rewards = [last_number_reward(a, self.reference) for a in answers]
        return None, rewards, True, False, {"statuses": ["ok"] * len(answers), "success": [r == 1 for r in rewards]}


register_environment("blocking-reward-env", BlockingRewardEnv)


@dataclasses.dataclass
class BlockingRewardExperiment(AsyncPPOMATHConfig):
    @property
    def env(self):
        return EnvServiceAbstraction("blocking-reward-env")


register_experiment("blocking-reward-experiment", BlockingRewardExperiment)
'''

MB = 2**20
POISON = {  # what is injected -> words of the reason it must be set aside with
    "raw bytes": "undecodable",
    "a list": "expected a map with a non-empty string group_id",
    "a bad trajectory": "unknown Trajectory fields",
    "huge": "exceeds the limit of 1.0 MiB",
}


def inject_poison(bus: RedisBus) -> None:
    bus._client.xadd(bus._k(protocol.TRAJECTORIES), {b"m": os.urandom(256) + b"\xc1"})
    bus.stream_add(protocol.TRAJECTORIES, [1, 2, 3])
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "forged", "trajectories": [{"evil": True}]})
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "big", "trajectories": [{"blob": os.urandom(3 * MB)}]})
    bus.put(protocol.generation_requests(0), [1, 2, 3])  # a request no inference worker can use: set aside


def inject_once_training_runs(redis_url: str, learner_log: Path, stop: threading.Event) -> None:
    while not stop.is_set():
        if learner_log.exists() and read_jsonl_metrics(learner_log):
            with RedisBus.from_url(redis_url) as bus:
                inject_poison(bus)
            return
        time.sleep(0.2)


def test_faulty_envs_agents_and_poisoned_messages_are_survived_and_accounted(cache_dir, tmp_path, capfd, caplog):
    existing = child_pids()
    plugin = tmp_path / "faulty_plugin.py"
    plugin.write_text(FAULTY_PLUGIN)
    with EmbeddedRedis(tmp_path / "redis") as server:
        config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
            "experiment=faulty-experiment", f"plugins=[{plugin}]", "trial_name=faults", "max_steps=6",
            "env_timeout=1", "cluster.max_message_mb=1", f"cluster.redis_url={server.url}"])
        learner_log = tmp_path / "faulty-experiment" / "faults" / "logs" / "learner.jsonl"
        with RedisBus.from_url(server.url) as bus:  # what an earlier run on this Redis set aside is not this one's
            bus.stream_add(protocol.DEAD_MESSAGES, {"source": "an earlier run", "reason": "stale"})
        stop = threading.Event()
        injector = threading.Thread(target=inject_once_training_runs, args=(server.url, learner_log, stop))
        injector.start()
        try:
            summary = launch(config)
        finally:
            stop.set()
            injector.join()
        with RedisBus.from_url(server.url) as bus:
            letters = [e.decode(protocol.DEAD_LETTERS) for e in bus.stream_range(protocol.DEAD_LETTERS, 100)]
    output = capfd.readouterr().err

    steps = read_jsonl_metrics(learner_log)
    assert [s["step"] for s in steps] == list(range(1, 7))
    prompts = summary["prompts"]
    failed = prompts["failed"]
    assert {"env_error", "env_timeout", "agent_error"} <= set(failed), prompts
    assert summary["prompts_accounted"], prompts
    assert prompts["admitted"] == (prompts["trained"] + sum(prompts["filtered"].values()) + sum(failed.values()))
    assert prompts["trained"] == 6 * config.ppo.batch_size and prompts["in_flight"] == 0
    # Besides the run's end, only the age bound filters here, and only groups past it: a group whose generation
    # was resumed under new weights, then overtaken by later groups, can reach the learner older than
    # max_head_offpolicyness allows (the gate bounds admissions, not the order episodes end in), and is refused.
    assert set(prompts["filtered"]) <= {"run_ended", "too_stale"}
    refused = re.findall(r"refused as too stale: its tokens are of versions (\d+) to \d+, the learner trains "
                         r"version (\d+)", (learner_log.parent / "learner0.log").read_text())
    assert len(refused) == prompts["filtered"].get("too_stale", 0)
    assert all(int(trained) - int(oldest) > config.max_head_offpolicyness for oldest, trained in refused), refused
    assert accounted(prompts) == prompts["admitted"]
    assert summary["unclean_exits"] == {"rollout0": "exited with code 7"}  # once it had finished its part
    print(describe(prompts))  # for BENCHMARKS.md: pytest -s shows it

    assert summary["dead_letters"] == len(POISON) and len(letters) == len(POISON)
    assert summary["messages_set_aside"] == 1
    for (name, words), letter in zip(POISON.items(), letters):
        assert words in letter["reason"], (name, letter["reason"])
    assert steps[-1]["trajectories/dead_letters"] == len(POISON)
    assert steps[-1]["prompts/failed/env_timeout"] >= 1  # the learner's metrics show the counts as they grow

    # one clear line per fault, with its reason
    assert "failed (env_error): FaultyEnv.reset raised KeyError: 'the env cannot start on this problem'" in output
    assert "failed (env_error): FaultyEnv.step raised ZeroDivisionError: the reward function divided by zero" in output
    assert "failed (env_timeout): FaultyEnv.step took longer than 1s (env_timeout)" in output
    assert "failed (agent_error): RuntimeError: the agent has a bug on this problem" in output
    assert output.count("set aside in trajectories:dead") == len(POISON)
    crash = f"rollout0 exited with code 7 as the run stopped; its output: {config.logging_dir}/rollout0.log"
    assert crash in caplog.text
    rollout = read_jsonl_metrics(Path(config.logging_dir) / "rollout0.jsonl")
    (totals,) = [r for r in rollout if "episodes/failed" in r]
    for reason, n in failed.items():  # evaluation episodes fail too, so the worker counts at least these
        assert totals[f"episodes/failed/{reason}"] >= n
    # the run's files are owner-only, and the password in cluster.redis_url stayed out of config.yaml
    run_dir = Path(summary["run_dir"])
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in (run_dir / "logs").iterdir() if f.is_file()} == {0o600}
    assert server.password not in (run_dir / "config.yaml").read_text()
    assert left_behind(tmp_path, existing) == []


def test_an_env_that_always_fails_stops_the_run_with_its_reason_instead_of_using_up_the_dataset(cache_dir, tmp_path,
                                                                                              capfd):
    existing = child_pids()
    plugin = tmp_path / "broken_env_plugin.py"
    plugin.write_text(BROKEN_ENV_PLUGIN)
    # Every episode fails at its step whatever the model answers: a warm start to any accuracy would only cost time
    # (its own, as no other test has these 8 held-out rows), minutes on a busy machine.
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=always-failing-experiment", f"plugins=[{plugin}]", "dataset.num_eval=8",
        "model.warm_start_accuracy=0", "cluster.max_failed_in_a_row=40"])
    with pytest.raises(RoleFailed, match=re.escape(
            "rollout0 stopped the run: the last 40 episodes (8 of them the initial held-out evaluation's, which plays "
            "training's environments) all failed; the latest with env_error: "
            "BrokenEnv.step raised ImportError: the reward package is not installed")) as failure:
        launch(config)
    assert "cluster.max_failed_in_a_row" in str(failure.value)
    # It stopped at the limit, not after the dataset's 7,600 rows: the 40, the evaluation's 8 among them, and at most
    # the episodes that ran beside the 40th, failed. (Not a time bound: the run's time is the machine's load.)
    rollout_log = (Path(config.logging_dir) / "rollout0.log").read_text()
    failed = re.findall(r"episode train-\S+ failed \(env_error\)", rollout_log)
    assert 32 <= len(failed) <= 32 + config.max_concurrent_rollouts, len(failed)
    # the console says the failure once in full, then counts that add up to the log's (held-out episodes included)
    console = capfd.readouterr().err
    assert len(re.findall(r"failed \(env_error\): BrokenEnv.step raised ImportError", console)) == 1, console
    counts = [int(n) for n in re.findall(r"(\d+) more episodes failed \(env_error\)", console)]
    assert counts and 1 + sum(counts) == len(re.findall(r"episode \S+ failed \(env_error\)", rollout_log)), console
    assert left_behind(tmp_path, existing) == []


@pytest.mark.slow  # the first tier's run above counts the evaluation's failures; this one stops in it
def test_a_run_whose_every_episode_fails_stops_in_its_initial_evaluation_not_after_it(cache_dir, tmp_path):
    """The initial evaluation (500 held-out episodes by default) ran to its end, a minute or two of failing episodes,
    before training's 200 failures stopped the run: it plays training's environments, so its failures count."""
    existing = child_pids()
    plugin = tmp_path / "broken_env_plugin.py"
    plugin.write_text(BROKEN_ENV_PLUGIN.replace("always-failing", "failing-from-the-start"))  # one registry a process
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=failing-from-the-start-experiment", f"plugins=[{plugin}]", "dataset.num_eval=8",
        "model.warm_start_accuracy=0", "cluster.max_failed_in_a_row=5"])
    with pytest.raises(RoleFailed, match=re.escape(
            "rollout0 stopped the run: the last 5 episodes (5 of them the initial held-out evaluation's, which plays "
            "training's environments) all failed; the latest with env_error: BrokenEnv.step raised ImportError")):
        launch(config)
    rollout_log = (Path(config.logging_dir) / "rollout0.log").read_text()
    assert re.findall(r"episode train-\S+ failed", rollout_log) == []  # no training episode ran
    assert "held-out accuracy initial" not in rollout_log  # nor did the evaluation end as if it had measured one
    assert left_behind(tmp_path, existing) == []


def test_the_initial_evaluations_failures_count_only_where_it_plays_trainings_environments():
    """A held-out evaluation set up its own way (eval_envs) may fail for a reason training does not share: a run
    whose evaluation alone is broken goes on training, with its held-out accuracy counting the failures unsolved."""
    from rlsys.workers.rollout_worker import evaluation_shares_training_failures

    assert evaluation_shares_training_failures(parse_config([]))
    assert evaluation_shares_training_failures(parse_config(["experiment=async-ppo-sokoban"]))
    own_eval = parse_config(["experiment=async-ppo-mixed-games", "eval_invalid_action_penalty=0.5"])
    assert own_eval.eval_envs != own_eval.envs and not evaluation_shares_training_failures(own_eval)


@pytest.mark.slow
def test_a_synchronous_reward_that_blocks_fails_its_episodes_and_the_run_goes_on(cache_dir, tmp_path, capfd):
    """A reward function that blocks in a synchronous `def step` ran on the rollout worker's event loop: the worker's
    every episode and its beat stood still, and the stall watch stopped the run. The step now runs on a thread of its
    own: the episodes it blocks fail with env_timeout at their deadline, the run trains its steps, and every prompt,
    held-out ones included, is accounted."""
    existing = child_pids()
    plugin = tmp_path / "blocking_reward_plugin.py"
    plugin.write_text(BLOCKING_REWARD_PLUGIN)
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=blocking-reward-experiment", f"plugins=[{plugin}]", "trial_name=blocking", "max_steps=4",
        "env_timeout=1", "cluster.stall_timeout=60",
        # On policy: a step trains the batch its version admitted, so it waits for a blocked episode's deadline
        # (its slot is given back, a prompt admitted in its place). With the default gate, 4 steps of the tiny model
        # took under 1.5 s on a quiet machine: every blocked episode was still in flight when the run ended
        # (run_ended), and none failed.
        "max_head_offpolicyness=0"])
    summary = launch(config)  # a run whose loop the reward blocked stopped here with RoleFailed
    output = capfd.readouterr().err
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 5))
    prompts = summary["prompts"]
    assert set(prompts["failed"]) == {"env_timeout"} and prompts["failed"]["env_timeout"] >= 1, prompts
    assert summary["prompts_accounted"] and accounted(prompts) == prompts["admitted"], prompts
    assert prompts["trained"] == 4 * config.ppo.batch_size and prompts["in_flight"] == 0
    assert summary["initial_failed"] >= 1 and summary["final_failed"] >= 1  # held-out ones: counted unsolved
    assert "failed (env_timeout): BlockingRewardEnv.step took longer than 1s (env_timeout)" in output
    rollout_log = (Path(config.logging_dir) / "rollout0.log").read_text()
    assert "BlockingRewardEnv.step is still running on its thread, which cannot be stopped: left running" in rollout_log
    assert left_behind(tmp_path, existing) == []


@pytest.mark.slow
def test_a_learner_killed_before_any_checkpoint_restarts_the_run_from_the_start_and_it_finishes(cache_dir, tmp_path):
    """With no checkpoint saved, a killed learner restarts every role from the start: the run trains its steps
    again and ends, with every prompt accounted (seen once on Ray: the restarted run waited forever)."""
    import json
    import signal

    existing = child_pids()
    args = small_run_overrides(cache_dir, tmp_path) + ["trial_name=s", "max_steps=6", "save_steps=0",
                                                       "cluster.stall_timeout=60"]
    run_dir = tmp_path / "async-ppo-math" / "s"
    with command_line_run(tmp_path, args) as proc:
        deadline = time.monotonic() + 600
        while not ((run_dir / "logs" / "learner.jsonl").exists()
                   and len((run_dir / "logs" / "learner.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(0.2)
        role_process(proc, "learner0").send_signal(signal.SIGKILL)
        assert proc.wait(timeout=900) == 0, proc.output()[-3000:]
    assert "restarting every role from the start (no checkpoint was saved yet)" in proc.output()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"learner0": 1}
    assert summary["prompts_accounted"], summary["prompts"]
    assert summary["final_accuracy"] is not None
    # the steps the killed learner took are trained again: logged once, as trained after the restart
    steps = [json.loads(line)["step"] for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7)), steps
    assert left_behind(tmp_path, existing) == []
