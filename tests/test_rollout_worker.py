"""The rollout worker: it reads its datasets while the engines start, not after; every admitted prompt gets its
outcome, whatever the agent raises."""

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import multiprocessing
import re
import shutil
import threading
import time
import types

import pytest

from experiments import AsyncPPOMATHConfig
from rlsys import evaluations, protocol
from rlsys.api import (Agent, AgentAbstraction, EnvironmentService, EnvServiceAbstraction, Prompt, Trajectory,
                       register_agent, register_environment)
from rlsys.assets import AssetError, prepare_assets
from rlsys.blocking_calls import left_running
from rlsys.bus import InProcessBus
from rlsys.cancellation import coroutines_left_pending, run_to_the_end
from rlsys.checkpoint import read_trainer_state
from rlsys.console import ProgressReporter, held_out_line
from rlsys.data.prompts import prompt_stream
from rlsys.errors import EpisodeFailed, RunCannotGoOn
from rlsys.impl.env.math_verifier import close_shared_pool
from rlsys.run_start import initialize_bus_state
from rlsys.run_summary import held_out_summary
from rlsys.tracing import read_traces, traced
from rlsys.workers import rollout_worker
from rlsys.workers.rollout_worker import RolloutWorker, next_evaluation
from tests.helpers import LoopTicks, config_of, save_random_tiny_model


def write_rows(path, answers):
    path.write_text("".join(json.dumps({"prompt": f"{a}+0=", "answer": str(a)}) + "\n" for a in answers))
    return str(path)


def test_the_datasets_are_read_while_no_inference_worker_is_up(tmp_path):
    """Reading a dataset takes about a second (Hugging Face datasets' import and load): done while vLLM starts, the
    first episodes need not wait for it (BENCHMARKS.md, "Start-up")."""
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.dataset.path = write_rows(tmp_path / "train.jsonl", [1, 2, 3])
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [4, 5])
    worker = RolloutWorker(config, InProcessBus(), 0)

    async def start_without_engines():
        running = asyncio.create_task(worker.run())  # no inference worker will ever be live
        try:
            for _ in range(600):
                if worker.eval_rows or running.done():
                    break
                await asyncio.sleep(0.05)
            assert not running.done()  # still waiting for an engine
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    try:
        asyncio.run(start_without_engines())
    finally:
        close_shared_pool()
    assert [row["answer"] for row in worker.train_rows] == ["1", "2", "3"]
    assert [row["answer"] for row in worker.eval_rows] == ["4", "5"]


class CancelledWithin(Agent):
    """Awaits a task something else cancels (as a library may cancel its own inner task): CancelledError reaches
    the agent, though nobody cancelled the episode."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        inner = asyncio.create_task(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, inner.cancel)
        await inner


register_agent("cancelled-within", CancelledWithin)


@dataclasses.dataclass
class CancelledWithinExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("cancelled-within", {})


def test_an_agent_s_own_cancelled_error_fails_its_episode_and_an_episode_cancelled_from_outside_stays_in_flight(
        tmp_path):
    config = CancelledWithinExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)

    async def main():
        prompts = iter([Prompt("train-0-0", [1, 2], {}), Prompt("train-0-1", [1, 2], {})])
        first, second = await worker.admit(prompts), await worker.admit(prompts)
        await worker.run_training_episode(first)  # returns: its outcome is recorded
        outside = asyncio.create_task(worker.run_training_episode(second))
        await asyncio.sleep(0.001)
        outside.cancel()  # as train() cancels the episodes left when the learner is done
        await asyncio.gather(outside, return_exceptions=True)
        return outside.cancelled()

    assert asyncio.run(main())
    counts = worker.ledger.counts()
    assert counts["failed"] == {"agent_error": 1} and counts["in_flight"] == 1  # counted as run_ended at the end
    assert worker.ledger.slots_taken() == 1 and worker.failures.by_reason == {"agent_error": 1}
    # what a restarted worker would find: past both prompts, and the cancelled one to redo
    assert bus.get(protocol.rollout_position(0)) == 2 and bus.set_members(protocol.rollout_episodes(0)) == ["train-0-1"]


class OwnReason(Agent):
    """Fails its episodes with a reason of its own, which the ledger does not count."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        raise EpisodeFailed("out_of_budget", "spent its budget")


register_agent("own-reason", OwnReason)


@dataclasses.dataclass
class OwnReasonExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("own-reason", {})


def after_one_training_episode(config, tmp_path) -> RolloutWorker:
    """A rollout worker of `config` (a random tiny model) that has admitted and run one training episode."""
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    worker = RolloutWorker(config, InProcessBus(), 0)

    async def main():
        await worker.run_training_episode(await worker.admit(iter([Prompt("train-0-0", [1, 2], {})])))

    asyncio.run(main())
    return worker


def test_an_episode_failed_with_an_unknown_reason_is_counted_as_an_agent_error_naming_it(tmp_path, caplog):
    """Not a ValueError out of the episode's task, leaving the prompt in flight and its gate slot taken for good."""
    worker = after_one_training_episode(OwnReasonExperiment(), tmp_path)
    counts = worker.ledger.counts()
    assert counts["failed"] == {"agent_error": 1} and counts["in_flight"] == 0 and worker.ledger.slots_taken() == 0
    assert worker.failures.by_reason == {"agent_error": 1}
    assert "EpisodeFailed('out_of_budget') is not one of the failure reasons" in caplog.text
    assert "spent its budget" in caplog.text


class UnmadeEnv(EnvironmentService):
    """An environment whose constructor raises (say its reward model's file is missing)."""

    def __init__(self):
        raise FileNotFoundError("reward_model.bin")

    async def reset(self, seed=None, options=None):
        return None, {}

    async def step(self, action):
        return None, 0.0, True, False, {}


register_environment("unmade", UnmadeEnv)


@dataclasses.dataclass
class UnmadeEnvExperiment(CancelledWithinExperiment):
    @property
    def env(self):
        return EnvServiceAbstraction("unmade")


def test_an_environment_whose_constructor_raises_fails_its_episode_as_an_env_error(tmp_path, caplog):
    """Counted as the agent's error, it sent the user looking at the wrong plugin."""
    worker = after_one_training_episode(UnmadeEnvExperiment(), tmp_path)
    counts = worker.ledger.counts()
    assert (counts["failed"] == {"env_error": 1} and counts["in_flight"] == 0
            and worker.failures.by_reason == {"env_error": 1})
    assert "UnmadeEnv.__init__ raised FileNotFoundError: reward_model.bin" in caplog.text


