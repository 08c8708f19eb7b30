"""A run that can no longer make progress stops with an error that says why, instead of waiting in silence."""

import itertools
import re
import threading
import time
from pathlib import Path

import pytest

from experiments import AsyncPPOMATHConfig
from rlsys import protocol
from rlsys.bus import InProcessBus
from rlsys.cli import parse_config
from rlsys.launcher import launch
from rlsys.run_start import initialize_bus_state
from rlsys.prompt_ledger import PromptLedger
from rlsys.api.messages import RolloutRunning, WorkerStatus
from rlsys.stall import RunStalled, StallWatch
from rlsys.supervisor import Supervisor
from rlsys.errors import RoleFailed
from rlsys.workers.inference_status import InferenceStatus
from tests.helpers import child_pids, left_behind, small_run_overrides
from tests.test_training_loop import run_bus


def publish_running(bus, index: int, episodes: int, starting: bool = False) -> None:
    """What a rollout worker publishes once a second: its count of running episodes, with a new beat, and from its
    start until it trains, that it is starting."""
    bus.set(protocol.rollout_running(index), RolloutRunning(episodes, time.time() + next(BEATS), starting).to_message())


BEATS = itertools.count()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_stops_only_a_run_that_stands_still_mid_training():
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout = 60
    bus, clock = InProcessBus(), Clock()
    ledger = PromptLedger.of(bus, config)
    watch = StallWatch(config, ledger, clock)

    def after(seconds: float) -> None:
        clock.now += seconds
        watch.check(bus)

    def running(episodes: int) -> None:  # what the rollout worker publishes as its tasks start and end
        publish_running(bus, 0, episodes)

    after(0)
    after(1000)  # starting: no initial evaluation yet
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    after(0)
    after(1000)  # nor any inference worker serving (after a restart, the initial evaluation is kept)
    status = InferenceStatus(bus, 0)
    status.publish(WorkerStatus(epoch=1, beat=1, version=0, load=0))
    after(0)
    status.mark_dead()
    after(1000)  # an inference worker being restarted
    status.publish(WorkerStatus(epoch=2, beat=1, version=0, load=0))
    after(0)
    after(1000)  # nor a rollout worker that has not said what it runs: it is starting (its environments warming up)
    running(0)
    after(0)
    after(59)
    with pytest.raises(RunStalled, match="none admitted"):
        after(1)
    ledger.admit("p1", served_version=100)
    running(1)
    after(0)
    after(1000)  # a prompt being generated: its own timeouts end it
    ledger.trained("p1")
    running(0)
    after(0)
    after(59)
    bus.set(protocol.WEIGHTS, {"version": 1, "path": "/w"})  # a new version: progress
    after(59)
    ledger.admit("p2", served_version=100)
    ledger.trained("p2")  # admitted and trained between two polls: progress
    after(59)
    ledger.hold_slots(64)
    after(59)
    with pytest.raises(RunStalled, match=r"stood still for 60 s \(cluster.stall_timeout\).*last published version: 1"
                                         r".*holds 64 prompts.*2 admitted = 2 trained"):
        after(1)
    # Prompts in flight that were all delivered wait for a learner that needs more: nothing generates them.
    ledger.hold_slots(2)
    ledger.admit("p3", served_version=100)
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "p3", "trajectories": []})
    after(0)
    after(59)
    with pytest.raises(RunStalled, match=r"holds 1 groups and waits for 16"):
        after(1)
    ledger.admit("p4", served_version=100)  # and one still being generated is no stall, however long
    running(1)
    after(0)
    after(1000)
    running(0)  # but one in flight that no rollout worker runs was lost: nothing will ever deliver it
    after(0)
    after(59)
    with pytest.raises(RunStalled, match=r"waits for 16 that nobody is generating\. 1 of the prompts in flight are "
                                         r"neither delivered nor run by any rollout worker: they were lost"):
        after(1)
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "p4", "trajectories": []})
    for i in range(5, 5 + 14):  # nor a learner that holds a whole batch: it is training it, however long that takes
        ledger.admit(f"p{i}", served_version=100)
        bus.stream_add(protocol.TRAJECTORIES, {"group_id": f"p{i}", "trajectories": []})
    after(0)
    after(1000)
    bus.set(protocol.LEARNER_DONE, 1)
    after(1000)  # the final evaluation
    config.cluster.stall_timeout = 0
    bus.delete(protocol.LEARNER_DONE)
    never = StallWatch(config, ledger, clock)
    never.check(bus)
    clock.now += 10**6
    never.check(bus)


