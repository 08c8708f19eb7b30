"""The rollout worker: runs many episodes at once and bridges each episode's queues to the bus."""

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import uuid
from pathlib import Path

from rlsys import accounting, protocol
from rlsys.api import (AgentAbstraction, GenerationConfig, GenerationOutput, Prompt, Trajectory, make_agent,
                       make_env)
from rlsys.checkpoint import read_trainer_state
from rlsys.data.dataset import load_jsonl_dataset
from rlsys.delivery import InvalidMessage, group_message
from rlsys.metrics import MetricsLogger
from rlsys.model.tokenizer import chat_prompt_ids, load_tokenizer
from rlsys.workers.episode_failure import EpisodeFailed, describe_exception, guard_env

log = logging.getLogger(__name__)


class EpisodeRouter:
    """Sends each episode's requests to the inference workers and routes replies to its act_queue."""

    def __init__(self, bus, reply_queue: str):
        self.bus, self.reply_queue = bus, reply_queue
        self.waiting: dict[str, tuple[str, asyncio.Queue]] = {}  # request id -> (agent's qid, act_queue)

    async def forward(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> None:
        while True:
            qid, token_ids, gconfig = await obs_queue.get()
            rid = uuid.uuid4().hex  # agents may reuse a qid across turns; request ids never repeat
            self.waiting[rid] = (qid, act_queue)
            request = {"rid": rid, "token_ids": list(token_ids), "gconfig": gconfig.to_dict(),
                       "reply_to": self.reply_queue}
            await asyncio.to_thread(self.bus.put, protocol.OBSERVATIONS, request)

    async def dispatch_replies(self) -> None:
        while True:
            for message in await asyncio.to_thread(self.bus.get_many, self.reply_queue, 4096, 0.1):
                qid, act_queue = self.waiting.pop(message["qid"], (None, None))
                if act_queue is not None:  # None: the episode was cancelled while its request ran
                    act_queue.put_nowait(dataclasses.replace(GenerationOutput.from_dict(message), qid=qid))


class RolloutWorker:
    def __init__(self, config, bus, index: int):
        self.config, self.bus, self.index = config, bus, index
        self.router = EpisodeRouter(bus, protocol.replies(index))
        self.tokenizer = load_tokenizer(config.model.path)
        self.agent = make_agent(config.agent)
        self.eval_agent = make_agent(_greedy(config.agent))
        self.metrics = MetricsLogger(Path(config.logging_dir), f"rollout{index}")
        self.running: set[asyncio.Task] = set()
        self.failures: collections.Counter[str] = collections.Counter()  # reason -> failed episodes, eval included
        # Prompts a resumed run already trained (or filtered): skipped, so none is trained twice.
        self.consumed = set(read_trainer_state(Path(config.resume_from_checkpoint))["consumed_prompts"]
                            if config.resume_from_checkpoint else [])

    def prompts(self, path: str, tag: str, shuffle: bool):
        """Endless (training) or one-pass (evaluation) stream of this worker's share of a dataset."""
        rows = load_jsonl_dataset(path)
        n = self.config.cluster.n_rollout_workers
        for epoch in itertools.count() if shuffle else [0]:
            order = list(range(len(rows)))
            if shuffle:
                random.Random(self.config.seed + epoch).shuffle(order)
            for i in order[self.index::n]:
                if f"{tag}-{epoch}-{i}" in self.consumed:
                    continue
                yield Prompt(qid=f"{tag}-{epoch}-{i}", token_ids=chat_prompt_ids(self.tokenizer, rows[i]["prompt"]),
                             data=rows[i])

    async def run(self) -> None:
        dispatcher = asyncio.create_task(self.router.dispatch_replies())
        try:
            if self.index == 0:
                await self.evaluate("initial")
            await self.train()
            self.metrics.log(await self.current_version(), {
                "episodes/failed": sum(self.failures.values()),
                **{f"episodes/failed/{reason}": n for reason, n in self.failures.items()}})
            if self.index == 0:
                await self.wait_for_final_weights()
                await self.evaluate("final")
        finally:
            dispatcher.cancel()
            self.metrics.close()
        self.bus.set(protocol.rollout_done(self.index), 1)

    async def train(self) -> None:
        prompts = self.prompts(self.config.dataset.path, "train", shuffle=True)
        next_eval = self.config.eval_steps
        while not await self._bus_get(protocol.LEARNER_DONE) and not await self._bus_get(protocol.STOP):
            if len(self.running) < self.config.max_concurrent_rollouts and await self.admit():
                self._start(self.run_training_episode(next(prompts)))
                continue
            version = await self.current_version()
            if self.index == 0 and next_eval and version >= next_eval:
                next_eval += self.config.eval_steps
                self._start(self.evaluate(f"step-{version}"))
            await asyncio.sleep(0.01)
        for task in list(self.running):
            task.cancel()  # the learner is done: unfinished episodes will never be trained
        await asyncio.gather(*self.running, return_exceptions=True)

    def _start(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def current_version(self) -> int:
        """The oldest version any inference worker serves: new requests are generated with it or newer."""
        workers = range(self.config.cluster.n_inference_workers)
        return min([await self._bus_get(protocol.inference_version(i)) or 0 for i in workers])

    async def admit(self) -> bool:
        """Staleness gate: admit while admitted prompts <= (version + max_head_offpolicyness + 1) * batch_size.

        `version` is what inference serves, not what the learner published: a request admitted right
        after a publish may still be generated by the previous weights.
        """
        limit = (await self.current_version() + self.config.max_head_offpolicyness + 1) * self.config.ppo.batch_size
        admitted = await asyncio.to_thread(self.bus.incr, protocol.ADMITTED, 1)
        if admitted <= limit:
            return True
        await asyncio.to_thread(self.bus.incr, protocol.ADMITTED, -1)
        return False

    async def run_episode(self, agent, prompt: Prompt) -> list[Trajectory]:
        """The agent's trajectories; EpisodeFailed (logged in one line and counted) if the env or agent failed."""
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        forwarder = asyncio.create_task(self.router.forward(obs_queue, act_queue))
        env = None
        try:
            env = guard_env(make_env(self.config.env), self.config.env_timeout)
            return await agent.collect_trajectory(prompt, env, obs_queue, act_queue)
        except EpisodeFailed as failure:
            raise self.failed(prompt, failure) from None
        except Exception as e:
            log.debug("episode %s: the agent's traceback", prompt.qid, exc_info=True)
            raise self.failed(prompt, EpisodeFailed("agent_error", describe_exception(e))) from None
        finally:
            forwarder.cancel()
            if env is not None:
                await self.close_env(env, prompt)

    async def close_env(self, env, prompt: Prompt) -> None:
        """A failing close is logged, and does not undo an episode that finished."""
        try:
            await env.close()
        except EpisodeFailed as failure:
            log.warning("episode %s: closing its environment failed (%s)", prompt.qid, failure)

    def failed(self, prompt: Prompt, failure: EpisodeFailed) -> EpisodeFailed:
        self.failures[failure.reason] += 1
        log.warning("episode %s failed (%s): %s", prompt.qid, failure.reason, failure.detail)
        return failure

    async def run_training_episode(self, prompt: Prompt) -> None:
        """One admitted prompt: its group goes to the learner, or it is counted as failed and gives its gate
        slot back. Cancelled (the run is ending), it stays in flight and is counted as run_ended."""
        if not await asyncio.to_thread(accounting.admit, self.bus, prompt.qid):
            log.error("prompt %s is already in flight; not run twice", prompt.qid)
            await asyncio.to_thread(self.bus.incr, protocol.ADMITTED, -1)
            return
        try:
            trajectories = await self.run_episode(self.agent, prompt)
            message = self.trajectory_message(prompt, trajectories)
        except EpisodeFailed as failure:
            await asyncio.to_thread(accounting.settle_untrained, self.bus, prompt.qid, accounting.failed(failure.reason))
            return
        await asyncio.to_thread(self.bus.stream_add, protocol.TRAJECTORIES, message)

    def trajectory_message(self, prompt: Prompt, trajectories) -> dict:
        try:
            return group_message(prompt.qid, trajectories, int(self.config.cluster.max_message_mb * 2**20))
        except InvalidMessage as e:
            raise self.failed(prompt, EpisodeFailed("invalid_output", str(e))) from None

    async def evaluate(self, tag: str) -> float:
        """Greedy accuracy (mean final reward) on the held-out set, logged and stored on the bus."""
        version = await self.current_version()
        prompts = list(self.prompts(self.config.dataset.eval_path, "eval", shuffle=False))
        results = await asyncio.gather(*(self.run_episode(self.eval_agent, p) for p in prompts), return_exceptions=True)
        for result in results:
            if not isinstance(result, (list, EpisodeFailed)):
                raise result  # not an episode's failure (already counted): a bug or a cancellation
        rewards = [t.reward for trajectories in results if isinstance(trajectories, list) for t in trajectories]
        accuracy = sum(rewards) / max(len(rewards), 1)
        result = {"accuracy": accuracy, "version": version, "episodes": len(rewards)}
        self.metrics.log(version, {f"eval/{k}": v for k, v in result.items()})
        await asyncio.to_thread(self.bus.set, protocol.eval_result(tag), result)
        log.info("held-out accuracy %s (version %d): %.1f%% of %d", tag, version, 100 * accuracy, len(rewards))
        return accuracy

    async def wait_for_final_weights(self) -> None:
        final = await self._bus_get(protocol.LEARNER_DONE)
        while not await self._bus_get(protocol.STOP) and await self.current_version() < final:
            await asyncio.sleep(0.05)

    async def _bus_get(self, key: str):
        return await asyncio.to_thread(self.bus.get, key)


def _greedy(agent: AgentAbstraction) -> AgentAbstraction:
    """The same agent sampling one greedy answer per prompt, for evaluation."""
    gconfig = agent.args.get("gconfig")
    if not isinstance(gconfig, GenerationConfig):
        return agent
    greedy = dataclasses.replace(gconfig, n=1, temperature=0.0, top_p=1.0, top_k=-1)
    return AgentAbstraction(agent.name, {**agent.args, "gconfig": greedy})