class SyncWarmUpEnv(EnvironmentService):
    """A warm-up written as a plain `def` around a blocking start: it waits `release` (5 s at most)."""

    release = threading.Event()
    threads: list[str] = []

    def warm_up(self):
        SyncWarmUpEnv.threads.append(threading.current_thread().name)
        SyncWarmUpEnv.release.wait(5)

    async def step(self, action):
        return None, [0.0], True, False, {}


register_environment("sync-warm-up-test-env", SyncWarmUpEnv)


def test_an_environment_s_synchronous_warm_up_runs_off_the_loop_and_is_ended_by_env_timeout(tmp_path, caplog):
    """A `def warm_up` ran on the worker's event loop: a blocking one stood the worker still past env_timeout (and its
    beat: the stall watch stopped the run), then failed as `await None`. It runs on a thread of its own now."""
    config = config_of("math-single-step", tmp_path, env="sync-warm-up-test-env")
    config.env_timeout = 0.3
    SyncWarmUpEnv.release.clear()
    SyncWarmUpEnv.threads = []

    async def warm_up():
        start = time.monotonic()
        async with LoopTicks() as ticks:
            await RolloutWorker.warm_up_environments(types.SimpleNamespace(config=config))
        return time.monotonic() - start, ticks.count

    with caplog.at_level(logging.WARNING):
        took, ticks = asyncio.run(warm_up())
    SyncWarmUpEnv.release.set()
    assert SyncWarmUpEnv.threads == ["SyncWarmUpEnv.warm_up"] and took < 3 and ticks >= 5
    assert "environment sync-warm-up-test-env did not warm up (TimeoutError (at " in caplog.text


class ReturnsJunk(Agent):
    """Returns what is not a list of Trajectory."""

    def __init__(self, junk):
        self.junk = junk

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return self.junk


register_agent("returns-junk", ReturnsJunk)


@pytest.mark.parametrize("junk,named", [((), "got tuple"), ([{"reward": 1.0}], "got a list of ['dict']")])
def test_an_evaluation_episode_that_returns_no_trajectories_fails_as_invalid_output(tmp_path, caplog, junk, named):
    """As a training episode does: not a TypeError or AttributeError out of the evaluation, ending the worker."""
    caplog.set_level(logging.INFO, logger="rlsys")
    @dataclasses.dataclass
    class ReturnsJunkExperiment(AsyncPPOMATHConfig):
        @property
        def agent(self):
            return AgentAbstraction("returns-junk", {"junk": junk})

    config = ReturnsJunkExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    worker.eval_rows = [{"prompt": "1+1=", "answer": "2"}]
    asyncio.run(worker.evaluate("initial"))
    assert (worker.failures.by_reason == {"invalid_output": 1}
            and bus.get(protocol.eval_result("initial"))["episodes"] == 0)
    assert f"collect_trajectory must return a list of Trajectory, {named}" in caplog.text
    # the worker's log line counts the failed episode among the problems, as the accuracy does (it said "of 0")
    assert "held-out accuracy initial (version 0): 0.0% of 1 (1 failed, counted unsolved)" in caplog.text


class AnsweredByLaterVersions(Agent):
    """An evaluation's episode whose tokens the versions loaded while it ran generated (7, then 8)."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return [Trajectory(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -0.1, -0.1], versions=[-1, 7, 8],
                           turn_ends=[3], turn_rewards=[1.0], reward=1.0, group_id=prompt.qid, stop_reason="stop",
                           metrics={"success": 1.0})]


register_agent("answered-by-later-versions", AnsweredByLaterVersions)


@dataclasses.dataclass
class LaterVersionsExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("answered-by-later-versions", {})


def later_versions_worker(tmp_path, bus, sample_rate: float | None = None, run_dir=None) -> RolloutWorker:
    """A rollout worker whose episodes are answered by versions later than the one served (7 and 8)."""
    config = LaterVersionsExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    if sample_rate is not None:
        config.trace.sample_rate = sample_rate
    return RolloutWorker(config, bus, 0, run_dir=run_dir)


def test_an_evaluation_is_labelled_with_the_versions_that_generated_it(tmp_path, capsys):
    """It runs beside training, so inference loads new versions meanwhile: labelled with the version served when it
    began, the evaluation at version 4 of a 10-step run was every episode version 5's, and its curve and console line
    credited version 4 with it."""
    bus = InProcessBus()
    worker = later_versions_worker(tmp_path, bus)
    worker.eval_rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    asyncio.run(worker.evaluate("step-4"))  # no inference worker: the version served is 0
    worker.metrics.close()
    (row,) = [json.loads(line) for line in (tmp_path / "logs" / "rollout0.jsonl").read_text().splitlines()]
    assert (row["step"], row["eval/version"], row["eval/version_max"], row["eval/accuracy"]) == (7, 7, 8, 1.0)
    (result,) = evaluations.curve(tmp_path / "logs")  # as the summary lists it
    assert (result["version"], result["version_max"], result["accuracy"]) == (7, 8, 1.0)
    # an evaluation between the first and the last stays off the bus: the records hold its figures
    assert bus.get(protocol.eval_result("step-4")) is None
    report = ProgressReporter(tmp_path / "learner.jsonl", every=10, max_steps=10, quiet_seconds=3600,
                              evaluations_file=tmp_path / "logs" / "rollout0.jsonl")
    report()
    assert capsys.readouterr().out == "step     7/10  held-out accuracy 100.0% (greedy, 2 problems, versions 7-8)\n"


class Served:
    """The version inference serves, as the test moves it; evaluation episodes answer, with it, once told to."""
    version = 0
    answer: asyncio.Event | None = None


class AnsweredWhenTold(Agent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await Served.answer.wait()
        return [Trajectory(token_ids=[5, 6], loss_mask=[0, 1], logprobs=[0.0, -0.1], versions=[-1, Served.version],
                           turn_ends=[2], turn_rewards=[1.0], reward=1.0, group_id=prompt.qid, stop_reason="stop",
                           metrics={"success": 1.0})]


register_agent("answered-when-told", AnsweredWhenTold)


class ServingTheTestsVersion(RolloutWorker):
    async def current_version(self) -> int:
        return Served.version


def test_no_two_evaluations_measure_the_same_weights(tmp_path):
    """Inference loads new weights while an evaluation runs: the one started for version 4 was all version 6's, and
    the one started for 6 meanwhile measured the same weights: the curve had two points at version 6, and the final
    evaluation logged the last version's a second time."""
    @dataclasses.dataclass
    class AnsweredWhenToldExperiment(AsyncPPOMATHConfig):
        @property
        def agent(self):
            return AgentAbstraction("answered-when-told", {})

    config = AnsweredWhenToldExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.eval_steps, config.max_concurrent_rollouts = 2, 0  # no training episode: the loop only evaluates
    bus = InProcessBus()
    worker = ServingTheTestsVersion(config, bus, 0)
    worker.train_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(4)]
    worker.eval_rows = worker.train_rows[:2]

    async def until(condition):
        while not condition():
            await asyncio.sleep(0.01)

    async def run():
        Served.version, Served.answer = 3, asyncio.Event()
        training = asyncio.create_task(worker.train())  # the next evaluation is due at 4
        await asyncio.sleep(0.2)
        Served.version = 4
        await until(lambda: worker.running)  # version 4's evaluation runs
        Served.version = 6
        await asyncio.sleep(0.5)  # ten passes of the loop at version 6: its evaluation would have started
        Served.answer.set()  # every episode of the evaluation started at 4 is version 6's
        await until(lambda: not worker.running)
        Served.answer.clear()
        Served.version = 8
        await until(lambda: worker.running)
        Served.answer.set()
        await until(lambda: not worker.running)
        bus.set(protocol.LEARNER_DONE, 8)
        await training
        return await worker.evaluate(evaluations.FINAL)  # the final weights, 8, alone measured already

    try:
        final = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        close_shared_pool()
    worker.metrics.close()
    curve = evaluations.curve(tmp_path / "logs")
    assert [(e["version"], e.get("version_max")) for e in curve] == [(6, None), (8, None)]
    assert bus.get(protocol.eval_result("final")) == final and final["version"] == 8