def test_a_rollout_worker_whose_event_loop_a_plugin_blocks_stops_the_run_naming_it():
    """An agent that blocks the event loop (time.sleep in an async function) froze the worker's published count above
    0: the watch took its episodes as being generated, and the run waited forever. A count whose beat stopped changing
    is stale: the run stops, naming the worker, unless another one still generates."""
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout, config.cluster.n_rollout_workers = 60, 2
    bus, clock = InProcessBus(), Clock()
    ledger = PromptLedger.of(bus, config)
    watch = StallWatch(config, ledger, clock)
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=1, beat=1, version=0, load=0))
    for qid in ("p1", "p2", "p3"):
        ledger.admit(qid, served_version=0)

    def after(seconds: float, live: dict[int, int]) -> None:
        for _ in range(int(seconds)):  # the live workers (index: episodes) beat every second; the watch polls as often
            clock.now += 1
            for index, episodes in live.items():
                publish_running(bus, index, episodes)
            watch.check(bus)

    publish_running(bus, 0, 2)
    publish_running(bus, 1, 1)
    watch.check(bus)
    after(1000, live={0: 2, 1: 1})  # both generate, however long their episodes take
    after(1000, live={1: 1})  # worker 0 is blocked, but worker 1 still generates: the run goes on
    bus.delete(protocol.rollout_running(1))  # worker 1 died and is being restarted: it warms up, not a stall
    after(1000, live={})
    publish_running(bus, 1, 0)  # up again, and idle at a closed gate
    watch.check(bus)
    after(59, live={1: 0})
    with pytest.raises(RunStalled, match=r"Rollout worker 0 has not published its count for 2060 s, with 2 episodes "
                                         r"running: its event loop is blocked") as stalled:
        after(1, live={1: 0})
    assert "Rollout worker 1" not in str(stalled.value)
    assert "were lost" in str(stalled.value) and " 1 of the prompts in flight" in str(stalled.value)


def test_a_rollout_worker_whose_start_a_plugin_blocks_stops_the_run_naming_it():
    """A worker beat only once it trained: one whose environment's warm_up (or, worker 0, whose first evaluation)
    blocked the event loop never said anything, so the watch took it as starting and the run waited forever. It now
    beats from its start, saying it is starting; the watch waits for it while it beats, however long its warm-up, and
    stops the run once its beat has stood still for cluster.stall_timeout."""
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout, config.cluster.n_rollout_workers = 60, 2
    bus, clock = InProcessBus(), Clock()
    watch = StallWatch(config, PromptLedger.of(bus, config), clock)
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=1, beat=1, version=0, load=0))

    def after(seconds: int, live: dict[int, bool]) -> None:  # the live workers (index: starting) beat every second
        for _ in range(seconds):
            clock.now += 1
            for index, starting in live.items():
                publish_running(bus, index, 0, starting)
            watch.check(bus)

    after(1000, live={0: True})  # worker 0 warms up (a model loading), worker 1 not in its run() yet: both starting
    after(1000, live={0: True, 1: True})
    after(59, live={1: True})  # worker 0's loop blocked
    with pytest.raises(RunStalled, match=r"Rollout worker 0 has not published its count for 60 s while starting: "
                                         r"its event loop is blocked") as stalled:
        after(1, live={1: True})
    assert "Rollout worker 1" not in str(stalled.value)
    # Restarted after the initial evaluation, a worker that beats is starting, not idle: the clock waits for it.
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    after(1000, live={0: True, 1: False})
    after(60, live={0: False, 1: False})  # up, and idle at a closed gate: its clock starts at its first beat
    with pytest.raises(RunStalled, match="none admitted"):
        after(1, live={0: False, 1: False})


class Exited:
    """A role's handle whose process has exited, as rlsys.placement's are read by the supervisor."""

    def __init__(self, name: str):
        self.name, self.exitcode, self.exit_reason = name, -9, "was killed by SIGKILL"


def past_its_start(version: int):
    """(config, bus, clock, watch with a 60 s timeout) of a run past its initial evaluation, its inference worker
    serving `version`."""
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout = 60
    bus, clock = InProcessBus(), Clock()
    watch = StallWatch(config, PromptLedger.of(bus, config), clock)
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=1, beat=1, version=version, load=0))
    return config, bus, clock, watch


