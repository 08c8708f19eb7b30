"""Drive an agent through the real episode router, bus and inference worker, with a scripted engine."""

import asyncio
import threading

from rlsys import protocol
from rlsys.api import Agent, EnvironmentService, Prompt, Trajectory
from rlsys.bus import InProcessBus
from rlsys.workers.inference_worker import InferenceWorker
from rlsys.workers.routing import EpisodeRouter
from tests.scripted_engine import Policy, ScriptedEngine

EPISODE_TIMEOUT = 60.0


def ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` alone, without special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class WorkerThread(threading.Thread):
    """The inference worker on a thread that keeps the exception it died of, so the test can raise it."""

    def __init__(self, worker: InferenceWorker):
        super().__init__(daemon=True)
        self.worker, self.error = worker, None

    def run(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            self.error = e


async def run_scripted_episode(agent: Agent, env: EnvironmentService, prompt: Prompt, policy: Policy,
                               engine: ScriptedEngine | None = None) -> list[Trajectory]:
    """One episode, its requests served by an inference worker thread; the env is closed at the end."""
    engine = engine or ScriptedEngine(policy)
    bus = InProcessBus()
    thread = WorkerThread(InferenceWorker(engine, bus, index=0, max_batch_requests=64))
    thread.start()
    router = EpisodeRouter(bus, protocol.replies(0), n_inference_workers=1)
    routing = [asyncio.create_task(router.dispatch_replies()), asyncio.create_task(router.watch_workers())]
    obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
    episode = asyncio.create_task(router.serve(agent.collect_trajectory(prompt, env, obs_queue, act_queue), obs_queue,
                                               act_queue))
    started = asyncio.get_running_loop().time()
    try:
        while not episode.done():
            await asyncio.wait([episode], timeout=0.05)
            if thread.error is not None:
                raise RuntimeError("the inference worker died") from thread.error
            if asyncio.get_running_loop().time() - started > EPISODE_TIMEOUT:
                raise TimeoutError(f"episode did not finish in {EPISODE_TIMEOUT}s")
        return episode.result()
    finally:
        episode.cancel()
        for task in routing:
            task.cancel()
        await env.close()
        bus.set(protocol.STOP, 1)
        await asyncio.to_thread(thread.join, 5)