@pytest.mark.parametrize("rate", [0.0, 0.25, 1.0])
def test_evaluation_episodes_are_traced_at_the_sample_rate_the_same_problems_each_time(tmp_path, rate):
    """Every evaluation episode was traced, even at trace.sample_rate=0: a default run with trace.mlflow=true spent
    about 2 minutes exporting them at its end. Sampled by the same hash of the episode id, which names the held-out
    row, every evaluation traces the same problems."""
    worker = later_versions_worker(tmp_path, InProcessBus(), sample_rate=rate, run_dir=tmp_path / "run")
    worker.eval_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(40)]
    asyncio.run(worker.evaluate("initial"))
    asyncio.run(worker.evaluate("final"))
    worker.traces.close()
    worker.metrics.close()
    traced_ids = {tag: sorted(e["episode_id"] for e in read_traces(tmp_path / "run") if e["tag"] == tag)
                  for tag in ("initial", "final")}
    expected = sorted(f"eval-0-{i}" for i in range(40) if traced(f"eval-0-{i}", rate))
    assert traced_ids["initial"] == traced_ids["final"] == expected
    assert 0 < len(expected) < 40 if rate == 0.25 else len(expected) == 40 * rate


class RetriedOnce(InProcessBus):
    """The first admission is made twice, as a Redis client sends a command again whose reply a restart lost."""

    def __init__(self):
        super().__init__()
        self.retries = 1

    def change(self, steps):
        if self.retries and any(step.key == protocol.rollout_position(0) for step in steps):
            self.retries -= 1
            super().change(steps)  # made; its reply never came
        return super().change(steps)


def test_an_admission_sent_again_after_its_reply_was_lost_admits_the_prompt_once(tmp_path):
    config = CancelledWithinExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = RetriedOnce()
    worker = RolloutWorker(config, bus, 0)
    prompts = iter([Prompt("train-0-0", [1, 2], {}), Prompt("train-0-1", [1, 2], {})])

    async def admit_two():
        return [(await worker.admit(prompts)).qid for _ in range(2)]

    assert asyncio.run(admit_two()) == ["train-0-0", "train-0-1"]
    counts = worker.ledger.counts()
    assert counts["admitted"] == counts["in_flight"] == worker.ledger.slots_taken() == 2
    assert bus.get(protocol.rollout_position(0)) == 2


class OutcomeLost(InProcessBus):
    """The bus fails the step that records an episode's outcome (it leaves the worker's unfinished episodes)."""

    def change(self, steps):
        if any(step.key == protocol.rollout_episodes(0) and step.op == "remove" for step in steps):
            raise ConnectionError("the bus went away")
        return super().change(steps)


def test_an_episode_whose_outcome_the_bus_could_not_record_fails_the_worker_instead_of_being_dropped(tmp_path):
    """Its task's error was never looked at: the prompt stayed in flight with nobody running it, and the worker went
    on admitting. Failing, the worker is restarted and its successor redoes the episode (`take_over`)."""
    config = CancelledWithinExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    worker = RolloutWorker(config, OutcomeLost(), 0)
    worker.train_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(4)]

    with pytest.raises(ConnectionError, match="the bus went away"):
        asyncio.run(asyncio.wait_for(worker.train(), 30))
    assert worker.ledger.counts()["in_flight"] >= 1  # not settled: the successor's to redo


class EndsOnTheThirdPass(InProcessBus):
    """Counts how the worker reads whether to go on; `key` is set as the third pass of the train loop reads it."""

    def __init__(self, key: str):
        super().__init__()
        self.key, self.single_reads, self.passes = key, [], 0

    def get(self, key, default=None):
        if key in (protocol.LEARNER_DONE, protocol.STOP):
            self.single_reads.append(key)
            if key == protocol.LEARNER_DONE:  # a pass's first read
                self.next_pass()
        return super().get(key, default)

    def get_keys(self, keys, default=None):
        self.next_pass()
        return super().get_keys(keys, default)

    def next_pass(self) -> None:
        self.passes += 1
        if self.passes == 3:
            self.set(self.key, 5 if self.key == protocol.LEARNER_DONE else 1)


@pytest.mark.parametrize("key", [protocol.LEARNER_DONE, protocol.STOP])
def test_the_train_loop_reads_the_learner_s_end_and_the_stop_in_one_bus_call_a_pass_and_ends_on_either(tmp_path, key):
    """Two round trips and two thread hops a pass, each pass of the loop, were one of the rollout worker's largest
    costs outside its agents (BENCHMARKS.md, 2026-12-07)."""
    config = CancelledWithinExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.max_concurrent_rollouts = 0  # no episode: each pass only reads, then waits GATE_POLL_SECONDS
    bus = EndsOnTheThirdPass(key)
    worker = RolloutWorker(config, bus, 0)
    worker.train_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(4)]
    asyncio.run(asyncio.wait_for(worker.train(), 30))
    assert bus.single_reads == [] and bus.passes == 3


class FailsThriceThenWaits(Agent):
    """Its first three episodes fail as agent_error; the rest wait (on the model, say) until the run ends."""

    def __init__(self):
        self.episodes = 0

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        self.episodes += 1
        if self.episodes <= 3:
            raise RuntimeError("a bug")
        await asyncio.Event().wait()