def test_a_rollout_worker_restarted_after_the_learner_s_death_or_its_own_is_starting_not_stalled():
    """After the learner died every role starts again with the initial evaluation kept, and a rollout worker that dies
    is restarted alone: while its successor's environments warmed up (a reward model loading), no episode ran and
    nothing was admitted, and the watch stopped the run as stalled after 120 s of a start."""
    config, bus, clock, watch = past_its_start(version=3)
    bus.set(protocol.WEIGHTS, {"version": 3, "path": "/w"})
    initialize_bus_state(bus, config, {}, keep_initial_eval=True)  # the roles' start again: their counts are gone
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=2, beat=1, version=3, load=0))
    watch.check(bus)
    clock.now += 1000
    watch.check(bus)
    publish_running(bus, 0, 0)  # up, and idle at a closed gate
    watch.check(bus)
    restarted = []
    supervisor = Supervisor(config, lambda role, index: restarted.append((role, index)))
    supervisor.processes = {("rollout", 0): Exited("rollout0")}
    supervisor.restart_dead_roles(bus)
    assert restarted == [("rollout", 0)]
    clock.now += 1000
    watch.check(bus)
    publish_running(bus, 0, 0)
    watch.check(bus)
    clock.now += 60
    with pytest.raises(RunStalled):
        watch.check(bus)


def test_a_malformed_running_count_is_set_aside_and_the_watch_goes_on():
    """The watch read a rollout worker's count as a dict it trusted: one whose "running" was no number (another
    program on the bus) raised a TypeError out of the launcher's watch. It is set aside with its reason, and the
    worker taken for one starting until its next beat publishes a good count."""
    _, bus, clock, watch = past_its_start(version=0)
    bus.set(protocol.rollout_running(0), {"running": "two", "beat": 1.0})
    watch.check(bus)
    (letter,) = [e.decode(protocol.DEAD_MESSAGES) for e in bus.stream_range(protocol.DEAD_MESSAGES, 10)]
    assert letter["source"] == protocol.rollout_running(0) and "running must be an integer" in letter["reason"]
    assert bus.get(protocol.rollout_running(0)) is None
    clock.now += 1000
    watch.check(bus)  # starting: no stall
    publish_running(bus, 0, 0)
    watch.check(bus)
    clock.now += 60
    with pytest.raises(RunStalled, match="none admitted"):
        watch.check(bus)


def test_a_stall_while_a_worker_still_serves_an_older_version_says_to_raise_the_timeout():
    """With max_head_offpolicyness=0 the gate waits for the new version to be served; a model whose load takes
    longer than the timeout stands the run still, and the error says which worker lags and what to change."""
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout, config.cluster.n_inference_workers = 60, 2
    bus, clock = InProcessBus(), Clock()
    watch = StallWatch(config, PromptLedger.of(bus, config), clock)
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=1, beat=1, version=3, load=0))
    InferenceStatus(bus, 1).publish(WorkerStatus(epoch=1, beat=1, version=2, load=0))
    bus.set(protocol.WEIGHTS, {"version": 3, "path": "/w"})
    publish_running(bus, 0, 0)
    watch.check(bus)
    clock.now += 60
    with pytest.raises(RunStalled, match=r"Inference workers still serving an older version: 1 \(2\); if loading "
                                         r"version 3 takes them longer than 60 s \(a large model\), raise "
                                         r"cluster.stall_timeout\. The rollout"):
        watch.check(bus)


