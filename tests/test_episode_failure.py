"""Environment calls bounded in time, and failures named by their reason."""

import asyncio
import threading
import time

import pytest

from rlsys.api import EnvironmentService
from rlsys import blocking_calls
from rlsys.blocking_calls import left_running
from rlsys.tools.queue_time import queued_for, within
from rlsys.workers.episode_failure import EpisodeFailed, describe_exception, guard_env
from tests.helpers import LoopTicks


class Env(EnvironmentService):
    def __init__(self, behaviour: str):
        self.behaviour = behaviour

    async def reset(self, seed=None, options=None):
        self.steps = 0
        return None, {}

    async def step(self, action):
        self.steps = getattr(self, "steps", 0) + 1
        if self.behaviour == "raise":
            raise ZeroDivisionError("reward divided by zero")
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "own-timeout":
            raise TimeoutError("the env's own HTTP call timed out")
        return None, 1.0, True, False, {}

    def extra(self) -> str:
        return "still here"


def step(env) -> tuple:
    return asyncio.run(env.step("action"))


def test_a_raising_env_fails_the_episode_as_env_error_naming_the_call():
    with pytest.raises(EpisodeFailed) as failure:
        step(guard_env(Env("raise"), timeout=5))
    assert failure.value.reason == "env_error"
    assert "Env.step raised ZeroDivisionError: reward divided by zero (at " in failure.value.detail
    assert "\n" not in failure.value.detail


def test_a_hanging_env_fails_the_episode_as_env_timeout_after_its_timeout():
    start = time.monotonic()
    with pytest.raises(EpisodeFailed) as failure:
        step(guard_env(Env("hang"), timeout=0.3))
    assert failure.value.reason == "env_timeout" and "took longer than 0.3s" in failure.value.detail
    assert 0.3 <= time.monotonic() - start < 2


class QueuingEnv(Env):
    """A step that runs a tool: it waits for a slot other episodes' calls hold (a sandbox slot), then runs `run` s."""

    def __init__(self, slot: asyncio.Semaphore, run: float):
        super().__init__("fine")
        self.slot, self.run = slot, run

    async def step(self, action):
        async def tool():
            async with queued_for(self.slot):
                await asyncio.sleep(self.run)

        await within(tool(), 5.0)  # the tool call's own limit, inside the step's
        return None, 1.0, True, False, {}


@pytest.mark.parametrize("run, reason", [(0.1, None), (0.6, "env_timeout")])
def test_env_timeout_counts_a_steps_run_not_its_wait_for_a_slot_other_episodes_hold(run, reason):
    """Episodes queued for the sandbox behind others' long calls were failed as env_timeout, their own work quick."""
    async def main():
        slot = asyncio.Semaphore(1)

        async def other_episodes_call():
            async with slot:
                await asyncio.sleep(0.8)

        other = asyncio.ensure_future(other_episodes_call())
        await asyncio.sleep(0)
        try:
            return await guard_env(QueuingEnv(slot, run), timeout=0.4).step("action")
        finally:
            await other

    if reason is None:
        assert asyncio.run(main()) == (None, 1.0, True, False, {})  # 0.8 s queued, 0.1 s run: within 0.4 s
    else:
        with pytest.raises(EpisodeFailed) as failure:
            asyncio.run(main())
        assert failure.value.reason == reason and "took longer than 0.4s" in failure.value.detail


def test_an_envs_own_timeout_error_is_an_env_error():
    with pytest.raises(EpisodeFailed) as failure:
        step(guard_env(Env("own-timeout"), timeout=5))
    assert failure.value.reason == "env_error"


def test_a_guarded_env_is_the_same_object_and_works_as_before():
    env = Env("fine")
    guarded = guard_env(env, timeout=0)  # 0: no limit
    assert guarded is env and isinstance(guarded, Env) and guarded.extra() == "still here"
    assert step(guarded) == (None, 1.0, True, False, {})
    asyncio.run(guarded.reset())
    asyncio.run(guarded.close())


def test_a_fork_of_a_guarded_env_steps_itself_and_is_guarded_too():
    async def fork_and_step():
        original = guard_env(Env("fine"), timeout=5)
        await original.reset()
        copies = [await original.fork(), await original.fork()]
        await copies[0].step("a")
        await copies[0].step("b")
        await copies[1].step("c")
        twice_removed = await copies[1].fork()
        twice_removed.behaviour = "raise"
        with pytest.raises(EpisodeFailed, match="Env.step raised ZeroDivisionError"):
            await twice_removed.step("d")
        return original.steps, [c.steps for c in copies]

    assert asyncio.run(fork_and_step()) == (0, [2, 1])


def test_describe_exception_is_one_line():
    try:
        raise ValueError("first line\nsecond line")
    except ValueError as e:
        text = describe_exception(e)
    assert text.startswith("ValueError: first line (at ") and "test_episode_failure.py" in text and "\n" not in text
    assert describe_exception(KeyError()) == "KeyError"


class SwallowingEnv(Env):
    """A step that catches its first cancellation and goes on, as an HTTP client does now and then when cancelled
    while it connects (rlsys/cancellation.py)."""

    async def step(self, action):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)