register_agent("fails-thrice-then-waits", FailsThriceThenWaits)


class AMinuteOnAfterTheFailures(InProcessBus):
    """Each pass of the train loop (its read of whether to go on) notes the count lines the console heard so far, at
    the failure log's clock: 0 while episodes fail, then 59 and 60 seconds after the last failures, and the stop."""

    def __init__(self, caplog):
        super().__init__()
        self.caplog, self.now, self.worker, self.heard = caplog, 0.0, None, []

    def get_keys(self, keys, default=None):
        counts = [r.getMessage() for r in self.caplog.records if "more episodes failed" in r.getMessage()]
        self.heard.append((self.now, counts))
        if sum(self.worker.failures.by_reason.values()) == 3:
            if self.now == 0.0:
                self.now = 59.0
            elif self.now == 59.0:
                self.now = 60.0
            else:
                self.set(protocol.STOP, 1)
        return super().get_keys(keys, default)


def test_a_reason_s_last_failures_are_counted_on_the_console_a_minute_on_though_no_failure_follows(tmp_path, caplog):
    """Said only with the reason's next failure (or at the worker's end), a run whose failures stopped left its
    console silent on the last ones for as long as it went on."""
    config = config_of("fails-thrice-then-waits", tmp_path)
    bus = AMinuteOnAfterTheFailures(caplog)
    worker = bus.worker = RolloutWorker(config, bus, 0)
    worker.failures.clock = lambda: bus.now
    worker.train_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(8)]
    with caplog.at_level("WARNING", logger="rlsys.workers.failure_log"):
        asyncio.run(asyncio.wait_for(worker.train(), 30))
    said = f"2 more episodes failed (agent_error), 3 in all: see {worker.failures.log_file}"
    assert [counts for now, counts in bus.heard if now == 59.0] == [[]]  # not before the minute
    assert bus.heard[-1] == (60.0, [said]), bus.heard  # the pass after the minute said it, the worker still running


def test_a_reason_s_last_failures_are_counted_on_the_console_a_minute_on_while_worker_0_evaluates(tmp_path, caplog):
    """Only the train loop asked for the counts due: through worker 0's initial and final evaluations, which run
    outside it, a count due waited for the evaluation's end."""
    config = config_of("fails-thrice-then-waits", tmp_path)
    worker = RolloutWorker(config, InProcessBus(), 0)
    now = 0.0
    worker.failures.clock = lambda: now
    worker.eval_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(8)]
    said = f"2 more episodes failed (agent_error), 3 in all: see {worker.failures.log_file}"

    def counts() -> list[str]:
        return [r.getMessage() for r in caplog.records if "more episodes failed" in r.getMessage()]

    async def a_minute_on_within_the_evaluation() -> tuple[list, list]:
        nonlocal now
        evaluation = asyncio.create_task(worker.evaluate(evaluations.INITIAL))
        while sum(worker.failures.by_reason.values()) < 3:  # the rest of its episodes wait until it is cancelled
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * rollout_worker.SAY_DUE_EVERY)
        before, now = counts(), 60.0
        for _ in range(int(5 / 0.01)):
            if counts():
                break
            await asyncio.sleep(0.01)
        assert not evaluation.done()
        evaluation.cancel()
        return before, counts()

    with caplog.at_level("WARNING", logger="rlsys.workers.failure_log"):
        before, after = asyncio.run(asyncio.wait_for(a_minute_on_within_the_evaluation(), 30))
    assert before == []  # not before the minute
    assert after == [said]  # said while the evaluation still ran


def test_a_reason_s_last_failures_are_counted_on_the_console_while_worker_0_waits_for_the_final_weights(tmp_path,
                                                                                                      caplog):
    config = config_of("fails-thrice-then-waits", tmp_path)
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    now = 0.0
    worker.failures.clock = lambda: now
    for qid in ("eval-0", "eval-1", "eval-2"):
        worker.failures.failed(qid, "agent_error", "RuntimeError: a bug")
    bus.set(protocol.LEARNER_DONE, 5)  # inference serves no version yet: the wait goes on
    now = 60.0

    async def wait_a_while():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.wait_for_final_weights(), 1)

    with caplog.at_level("WARNING", logger="rlsys.workers.failure_log"):
        asyncio.run(wait_a_while())
    assert [r.getMessage() for r in caplog.records if "more episodes failed" in r.getMessage()] == [
        f"2 more episodes failed (agent_error), 3 in all: see {worker.failures.log_file}"]


def test_a_prompt_still_in_flight_from_the_last_pass_is_skipped_and_the_next_one_admitted(tmp_path, caplog):
    config = CancelledWithinExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    worker.training.add("train-0-0")  # its episode of the dataset's last pass still runs
    assert worker.ledger.admit("train-0-0", 0) == "admitted"
    prompts = iter([Prompt("train-0-0", [1, 2], {}), Prompt("train-0-1", [1, 2], {})])

    async def admit_twice():
        return [await worker.admit(prompts), (await worker.admit(prompts)).qid]

    assert asyncio.run(admit_twice()) == [None, "train-0-1"]
    assert "prompt train-0-0 is already in flight; not run twice" in caplog.text
    assert bus.get(protocol.rollout_position(0)) == 2  # a restarted worker goes on past both
    assert worker.ledger.counts()["admitted"] == 2


def test_a_restarted_or_resumed_worker_evaluates_next_at_the_next_multiple_of_eval_steps():
    assert [next_evaluation(v, 50) for v in (0, 49, 50, 150, 151)] == [50, 50, 100, 200, 200]
    assert next_evaluation(150, 0) == 0  # eval_steps=0: only before and after


def test_a_resumed_worker_skips_the_prompts_its_checkpoint_trained_filtered_or_failed(tmp_path):
    """Also when it is restarted after save_total_limit deleted that checkpoint (the run goes on from its newer
    saves): reading the checkpoint, the restarted worker died with FileNotFoundError, and so did the run."""
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.cluster.n_rollout_workers = 1
    checkpoint = tmp_path / "step_1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({
        "step": 1, "version": 1, "consumed_prompts": ["train-0-0"],
        "accounting": {"admitted": 2, "trained": 1, "filtered": {}, "failed": {"env_error": 1}, "in_flight": 0,
                       "failed_prompts": {"train-0-2": "env_error"}}}))
    config.resume_from_checkpoint = str(checkpoint)
    bus = InProcessBus()
    initialize_bus_state(bus, config, read_trainer_state(checkpoint))  # the launcher, before any role starts
    shutil.rmtree(checkpoint)  # save_total_limit, once newer checkpoints of the run's line are saved
    worker = RolloutWorker(config, bus, 0)
    rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(4)]
    assert [p.qid for p in worker.prompts(rows, "train", shuffle=False)] == ["train-0-1", "train-0-3"]


