"""An agent stuck on something of its own (not the model, not its environment) fails its episode as agent_stuck,
through the real rollout worker, and the evaluation or the training goes on."""

import asyncio
import threading

import pytest

from experiments import AsyncPPOMATHConfig
from experiments.common import InferenceConfig
from rlsys import protocol
from rlsys.api import (Agent, EnvironmentService, GenerationConfig, Model, ModelRequest, Prompt, Trajectory,
                       register_agent, register_environment)
from rlsys.bus import InProcessBus
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.transformers_engine import TransformersBackend
from rlsys.impl.env.math_verifier import close_shared_pool
from rlsys.workers.episode_activity import ActQueue, EpisodeActivity, stuck_for
from rlsys.workers.inference_worker import InferenceWorker
from rlsys.workers.rollout_worker import RolloutWorker
from tests.helpers import config_of


def solved(prompt: Prompt) -> list[Trajectory]:
    return [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], [-1, 0, 0], [3], [1.0], 1.0, prompt.qid, "stop",
                       {"success": 1.0})]


class AsksOnceGetsTwice(Agent):
    """Asks the model, reads its reply, and on odd rows awaits a second reply it never asked for (the slip of a
    newcomer's plugin that hung a run's initial evaluation)."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await obs_queue.put(ModelRequest(prompt.qid, prompt.token_ids, GenerationConfig(max_new_tokens=2)))
        await act_queue.get()
        if int(prompt.data["answer"]) % 2:
            await act_queue.get()
        return solved(prompt)


register_agent("asks-once-gets-twice", AsksOnceGetsTwice)


class SlowStep(EnvironmentService):
    async def reset(self, seed=None, options=None):
        return None, {}

    async def step(self, action):
        await asyncio.sleep(2.0)  # longer than the test's agent_stuck_after: its own limit is env_timeout
        return None, 1.0, True, False, {}


register_environment("slow-step", SlowStep)


class WaitsOnItsOwn(Agent):
    """Reads replies through a Model (whose task awaits act_queue.get() all along); on odd rows waits on an event
    nothing sets, on even ones on an environment step longer than agent_stuck_after."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        async with Model(obs_queue, act_queue):
            if int(prompt.data["answer"]) % 2:
                await asyncio.Event().wait()
            await env.step((prompt.qid, ["0"]))
        return solved(prompt)


register_agent("waits-on-its-own", WaitsOnItsOwn)


async def with_inference(worker: RolloutWorker, bus, work):
    """`work` with a real (transformers) inference worker on a thread serving the rollout worker's router."""
    engine = GenerationEngine(TransformersBackend(worker.config.model.path, InferenceConfig(engine="transformers"), 0))
    inference = threading.Thread(target=InferenceWorker(engine, bus, 0, max_batch_requests=8).run, daemon=True)
    inference.start()
    router = worker.router
    routing = [asyncio.create_task(router.dispatch_replies()), asyncio.create_task(router.watch_workers())]
    try:
        return await asyncio.wait_for(work, 60)  # before the fix, for ever
    finally:
        for task in routing:
            task.cancel()
        bus.set(protocol.STOP, 1)
        await asyncio.to_thread(inference.join, 10)


@pytest.mark.timeout(120)
def test_an_agent_that_awaits_a_reply_it_never_asked_for_fails_as_stuck_and_the_evaluation_and_training_go_on(
        tmp_path, caplog):
    config = config_of("asks-once-gets-twice", tmp_path)
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    worker.eval_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(4)]

    async def evaluate_then_train():
        await worker.evaluate("initial")
        prompts = iter([Prompt("train-0-0", [1, 2], {"answer": "1"}), Prompt("train-0-1", [1, 2], {"answer": "2"})])
        for _ in range(2):
            await worker.run_training_episode(await worker.admit(prompts))

    try:
        asyncio.run(with_inference(worker, bus, evaluate_then_train()))
    finally:
        close_shared_pool()
    result = bus.get(protocol.eval_result("initial"))
    assert result["failed"] == 2 and result["episodes"] == 2 and result["accuracy"] == 0.5
    assert worker.failures.by_reason == {"agent_stuck": 3}
    counts = worker.ledger.counts()
    assert counts["failed"] == {"agent_stuck": 1} and counts["in_flight"] == 1  # the other was delivered
    assert "awaits act_queue.get() with no request put" in caplog.text and "in collect_trajectory" in caplog.text


@pytest.mark.timeout(120)
def test_an_agent_idle_past_agent_stuck_after_fails_naming_where_it_waits_and_a_long_env_step_does_not(
        tmp_path, caplog):
    config = config_of("waits-on-its-own", tmp_path, env="slow-step")
    config.agent_stuck_after = 1.0
    bus = InProcessBus()
    worker = RolloutWorker(config, bus, 0)
    worker.eval_rows = [{"prompt": f"{a}+0=", "answer": str(a)} for a in range(2)]
    try:
        asyncio.run(with_inference(worker, bus, worker.evaluate("initial")))
    finally:
        close_shared_pool()
    assert bus.get(protocol.eval_result("initial"))["failed"] == 1 and worker.failures.by_reason == {"agent_stuck": 1}
    assert "ran 1s (agent_stuck_after) with no model request outstanding" in caplog.text
    assert "test_stuck_agents.py" in caplog.text and "in collect_trajectory" in caplog.text


def test_a_negative_agent_stuck_after_is_refused():
    with pytest.raises(ValueError, match="agent_stuck_after must be at least 0, got -1"):
        AsyncPPOMATHConfig(agent_stuck_after=-1)


def test_an_episode_that_asks_and_is_answered_between_two_looks_is_not_idle():
    """The watcher looks now and then: an agent whose quick requests all fall between its looks is busy, not stuck."""
    async def main() -> bool:
        activity, obs_queue, act_queue = EpisodeActivity(), asyncio.Queue(), ActQueue()
        playing = asyncio.create_task(asyncio.Event().wait())
        watcher = asyncio.create_task(stuck_for(playing, activity, obs_queue, act_queue, limit=1.0))
        for _ in range(30):  # 3 s: three limits
            activity.count_request(1)
            activity.count_request(-1)  # answered before the watcher looks
            await asyncio.sleep(0.1)
        busy = not watcher.done()
        stuck = await asyncio.wait_for(watcher, 5)  # then left idle: stuck after the limit
        playing.cancel()
        return busy and "agent_stuck_after" in stuck

    assert asyncio.run(main())