def test_an_env_call_that_swallows_its_cancellation_still_ends_at_its_timeout():
    """The time limit cancelled the call once and waited for it to end: for ever."""
    start = time.monotonic()
    with pytest.raises(EpisodeFailed) as failure:
        asyncio.run(asyncio.wait_for(guard_env(SwallowingEnv("fine"), timeout=0.3).step("action"), 10))
    assert failure.value.reason == "env_timeout"
    assert time.monotonic() - start < 3


class SyncEnv(EnvironmentService):
    """Synchronous methods, as a user writes a reward function that may block: `step` sleeps `block` seconds."""

    def __init__(self, block: float, release: threading.Event | None = None):
        self.block, self.release = block, release

    def reset(self, seed=None, options=None):
        return "board", {}

    def step(self, action):
        if self.release is not None:
            self.release.wait(self.block)  # a blocking call: the loop it ran on could do nothing else meanwhile
        else:
            time.sleep(self.block)
        if action == "raise":
            raise ZeroDivisionError("reward divided by zero")
        return None, 1.0, True, False, {"thread": threading.current_thread().name}

    def close(self):
        return asyncio.sleep(0, "an awaitable a synchronous method returned")  # awaited on the loop


def test_a_synchronous_env_method_runs_off_the_event_loop_and_returns_or_raises_as_an_async_one():
    """A `def step` ran on the event loop: a blocking reward stopped every episode of the worker, and what it returned
    (no coroutine) failed every episode as an env_error."""
    async def episode():
        env = guard_env(SyncEnv(0.0), timeout=5)
        observation = await env.reset()
        result = await env.step("answer")
        with pytest.raises(EpisodeFailed) as failure:
            await env.step("raise")
        return observation, result, failure.value, await env.close()

    observation, result, failure, closed = asyncio.run(episode())
    assert observation == ("board", {}) and result[:4] == (None, 1.0, True, False)
    assert result[4]["thread"] == "SyncEnv.step" and closed == "an awaitable a synchronous method returned"
    assert failure.reason == "env_error" and "SyncEnv.step raised ZeroDivisionError: reward divided by zero" in \
        failure.detail


def test_a_synchronous_env_method_that_blocks_fails_its_episode_at_its_deadline_while_the_loop_goes_on():
    """A blocking `def step` froze the event loop until it returned, past any deadline: every episode of the worker
    stood still and the stall watch stopped the run. It now runs on a thread of its own: the deadline ends its
    episode, the loop's other work goes on, and the thread left running is counted until it ends."""
    release = threading.Event()

    async def blocked_and_ticking():
        start = time.monotonic()
        async with LoopTicks() as ticks:
            with pytest.raises(EpisodeFailed) as failure:
                await guard_env(SyncEnv(3600, release), timeout=0.3).step("answer")
        return failure.value, time.monotonic() - start, ticks.count, left_running()

    failure, took, ticks, left = asyncio.run(blocked_and_ticking())
    assert failure.reason == "env_timeout" and "SyncEnv.step took longer than 0.3s" in failure.detail
    assert 0.3 <= took < 3 and ticks >= 5 and left.count("SyncEnv.step") == 1
    release.set()
    deadline = time.monotonic() + 10
    while "SyncEnv.step" in left_running():
        assert time.monotonic() < deadline, "the thread's end was not counted"
        time.sleep(0.01)


def test_a_thread_whose_call_returned_takes_the_next_call_and_a_hung_one_takes_none(monkeypatch):
    """Each synchronous call started a thread of its own, which costs several times the hand-over to a waiting one;
    an episode now makes its environment on one, so every episode paid it. A thread whose call returned takes the
    next, even one made at once (it is waiting before its caller hears back); one still in a call takes none (a later
    call never waits behind a hung one); an idle one ends in time."""
    monkeypatch.setattr(blocking_calls, "IDLE_SECONDS", 0.5)
    started, real_init = [], blocking_calls._Thread.__init__

    def counted_init(self):
        real_init(self)
        started.append(self.thread)

    monkeypatch.setattr(blocking_calls._Thread, "__init__", counted_init)
    release, hung_on = threading.Event(), []

    def hang():
        hung_on.append(threading.get_ident())
        release.wait()

    async def calls():
        for _ in range(20):  # one after another: one thread at most (none if an earlier test left one idle)
            await blocking_calls.on_own_thread(threading.get_ident, "in turn")
        in_turn = len(started)
        hung = asyncio.ensure_future(blocking_calls.on_own_thread(hang, "hung"))
        while not hung_on:
            await asyncio.sleep(0.01)
        beside = await asyncio.wait_for(blocking_calls.on_own_thread(threading.get_ident, "beside"), 5)
        release.set()
        await hung
        return in_turn, beside

    in_turn, beside = asyncio.run(calls())
    assert in_turn <= 1 and beside != hung_on[0]
    deadline = time.monotonic() + 10
    while any(thread.is_alive() for thread in started):
        assert time.monotonic() < deadline, "idle threads did not end"
        time.sleep(0.05)