class AnswersRight(Agent):
    """One successful trajectory per prompt, without asking the model."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], [-1, 0, 0], [3], [1.0], 1.0, prompt.qid, "stop",
                           {"success": 1.0})]


register_agent("answers-right", AnswersRight)


@dataclasses.dataclass
class AnswersRightExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("answers-right", {})


def evaluated(config, tmp_path, answers) -> dict:
    """Worker 0's initial evaluation of `config`'s agent on held-out rows of `answers`: its result on the bus."""
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    worker.eval_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in answers]
    try:
        asyncio.run(worker.evaluate("initial"))
    finally:
        close_shared_pool()
    return bus.get(protocol.eval_result("initial"))


def test_with_several_rollout_workers_the_evaluation_runs_every_held_out_row(tmp_path):
    """Worker 0 evaluates alone: on the whole held-out set, not on its share of it."""
    config = AnswersRightExperiment()
    config.cluster.n_rollout_workers = 2
    assert evaluated(config, tmp_path, range(5))["episodes"] == 5


@pytest.mark.timeout(60)  # before the fix, the stream looked for a row forever
def test_a_rollout_worker_whose_share_of_the_training_rows_is_empty_is_told_so_instead_of_hanging(tokenizer):
    rows = [{"prompt": "1+0=", "answer": "1"}]
    stream = prompt_stream(rows, tokenizer, "train", seed=0, shuffle=True, shard=1, num_shards=2)
    with pytest.raises(ValueError, match="1 training rows leave some of the 2 rollout workers none to run"):
        next(stream)
    assert next(prompt_stream(rows, tokenizer, "train", seed=0, shuffle=True, shard=0, num_shards=2)).qid == "train-0-0"


def test_a_run_with_fewer_training_rows_than_rollout_workers_stops_at_start(tmp_path):
    config = AsyncPPOMATHConfig()
    config.dataset.path = write_rows(tmp_path / "train.jsonl", [1])
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [2])
    config.model.path = str(tmp_path / "no-model")
    config.cluster.n_rollout_workers = 2
    with pytest.raises(AssetError, match="train.jsonl: 1 training rows leave some of the 2 rollout workers none"):
        prepare_assets(config)


def test_held_out_rows_that_are_also_training_rows_are_named_at_start(tmp_path):
    """Held-out accuracy over rows the run trains on measures memory, not generalisation: nothing said so."""
    lines = []
    config = AsyncPPOMATHConfig()
    config.dataset.path = write_rows(tmp_path / "train.jsonl", [1, 2, 3, 4])
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [3, 4, 5])
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    prepare_assets(config, log=lines.append)
    assert [line for line in lines if line.startswith("warning:")] == [
        f"warning: 2 of the 3 held-out rows ({config.dataset.eval_path}) are also training rows "
        f"({config.dataset.path}): held-out accuracy counts them as if unseen"]
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [5, 6])
    lines.clear()
    prepare_assets(config, log=lines.append)
    assert not [line for line in lines if line.startswith("warning:")]


class FailsOnOddRows(Agent):
    """Solves the even problems and raises on the odd ones."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        if int(prompt.data["answer"]) % 2:
            raise RuntimeError("no answer")
        return await AnswersRight().collect_trajectory(prompt, env, obs_queue, act_queue)


register_agent("fails-on-odd-rows", FailsOnOddRows)


def test_a_held_out_episode_that_failed_counts_against_the_accuracy(tmp_path):
    """Failed evaluation episodes were left out of the accuracy's denominator: an agent that failed on half the
    held-out problems and solved the rest was reported at 100%."""
    @dataclasses.dataclass
    class FailsOnOddRowsExperiment(AsyncPPOMATHConfig):
        @property
        def agent(self):
            return AgentAbstraction("fails-on-odd-rows", {})

    result = evaluated(FailsOnOddRowsExperiment(), tmp_path, range(4))
    assert result["accuracy"] == 0.5 and result["failed"] == 2 and result["episodes"] == 2


class RaisesOrAnswersNothingOnOddRows(Agent):
    """Answers 0 and 2 right, with rewards 1 and 0.5; raises on 1 and returns no trajectories for 3."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        answer = int(prompt.data["answer"])
        if answer == 1:
            raise RuntimeError("no answer")
        if answer == 3:
            return []
        (trajectory,) = await AnswersRight().collect_trajectory(prompt, env, obs_queue, act_queue)
        return [dataclasses.replace(trajectory, reward=1.0 - answer / 4)]


register_agent("raises-or-answers-nothing-on-odd-rows", RaisesOrAnswersNothingOnOddRows)


@pytest.mark.parametrize("scored", [True, False])
def test_the_held_out_figures_are_named_for_the_episodes_they_count(tmp_path, scored):
    """The held-out accuracy counted a failed episode unsolved while the mean reward left it out, under a name that
    said nothing of it; and an episode that returned no trajectories was one that ended, in the accuracy as unsolved
    and in neither the mean reward nor the failed ones. The accuracy is of every held-out problem; the mean reward,
    named so, of the episodes that ended, each with a reward, the others failed."""
    @dataclasses.dataclass
    class HalfEndedExperiment(AsyncPPOMATHConfig):
        @property
        def agent(self):
            return AgentAbstraction("raises-or-answers-nothing-on-odd-rows", {})

        def held_out_score(self, trajectory):
            return super().held_out_score(trajectory) if scored else None  # None: a reward model's run

    result = evaluated(HalfEndedExperiment(), tmp_path, range(4))
    accuracy = {"accuracy": 0.5} if scored else {}
    assert result == {**accuracy, "reward_of_ended": 0.75, "episodes": 2, "failed": 2, "version": 0}
    bus = InProcessBus()
    for tag in (evaluations.INITIAL, evaluations.FINAL):
        evaluations.record(bus, tag, result)
    summary = {**held_out_summary(bus, {}, tmp_path / "logs"), "steps": 4, "minutes": 0.5}
    assert {key: summary[key] for key in ("initial_reward_of_ended", "final_reward_of_ended", "final_failed")} == \
        {"initial_reward_of_ended": 0.75, "final_reward_of_ended": 0.75, "final_failed": 2}
    if not scored:
        assert held_out_line(summary) == (
            "held-out mean reward of the episodes that ended: 0.750 before, 0.750 after 4 steps (+0.000) in 0.5 min; "
            "held-out episodes failed: 2 before, 2 after (left out of the mean)")


def test_the_running_count_is_published_once_a_beat_with_a_new_beat_even_unchanged(tmp_path):
    """The stall watch tells a count a blocked event loop left on the bus from a live one by its beat: a worker that
    published only changes left an idle worker's count looking as frozen as a blocked one's."""
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    asyncio.run(worker.publish_running())
    first = bus.get(protocol.rollout_running(0))
    asyncio.run(worker.publish_running())  # within the interval: nothing new
    assert bus.get(protocol.rollout_running(0)) == first
    worker.published_running -= protocol.ROLLOUT_BEAT_INTERVAL  # a beat later
    asyncio.run(worker.publish_running())
    second = bus.get(protocol.rollout_running(0))
    assert first["running"] == second["running"] == 0 and second["beat"] != first["beat"]
    assert "starting" not in second  # it trains


class SwallowsACancellation(Agent):
    """Catches its episode's first CancelledError and goes on awaiting, as httpx does now and then when a request is
    cancelled while it connects (rlsys/cancellation.py): a second cancellation ends it."""

    ended: list[str] = []

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        try:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(3600)
        finally:
            SwallowsACancellation.ended.append(prompt.qid)


class IgnoresCancellation(Agent):
    """Catches every CancelledError of its episode and goes on awaiting: a plugin bug that must not hang the run's
    end."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        while True:
            try:
                await asyncio.sleep(3600)  # the line the log must name
            except asyncio.CancelledError:
                pass