@pytest.mark.slow
def test_a_run_whose_gate_never_opens_again_stops_with_the_reason(cache_dir, tmp_path):
    """The staleness gate's counter is pushed past any limit mid-run (as a restart that kept a stale gate would
    leave it): once what was in flight is trained, the run stops with RunStalled instead of waiting forever."""
    existing = child_pids()
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "trial_name=stall", "max_steps=50", "eval_steps=0", "cluster.stall_timeout=20"])
    run_dir = Path(config.output_dir) / "async-ppo-math" / "stall"

    def close_the_gate() -> None:
        deadline = time.monotonic() + 600
        while not (run_dir / "redis" / "redis.conf").exists():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        bus = run_bus(run_dir)
        while ((bus.get(protocol.WEIGHTS) or {}).get("version") or 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        PromptLedger.of(bus, config).hold_slots(10**6)
        bus.close()

    closer = threading.Thread(target=close_the_gate, daemon=True)
    closer.start()
    # 20 s, not less: on a starved machine a run between two admissions can hold nothing in flight for seconds
    with pytest.raises(RoleFailed, match=r"stood still for 20 s") as stopped:
        launch(config)  # a run that waited forever would end at pytest's timeout instead
    # A prompt in flight when the gate closed that then ends filtered or failed gives its slot back (CI saw 999998
    # after 2 too_stale), so the gate holds 10**6 less at most those, never more and never a number under a limit.
    counts = re.search(r"holds (\d+) prompts.*\+ (\d+) filtered.*\+ (\d+) failed", str(stopped.value))
    assert counts, str(stopped.value)
    held, filtered, failed = map(int, counts.groups())
    assert 10**6 - filtered - failed <= held <= 10**6, str(stopped.value)
    closer.join(timeout=10)
    assert left_behind(tmp_path, existing) == []


# A plugin file is imported once per process: its names are its own.
BLOCKED_WARM_UP_PLUGIN = '''
import dataclasses
import time

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import EnvServiceAbstraction, register_environment
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv


class BlockingWarmUpEnv(MathCodeSingleStepEnv):
    async def warm_up(self):
        time.sleep(3600)  # a synchronous call in an async function: the worker's event loop stands still


register_environment("blocking-warm-up-env", BlockingWarmUpEnv)


@dataclasses.dataclass
class BlockingWarmUpExperiment(AsyncPPOMATHConfig):
    @property
    def env(self):
        return EnvServiceAbstraction("blocking-warm-up-env")


register_experiment("blocking-warm-up-experiment", BlockingWarmUpExperiment)
'''


@pytest.mark.slow
def test_a_run_whose_environment_blocks_the_loop_in_its_warm_up_stops_naming_the_worker(cache_dir, tmp_path):
    """The rollout worker never started training, so it never beat: the watch took it as starting, and the run
    waited for ever (here, until pytest's timeout)."""
    existing = child_pids()
    plugin = tmp_path / "blocked_warm_up_plugin.py"
    plugin.write_text(BLOCKED_WARM_UP_PLUGIN)
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=blocking-warm-up-experiment", f"plugins=[{plugin}]", "max_steps=2", "cluster.stall_timeout=20",
        "cluster.stop_grace_seconds=5"])
    with pytest.raises(RoleFailed, match=r"Rollout worker 0 has not published its count for 2\d s while starting: its "
                                         r"event loop is blocked, so its environments' warm-up or the initial "
                                         r"evaluation cannot end"):
        launch(config)
    assert left_behind(tmp_path, existing) == []


def test_a_stall_after_a_resume_does_not_call_the_prompts_carried_from_the_checkpoint_lost():
    """The prompts in flight at the checkpoint are counted in flight by the resumed run until it admits them again;
    no episode runs them meanwhile, and none is lost: the stall's message said they were, a defect to report."""
    config = AsyncPPOMATHConfig()
    config.cluster.stall_timeout = 60
    bus, clock = InProcessBus(), Clock()
    ledger = PromptLedger.of(bus, config)
    ledger.start(1, {"admitted": 18, "trained": 16, "in_flight": 2, "in_flight_prompts": ["a", "b"]})
    watch = StallWatch(config, ledger, clock)
    bus.set(protocol.eval_result("initial"), {"accuracy": 0.3})
    InferenceStatus(bus, 0).publish(WorkerStatus(epoch=1, beat=1, version=1, load=0))
    bus.set(protocol.WEIGHTS, {"version": 1, "path": "/w"})
    ledger.admit("c", served_version=100)  # in flight, and run by no rollout worker: lost
    publish_running(bus, 0, 0)
    watch.check(bus)
    clock.now += 60
    publish_running(bus, 0, 0)  # its loop is not blocked
    with pytest.raises(RunStalled) as stalled:
        watch.check(bus)
    message = str(stalled.value)
    assert " 1 of the prompts in flight are neither delivered nor run by any rollout worker" in message, message
    assert "2 of the prompts in flight were in flight at the checkpoint the run resumed from" in message, message
    ledger.close()  # the learner's final save, however long it takes, is no stall
    watch.check(bus)
    clock.now += 1000
    publish_running(bus, 0, 0)
    watch.check(bus)
