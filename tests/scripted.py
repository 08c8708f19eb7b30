"""Drive an agent through the real episode router, bus and inference worker, with a scripted engine."""

import asyncio
import threading

from rlsys import protocol
from rlsys.api import Agent, EnvironmentService, Prompt, Trajectory
from rlsys.bus import InProcessBus
from rlsys.engine.scripted import Policy, ScriptedEngine
from rlsys.workers.inference_worker import InferenceWorker
from rlsys.workers.rollout_worker import EpisodeRouter


async def run_scripted_episode(agent: Agent, env: EnvironmentService, prompt: Prompt, policy: Policy,
                               engine: ScriptedEngine | None = None) -> list[Trajectory]:
    """One episode, its requests served by an inference worker thread; the env is closed at the end."""
    engine = engine or ScriptedEngine(policy)
    bus = InProcessBus()
    worker = InferenceWorker(engine, bus, index=0, max_batch_requests=64)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    router = EpisodeRouter(bus, protocol.replies(0))
    dispatcher = asyncio.create_task(router.dispatch_replies())
    obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
    forwarder = asyncio.create_task(router.forward(obs_queue, act_queue))
    try:
        return await agent.collect_trajectory(prompt, env, obs_queue, act_queue)
    finally:
        forwarder.cancel()
        dispatcher.cancel()
        await env.close()
        bus.set(protocol.STOP, 1)
        await asyncio.to_thread(thread.join, 5)