IGNORING_LINE = inspect.getsourcelines(IgnoresCancellation.collect_trajectory)[1] + 3
register_agent("swallows-a-cancellation", SwallowsACancellation)
register_agent("ignores-cancellation", IgnoresCancellation)


def worker_running_two_episodes_of(agent: str, tmp_path) -> tuple[RolloutWorker, list[str]]:
    return RolloutWorker(config_of(agent, tmp_path), InProcessBus(), 0), ["train-0-0", "train-0-1"]


async def start_episodes(worker: RolloutWorker, qids: list[str]) -> None:
    prompts = iter([Prompt(qid, [1, 2], {}) for qid in qids])
    for _ in qids:
        worker._start(worker.run_training_episode(await worker.admit(prompts)))
    await asyncio.sleep(0.05)  # the episodes await in their agents


def test_episodes_whose_agents_swallow_a_cancellation_end_with_the_training(tmp_path, caplog):
    """asyncio cancels once: the end of training waited for ever for such an episode (the chaos test's hang), and an
    episode for its agent."""
    worker, qids = worker_running_two_episodes_of("swallows-a-cancellation", tmp_path)
    SwallowsACancellation.ended.clear()

    async def main():
        await start_episodes(worker, qids)
        await asyncio.wait_for(worker.cancel_episodes(), 10)

    asyncio.run(main())
    assert not worker.running and sorted(SwallowsACancellation.ended) == qids  # the agents' tasks too
    assert worker.ledger.counts()["in_flight"] == 2  # counted as run_ended at the end, as any cancelled episode
    assert not [r for r in caplog.records if "after they were cancelled" in r.getMessage()]


def test_an_episode_that_ignores_its_cancellation_at_the_end_of_training_is_named_and_left_behind(tmp_path, caplog):
    """It is left behind within a share of the stop's grace, so that a stop does not kill the worker before it
    writes its records: a fixed 30 s outlived the default grace (20 s)."""
    worker, qids = worker_running_two_episodes_of("ignores-cancellation", tmp_path)
    worker.config.cluster.stop_grace_seconds = 3

    async def main():
        await start_episodes(worker, qids)
        await asyncio.wait_for(worker.cancel_episodes(), 10)  # returns, rather than waiting for ever
        return len(worker.running)

    assert run_to_the_end(main()) == 2  # as the role runs it: asyncio.run would wait for them for ever
    errors = [r.getMessage() for r in caplog.records if "after they were cancelled" in r.getMessage()]
    assert len(errors) == 1 and errors[0].startswith("2 episodes still run 1.5 s after"), errors
    # each episode's chain, and the agent's own task, at the line that ignores the cancellation
    assert errors[0].count("in run_training_episode") == 2, errors[0]
    assert errors[0].count(f"test_rollout_worker.py:{IGNORING_LINE} in collect_trajectory") == 2, errors[0]


def test_the_event_loop_ends_even_with_a_task_that_ignores_being_closed():
    """A coroutine that catches GeneratorExit too and awaits again cannot be closed: left pending, not waited for."""
    ended, stubborn, tasks = [], [True], []

    async def ignores_everything():
        while stubborn[0]:
            try:
                await asyncio.sleep(3600)
            except BaseException:  # the plugin bug this is about: GeneratorExit too
                ended.append("caught")

    async def main():
        tasks.append(asyncio.create_task(ignores_everything()))
        await asyncio.sleep(0)
        return "returned"

    left_before = coroutines_left_pending()
    assert run_to_the_end(main(), limit=0.2) == "returned"
    assert ended.count("caught") >= 2  # its cancellations, and its closing
    assert coroutines_left_pending() == left_before + 1  # held: the process's end must not close it (see below)
    # Left as it is, the coroutine is closed again when it is garbage-collected, outside any loop, where its await
    # fails at once and it loops for ever (it hung the next test that built a model here): let it end now.
    stubborn[0] = False
    tasks[0].get_coro().close()


def end_training_with_an_episode_that_ignores_its_cancellation(tmp_path) -> None:
    """A rollout role's process, as rlsys/roles.py runs it, whose training ends with one such episode left behind."""
    from rlsys import roles

    async def train_one_episode(worker):
        await start_episodes(worker, ["train-0-0"])
        await worker.cancel_episodes()

    rollout_worker.RolloutWorker.run = train_one_episode  # no inference worker to wait for: the episode, then its end
    config = config_of("ignores-cancellation", tmp_path)
    config.cluster.stop_grace_seconds = 3  # the episode's cancellation grace is a share of it
    roles._run("rollout", 0, config, InProcessBus(), str(tmp_path))


def test_a_rollout_process_whose_episode_ignores_its_cancellation_still_exits(tmp_path):
    """The episode was left behind at the end of training, but asyncio.run, as it returned, cancelled the tasks left
    once more and waited for them to end: the process never exited, and the run's stop killed it."""
    process = multiprocessing.get_context("spawn").Process(
        target=end_training_with_an_episode_that_ignores_its_cancellation, args=(tmp_path,))
    process.start()
    process.join(timeout=120)  # it ends in seconds; the old one never did
    hung = process.is_alive()
    if hung:
        process.kill()
        process.join()
    assert not hung and process.exitcode == 0


class StepBlocksInAThread(EnvironmentService):
    """A synchronous env step run through asyncio.to_thread, as rlsys/api/env.py asks of blocking work, that never
    returns: a thread cannot be cancelled, and its call goes on after the episode awaiting it was."""

    async def reset(self, seed=None, options=None):
        return None, {}

    async def step(self, action):
        return await asyncio.to_thread(never_returns)


def never_returns():
    threading.Event().wait()  # the line the log must name


class StepsOnce(Agent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await env.reset()
        await env.step("answer")
        return []


NEVER_RETURNS_LINE = inspect.getsourcelines(never_returns)[1] + 1
register_environment("step-blocks-in-a-thread", StepBlocksInAThread)
register_agent("steps-once", StepsOnce)


def end_training_with_an_env_step_blocked_in_a_thread(role: str, index: int, tmp_path) -> int:
    """A rollout role, as rlsys/roles.py runs it, whose training ends while its episode's env step blocks in a
    thread; the entry its process runs (rlsys/placement/local.py), which exits as a role's process does."""
    from rlsys import roles

    logging.basicConfig(filename=tmp_path / "rollout0.log", level=logging.INFO, force=True)

    async def train_one_episode(worker):
        await start_episodes(worker, ["train-0-0"])
        await asyncio.sleep(0.5)  # the env step is in its thread
        await worker.cancel_episodes()

    rollout_worker.RolloutWorker.run = train_one_episode  # no inference worker to wait for: the episode, then its end
    config = config_of("steps-once", tmp_path, env="step-blocks-in-a-thread")
    config.env_timeout = 0  # no limit: the end of training cancels the step
    roles._run(role, index, config, InProcessBus(), str(tmp_path))
    return 0


def test_a_rollout_process_whose_env_step_blocks_in_a_thread_still_exits(tmp_path):
    """The episode ended with the training, but its env step's thread did not: asyncio.run (and run_to_the_end)
    waited for the event loop's default executor, and Python's exit joins every thread of a ThreadPoolExecutor, for
    ever. The process never exited, and the run's stop killed it after its grace."""
    from rlsys.placement.local import run_in_process

    context = multiprocessing.get_context("spawn")
    launcher_terminated = context.Value("b", 0)  # held until the child has it
    process = context.Process(target=run_in_process, args=(end_training_with_an_env_step_blocked_in_a_thread,
                                                           "rollout", 0, tmp_path),
                              kwargs={"launcher_terminated": launcher_terminated, "grace": 20.0})
    process.start()
    process.join(timeout=120)  # it ends in seconds (its start, the episode's end, its wait for threads); the old never
    hung = process.is_alive()
    if hung:
        process.kill()
        process.join()
    assert not hung and process.exitcode == 0
    log = (tmp_path / "rollout0.log").read_text()
    assert "left behind" in log and f"test_rollout_worker.py:{NEVER_RETURNS_LINE} in never_returns" in log, log


class IgnoresBeingClosed(Agent):
    """Catches every exception, GeneratorExit too, and goes on awaiting: its coroutine cannot be closed. Closed by
    the garbage collector once its loop has closed, its await fails at once, and it loops for ever."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        while True:
            try:
                await asyncio.sleep(3600)
            except BaseException:
                pass


register_agent("ignores-being-closed", IgnoresBeingClosed)


def end_training_with_an_episode_that_ignores_being_closed(role: str, index: int, tmp_path) -> int:
    """A rollout role, as rlsys/roles.py runs it, whose training ends with such an episode left behind, its
    coroutine pending as the loop closes; the entry its process runs (rlsys/placement/local.py)."""
    from rlsys import roles

    async def train_one_episode(worker):
        await start_episodes(worker, ["train-0-0"])
        await worker.cancel_episodes()

    rollout_worker.RolloutWorker.run = train_one_episode
    config = config_of("ignores-being-closed", tmp_path)
    config.cluster.stop_grace_seconds = 3  # the episode's cancellation grace is a share of it
    roles._run(role, index, config, InProcessBus(), str(tmp_path))
    return 0


def test_a_rollout_process_whose_episode_ignores_being_closed_still_exits(tmp_path):
    """run_to_the_end leaves such a coroutine pending as its loop closes: collected later (at the latest as the
    interpreter ends), it loops for ever where it is closed, and the process never exited."""
    from rlsys.placement.local import run_in_process

    context = multiprocessing.get_context("spawn")
    launcher_terminated = context.Value("b", 0)
    process = context.Process(target=run_in_process, args=(end_training_with_an_episode_that_ignores_being_closed,
                                                           "rollout", 0, tmp_path),
                              kwargs={"launcher_terminated": launcher_terminated, "grace": 20.0})
    process.start()
    process.join(timeout=120)  # it ends in seconds (its start, the episode's grace and closing); the old never
    hung = process.is_alive()
    if hung:
        process.kill()
        process.join()
    assert not hung and process.exitcode == 0


def test_a_starting_worker_beats_from_its_start_saying_it_is_starting(tmp_path):
    """The stall watch heard from a worker only once it trained: one whose environments' warm-up or first evaluation
    a plugin blocked was taken as starting for ever, and the run waited in silence (tests/test_stall.py)."""
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.dataset.path = write_rows(tmp_path / "train.jsonl", [1, 2, 3])
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [4, 5])
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)

    async def start_without_engines() -> list:
        running = asyncio.create_task(worker.run())  # no inference worker will ever be live: it stays starting
        published, deadline = [], time.monotonic() + 60
        try:
            while len(published) < 3:  # it beats once a second, from its first moment (a thread writes each beat)
                assert time.monotonic() < deadline and not running.done(), published
                await asyncio.sleep(0.05)
                if (value := bus.get(protocol.rollout_running(0))) is not None and value not in published:
                    published.append(value)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        return published

    try:
        published = asyncio.run(start_without_engines())
    finally:
        close_shared_pool()
    assert all(value["starting"] is True and value["running"] == 0 for value in published)


class StopFile:
    """The bus of a stop, as far as a role process told to stop by a file needs one: its STOP key is that file."""

    def __init__(self, path):
        self.path = path

    def set(self, key, value):
        assert key == protocol.STOP
        self.path.touch()


def stop_with_every_wait_of_a_role_s_end(role: str, index: int, tmp_path, grace: float) -> int:
    """A rollout role, as rlsys/roles.py runs it, told to stop (the file `stop`) while everything its end waits for
    waits its longest: an episode that ignores its cancellation and its closing, and a thread blocked for ever."""
    from rlsys import roles

    async def train_until_stopped(worker):
        await start_episodes(worker, ["train-0-0"])
        threading.Thread(target=threading.Event().wait, name="blocked-for-ever").start()
        (tmp_path / "ready").touch()
        while not (tmp_path / "stop").exists():
            await asyncio.sleep(0.01)
        await worker.cancel_episodes()

    rollout_worker.RolloutWorker.run = train_until_stopped
    config = config_of("ignores-being-closed", tmp_path)
    config.cluster.stop_grace_seconds = grace
    roles._run(role, index, config, InProcessBus(), str(tmp_path))
    return 0


def test_a_rollout_role_s_end_fits_in_a_short_stop_grace(tmp_path):
    """The waits of a role's end were fixed or shares of their own: half the grace for the episodes' cancellation,
    then 2 s for the event loop's end and 5 s for the threads. A grace under 14 s was outlasted, and the stop killed
    the worker and counted it an unclean exit although it had ended its part. Each is now a share of the grace.
    At 12 s the shares take 10.2 s and leave 1.8 s for its records and its process's exit (the fixed waits: 13 s)."""
    from rlsys.placement.local import LocalRole, run_in_process
    from rlsys.supervisor import stop_processes

    grace = 12.0
    context = multiprocessing.get_context("spawn")
    launcher_terminated = context.Value("b", 0)
    process = context.Process(target=run_in_process, name="rollout0",
                              args=(stop_with_every_wait_of_a_role_s_end, "rollout", 0, tmp_path, grace),
                              kwargs={"launcher_terminated": launcher_terminated, "grace": grace})
    process.start()
    role = LocalRole(process)
    try:
        for _ in range(1200):  # its start: a minute at most
            if (tmp_path / "ready").exists() or not process.is_alive():
                break
            process.join(0.05)
        assert (tmp_path / "ready").exists(), "the role did not start"
        unclean = stop_processes(StopFile(tmp_path / "stop"), [role], grace)
    finally:
        role.kill()
    assert unclean == {}


class StepsWithoutTheModel(Agent):
    """Resets and steps its environment once, asking the model nothing: an episode that is its environment's calls."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await env.reset()
        await env.step("answer")
        raise AssertionError("not reached: the tests' environments do not return from step")


register_agent("steps-without-the-model", StepsWithoutTheModel)


class HangingStepEnv(EnvironmentService):
    """A synchronous `step` that blocks until `release` (a client call with no timeout of its own)."""

    release = threading.Event()

    def step(self, action):
        HangingStepEnv.release.wait(60)
        return None, 0.0, True, False, {}


register_environment("hanging-step-test-env", HangingStepEnv)


def wait_until_ended(label: str) -> None:
    """The test's threads left running have ended (their release set), so no later test counts them."""
    deadline = time.monotonic() + 10
    while label in left_running():
        assert time.monotonic() < deadline, f"{label} still runs"
        time.sleep(0.01)


def test_threads_left_running_past_the_cap_stop_the_run_naming_the_method_and_the_count(tmp_path):
    """An environment whose `def step` hangs left one thread running per episode, with no end: the worker admitted
    episodes until memory or the thread limit ended its process with an error that named neither. Episodes failing
    (max_failed_in_a_row=0 here: a step that hangs now and then fails none in a row) stopped nothing."""
    config = config_of("steps-without-the-model", tmp_path, env="hanging-step-test-env")
    config.env_timeout, config.max_concurrent_rollouts = 0.2, 2
    config.cluster.max_failed_in_a_row, config.cluster.max_threads_left_running = 0, 3
    worker = RolloutWorker(config, InProcessBus(), 0)
    worker.train_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(50)]
    HangingStepEnv.release.clear()
    others = len(left_running())  # earlier tests' threads, ending once their releases are set
    try:
        with pytest.raises(RunCannotGoOn) as stopped:
            asyncio.run(asyncio.wait_for(worker.train(), 30))
    finally:
        HangingStepEnv.release.set()
        wait_until_ended("HangingStepEnv.step")
    message = str(stopped.value)
    left = int(re.search(r"(\d+) calls of user code still run", message).group(1))
    ours = int(re.search(r"HangingStepEnv.step: (\d+)", message).group(1))
    # checked between episodes: at most the episodes that ran beside the last one left more
    assert 3 <= left <= 3 + config.max_concurrent_rollouts + others and left - others <= ours <= left, message
    assert "which nothing can stop" in message and "raise cluster.max_threads_left_running" in message, message
    assert worker.failures.by_reason["env_timeout"] >= ours


class HangingConstructorEnv(EnvironmentService):
    """A constructor that blocks (a client that connects with no timeout) until `release`, noting whether the event loop
    ran meanwhile: whether a task on it saw the constructor start, within 5 s."""

    constructing, loop_ran, release = threading.Event(), threading.Event(), threading.Event()
    saw_the_loop: bool | None = None

    def __init__(self):
        HangingConstructorEnv.constructing.set()
        HangingConstructorEnv.saw_the_loop = HangingConstructorEnv.loop_ran.wait(5)
        HangingConstructorEnv.release.wait(5)

    async def step(self, action):
        return None, 0.0, True, False, {}


register_environment("hanging-constructor-test-env", HangingConstructorEnv)


def test_an_environment_constructor_that_blocks_fails_its_episode_at_env_timeout_while_the_loop_goes_on(tmp_path,
                                                                                                       caplog):
    """The constructor ran on the worker's event loop: one that blocked stood every episode of the worker still, past
    env_timeout and the worker's beat, until it returned."""
    config = config_of("steps-without-the-model", tmp_path, env="hanging-constructor-test-env")
    config.env_timeout = 0.3
    worker = RolloutWorker(config, InProcessBus(), 0)
    for event in (HangingConstructorEnv.constructing, HangingConstructorEnv.loop_ran, HangingConstructorEnv.release):
        event.clear()

    async def watch_the_constructor_start():
        while not HangingConstructorEnv.constructing.is_set():
            await asyncio.sleep(0.005)
        HangingConstructorEnv.loop_ran.set()

    async def episode():
        start, watch = time.monotonic(), asyncio.create_task(watch_the_constructor_start())
        await worker.run_training_episode(await worker.admit(iter([Prompt("train-0-0", [1, 2], {})])))
        took = time.monotonic() - start
        await watch
        return took

    try:
        took = asyncio.run(episode())
    finally:
        HangingConstructorEnv.release.set()
        wait_until_ended("HangingConstructorEnv.__init__")
    assert HangingConstructorEnv.saw_the_loop, "the constructor blocked the event loop"
    assert worker.failures.by_reason == {"env_timeout": 1} and worker.ledger.counts()["in_flight"] == 0
    assert took < 3, took
    assert "HangingConstructorEnv.__init__ took longer than 0.3s (env_timeout)" in caplog.text
