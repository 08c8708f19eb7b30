"""The rollout worker: runs many episodes at once and bridges each episode's queues to the bus."""

import asyncio
import collections
import contextlib
import dataclasses
import functools
import gc
import logging
import time
from pathlib import Path

from rlsys import evaluations, protocol
from rlsys.api import NOT_GENERATED, AgentAbstraction, GenerationConfig, Prompt, Trajectory, make_agent
from rlsys.api.messages import RolloutRunning
from rlsys.blocking_calls import async_form, left_running
from rlsys.bus.base import Step
from rlsys.cancellation import cancel_and_wait
from rlsys.data.dataset import load_rows, rows_fingerprint
from rlsys.data.prompts import prompt_by_id, prompt_stream
from rlsys.delivery import InvalidMessage, agent_output, group_message
from rlsys.metrics import MetricsLogger, rollout_records
from rlsys.model.tokenizer import load_tokenizer
from rlsys.prompt_ledger import ADMITTED, CLOSED, FAILURE_REASONS, GATE_FULL, PromptLedger, failed
from rlsys.errors import RunCannotGoOn
from rlsys.run_files import role_log
from rlsys.stop_grace import CANCEL_SHARE
from rlsys.tracing import TraceWriter
from rlsys.workers.env_per_row import env_for, env_type, run_environments, with_env_type_metrics
from rlsys.workers.episode_activity import ActQueue, EpisodeActivity, awaiting_at
from rlsys.workers.episode_failure import EpisodeFailed, describe_exception, new_env
from rlsys.workers.failure_log import FailureLog
from rlsys.workers.routing import EpisodeRouter

log = logging.getLogger(__name__)
GATE_POLL_SECONDS = 0.05  # how often a worker with free slots asks the staleness gate again
SAY_DUE_EVERY = 1.0  # seconds between an evaluation's asks for the failure counts due (FailureLog.say_due)


class RolloutWorker:
    def __init__(self, config, bus, index: int, run_dir: Path | None = None):
        """`run_dir`: where traces (and frames) go; None records none."""
        self.config, self.bus, self.index = config, bus, index
        self.ledger = PromptLedger.of(bus, config)
        cluster = config.cluster
        self.router = EpisodeRouter(bus, protocol.replies(index), cluster.n_inference_workers,
                                    cluster.inference_dead_after)
        self.tokenizer = load_tokenizer(config.model.path)
        self.agents = _build_agents(config, lambda agent: agent)
        self.eval_agents = _build_agents(config, _greedy)
        self.metrics = MetricsLogger(Path(config.logging_dir), rollout_records(index))
        self.traces = None if run_dir is None else TraceWriter(
            run_dir, protocol.role_name("rollout", index), self.tokenizer, config.trace.sample_rate,
            Path(run_dir) / config.trace.render_save_dir if config.trace.render_save_dir else None)
        self.train_rows: list[dict] = []  # read_datasets
        self.eval_rows: list[dict] = []
        self.next_prompt: Prompt | None = None  # taken from this worker's share, waiting for the gate to open
        self.running: set[asyncio.Task] = set()
        self.published_running = -protocol.ROLLOUT_BEAT_INTERVAL  # when the count of `running` was last published
        self.training: set[str] = set()  # ids of the training prompts whose episodes run here
        self.episode_ended = asyncio.Event()
        # failed episodes by reason, eval included, and what the log says of them
        self.failures = FailureLog(role_log(config.logging_dir, protocol.role_name("rollout", index)))
        self.failed_in_a_row = 0  # training episodes that failed since the last one that did not
        self.evaluated_in_a_row = 0  # how many of those were the initial evaluation's (count_evaluation_episode)
        self.cannot_go_on: RunCannotGoOn | None = None
        self.crashed: BaseException | None = None  # raised by an episode's task outside the episode (the bus)
        # Prompts a resumed run already trained, filtered or failed: skipped, so none is trained twice or run again.
        # From the bus, not the checkpoint, which save_total_limit may have deleted before this worker (re)started.
        self.consumed = self.ledger.settled_before()
        # worker 0's held-out evaluations between the first and the last: one at a time, the next due at `next_eval`
        self.evaluating: asyncio.Task | None = None
        self.next_eval = 0  # a version (0: none is due)
        self.last_evaluation: dict | None = None  # the figures of the last one logged

    def prompts(self, rows: list[dict], tag: str, shuffle: bool):
        """Endless (shuffle=True) or one-pass stream of this worker's share of a dataset's rows."""
        return prompt_stream(rows, self.tokenizer, tag, seed=self.config.seed, shuffle=shuffle, shard=self.index,
                             num_shards=self.config.cluster.n_rollout_workers, skip=frozenset(self.consumed))

    async def run(self) -> None:
        # First: the stall watch hears from a worker whose start a plugin blocks (rlsys/stall.py)
        starting = asyncio.create_task(self.beat_while_starting())
        routing = [asyncio.create_task(self.router.dispatch_replies()),
                   asyncio.create_task(self.router.watch_workers())]
        try:
            # Engines take a while to start, and so do what environments share: episodes begin once both are up, and
            # the datasets are read meanwhile.
            await asyncio.gather(self.router.live_worker(), self.warm_up_environments(), self.read_datasets())
            gc.freeze()  # what the read built and imported (rows, HF datasets, pyarrow) lives as long as the role
            # not a restart
            if self.index == 0 and not await asyncio.to_thread(evaluations.initial_evaluation_ended, self.bus):
                # resumed, the evaluation of the checkpoint's weights, at its step: logged as such; the summary's
                # "initial" figures stay the run's first (the checkpoint keeps them)
                resumed = bool(self.config.resume_from_checkpoint)
                await self.evaluate(evaluations.INITIAL, "at the resumed step" if resumed else "initial")
            starting.cancel()
            await self.train()
            self.metrics.log(await self.current_version(), {
                "episodes/failed": sum(self.failures.by_reason.values()),
                **{f"episodes/failed/{reason}": n for reason, n in self.failures.by_reason.items()},
                **self.router.stats.figures()})
            if self.index == 0 and await self.wait_for_final_weights():
                await self.evaluate(evaluations.FINAL)
        finally:
            for task in (starting, *routing):
                task.cancel()
            self.metrics.close()
            self.failures.close()
            if self.traces is not None:
                self.traces.close()
        self.bus.set(protocol.rollout_done(self.index), 1)

    async def read_datasets(self) -> None:
        """The training rows, and for worker 0, which evaluates, the held-out rows: read once, in a thread, while the
        engines start. Reading takes about a second (Hugging Face datasets' import and load): neither the first
        episodes nor later evaluations wait for it, and the event loop never does."""
        data = self.config.dataset
        self.train_rows = await asyncio.to_thread(load_rows, data.path, data.row_format())
        if self.index == 0:
            self.eval_rows = await asyncio.to_thread(load_rows, data.eval_path, data.row_format())
            fingerprint = await asyncio.to_thread(rows_fingerprint, self.train_rows)  # kept by each checkpoint
            await asyncio.to_thread(self.bus.set, protocol.DATASET_FINGERPRINT, fingerprint)

    async def warm_up_environments(self) -> None:
        """One instance of each environment the run uses starts what all its episodes share (EnvironmentService.
        warm_up), within env_timeout. One that cannot is logged; its episodes then fail with their reasons, as they
        would anyway."""
        for abstraction in run_environments(self.config):
            try:
                async with asyncio.timeout(self.config.env_timeout or None):  # 0: no limit
                    env = await new_env(abstraction, 0)  # a constructor may load a model: on a thread of its own
                    await async_form(env.warm_up, f"{type(env).__name__}.warm_up")()  # a `def` on its own thread
            except Exception as e:  # TimeoutError included
                log.warning("environment %s did not warm up (%s); its episodes will start what it needs",
                            abstraction.name, describe_exception(e))

    async def train(self) -> None:
        prompts = self.prompts(self.train_rows, "train", shuffle=True)
        await self.take_over(self.train_rows, prompts)
        self.next_eval = next_evaluation(await self.current_version(), self.config.eval_steps)
        while not any(await asyncio.to_thread(self.bus.get_keys, [protocol.LEARNER_DONE, protocol.STOP])):
            self.count_left_running()
            if self.cannot_go_on:
                raise self.cannot_go_on
            if self.crashed:  # the worker fails, and its successor redoes the episodes whose outcome is not out
                raise self.crashed
            self.episode_ended.clear()
            self.failures.say_due()  # the last failures of a reason are said a minute on, even if none follows
            await self.publish_running()
            if len(self.running) < self.config.max_concurrent_rollouts and (prompt := await self.admit(prompts)):
                self._start(self.run_training_episode(prompt))
                continue
            version = await self.current_version()
            if self.index == 0 and self.evaluation_due(version):
                self.evaluating = self._start(self.evaluate_between(version))
            await self.wait_for_an_episode_to_end(GATE_POLL_SECONDS)
        await self.cancel_episodes()

    async def cancel_episodes(self) -> None:
        """The learner is done: unfinished episodes will never be trained, and are cancelled (again, those that go on:
        rlsys/cancellation.py). One still running CANCEL_SHARE of the stop's grace later (rlsys/stop_grace.py: a stop
        bounds the whole role's end by that grace; a plugin that catches every CancelledError and goes on awaiting) is
        logged with where it waits and left behind: the final evaluation and the run's end do not wait for it for
        ever."""
        grace = self.config.cluster.stop_grace_seconds * CANCEL_SHARE
        stuck = await cancel_and_wait(self.running, grace)
        if stuck:
            # where each waits, and where the tasks they may wait for (an agent's, the endpoint's) are
            others = asyncio.all_tasks() - stuck - {asyncio.current_task()}
            log.error("%d episodes still run %g s after they were cancelled at the end of training; left behind. "
                      "They wait at:\n%s\nThe worker's other tasks wait at:\n%s", len(stuck), grace,
                      "\n".join("\n".join(awaiting_at(task)) for task in stuck),
                      "\n".join("\n".join(awaiting_at(task)) for task in others))

    async def take_over(self, rows: list[dict], prompts) -> None:
        """A restarted worker goes on where its killed predecessor stopped: past the prompts it took, and
        redoing the episodes it had not finished (they are admitted already and hold their gate slots)."""
        for _ in range(await self._bus_get(protocol.rollout_position(self.index)) or 0):
            next(prompts)
        unfinished = await asyncio.to_thread(self.bus.set_members, protocol.rollout_episodes(self.index))
        in_flight = set(await asyncio.to_thread(self.ledger.in_flight))
        for qid in unfinished:
            if qid in in_flight:
                self._start(self.run_training_episode(prompt_by_id(rows, self.tokenizer, qid)))
            else:  # settled by another role (the run ended) just before the predecessor died
                await asyncio.to_thread(self.bus.change, [Step.remove(protocol.rollout_episodes(self.index), qid)])
        if unfinished:
            log.warning("rollout worker %d restarted: redoing %d unfinished episodes", self.index,
                        len(unfinished))

    def _start(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None and self.crashed is None:
            self.crashed = task.exception()  # an episode's outcome not recorded (or an evaluation lost): not silently
        self.episode_ended.set()

    async def wait_for_an_episode_to_end(self, timeout: float) -> None:
        """A slot frees when an episode ends (refilled at once); the gate opens with a new version (polled)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.episode_ended.wait()

    async def publish_running(self, starting: bool = False) -> None:
        """How many episodes this worker runs, for the stall watch (rlsys/stall.py): once a ROLLOUT_BEAT_INTERVAL
        (episodes start and end dozens of times a second; the watch waits minutes), changed or not, with a new beat
        each time. So a count that a loop blocked by a plugin left on the bus is told from one that is true now.
        `starting`: said until the worker trains, while the watch waits for its start."""
        now = time.monotonic()
        if now - self.published_running >= protocol.ROLLOUT_BEAT_INTERVAL:
            self.published_running = now
            # the wall clock: a beat that differs from the last one (and a restarted worker's from its predecessor's)
            running = RolloutRunning(len(self.running), time.time(), starting)
            await asyncio.to_thread(self.bus.set, protocol.rollout_running(self.index), running.to_message())

    async def beat_while_starting(self) -> None:
        """The beat from run()'s start until it trains: environments' warm-up and worker 0's first evaluation."""
        while True:
            await self.publish_running(starting=True)
            await asyncio.sleep(protocol.ROLLOUT_BEAT_INTERVAL)

    async def current_version(self) -> int:
        return self.router.workers.served_version()

    async def admit(self, prompts) -> Prompt | None:
        """The next prompt of `prompts`, admitted through the staleness gate (rlsys/prompt_ledger.py) at the version
        inference serves, and recorded as this worker's in the same atomic step; None while the gate is full or the
        learner closed the ledger for its final save (the prompt waits for the next call), or if the prompt is still
        in flight from the dataset's previous pass (it is skipped)."""
        position = protocol.rollout_position(self.index)
        self.next_prompt = self.next_prompt or next(prompts)
        qid = self.next_prompt.qid
        admission = await asyncio.to_thread(self.ledger.admit, qid, await self.current_version(),
                                            (Step.incr(position), Step.add(protocol.rollout_episodes(self.index), qid)))
        if admission in (GATE_FULL, CLOSED):  # the prompt waits: for a slot, or a restart that opens the ledger
            return None
        prompt, self.next_prompt = self.next_prompt, None
        if admission == ADMITTED or await self.admitted_by_a_retry(qid):
            return prompt
        log.error("prompt %s is already in flight; not run twice", qid)
        await asyncio.to_thread(self.bus.incr, position)  # a restarted worker goes on past it too
        return None

    async def admitted_by_a_retry(self, qid: str) -> bool:
        """Whether `qid`, found in flight, is this worker's without an episode running it: its admission was made,
        but the reply was lost as Redis restarted and the client sent it again (rlsys/bus/redis_bus.py), which then
        found it in flight. Every other unfinished episode of this worker runs (`take_over` redoes a predecessor's)."""
        return qid not in self.training and qid in await asyncio.to_thread(
            self.bus.set_members, protocol.rollout_episodes(self.index))

    @staticmethod
    def agent_for(prompt: Prompt, agents: dict):
        """The agent the row names (`agent_name`, checked when the run started), else the experiment's default."""
        return agents[prompt.data.get("agent_name")]

    async def run_episode(self, agent, prompt: Prompt, tag: str = "train") -> list[Trajectory]:
        """The agent's trajectories; EpisodeFailed (logged in one line and counted) if the env or agent failed.
        Recorded as a trace if sampled (rlsys/tracing.py)."""
        if self.traces is None or not self.traces.wants(prompt.qid):
            return await self.play_episode(agent, prompt, tag != "train")
        started, calls = time.time(), []
        try:
            trajectories = await self.play_episode(agent, prompt, tag != "train", calls)
        except EpisodeFailed as failure:
            self.traces.record(prompt.qid, tag, started, None, (failure.reason, failure.detail), calls)
            raise
        self.traces.record(prompt.qid, tag, started, trajectories, None, calls)
        return trajectories

    async def play_episode(self, agent, prompt: Prompt, evaluation: bool,
                           calls: list | None = None) -> list[Trajectory]:
        obs_queue, act_queue, activity = asyncio.Queue(), ActQueue(), EpisodeActivity()
        env = None
        try:
            env = await new_env(env_for(self.config, prompt, evaluation), self.config.env_timeout, activity)
            trajectories = await self.router.serve(agent.collect_trajectory(prompt, env, obs_queue, act_queue),
                                                   obs_queue, act_queue, calls, activity, self.config.agent_stuck_after)
            try:  # checked here, not only as a training group's message: evaluation reads them too
                agent_output(trajectories)
            except InvalidMessage as e:
                raise EpisodeFailed("invalid_output", str(e)) from None
            if len(self.config.envs) > 1:  # a mixed run: metrics per environment type too
                trajectories = with_env_type_metrics(trajectories, env_type(self.config, prompt))
            return trajectories
        except EpisodeFailed as failure:
            raise self.failed(prompt, failure) from None
        except Exception as e:
            log.debug("episode %s: the agent's traceback", prompt.qid, exc_info=True)
            raise self.failed(prompt, EpisodeFailed("agent_error", describe_exception(e))) from None
        except asyncio.CancelledError as e:
            if asyncio.current_task().cancelling():
                raise  # this episode is being cancelled: the run is ending
            # something the agent awaited was cancelled, not the episode: an agent's error like any other
            raise self.failed(prompt, EpisodeFailed("agent_error", describe_exception(e))) from None
        finally:
            if env is not None:
                await self.close_env(env, prompt)

    async def close_env(self, env, prompt: Prompt) -> None:
        """A failing close is logged, and does not undo an episode that finished."""
        try:
            await env.close()
        except EpisodeFailed as failure:
            log.warning("episode %s: closing its environment failed (%s)", prompt.qid, failure)

    def failed(self, prompt: Prompt, failure: EpisodeFailed) -> EpisodeFailed:
        if failure.reason not in FAILURE_REASONS:  # an agent's or env's own: the ledger could not record the episode
            failure = EpisodeFailed("agent_error", f"EpisodeFailed({failure.reason!r}) is not one of the failure "
                                                   f"reasons {sorted(FAILURE_REASONS)}: {failure.detail}")
        self.failures.failed(prompt.qid, failure.reason, failure.detail)
        return failure

    async def run_training_episode(self, prompt: Prompt) -> None:
        """One admitted prompt: its group goes to the learner, or it is counted as failed and gives its gate slot
        back; either in one atomic step with its leaving this worker's unfinished episodes, so a worker killed at
        any moment redoes exactly the episodes whose outcome is not out. Cancelled (the run is ending), it stays in
        flight and is counted as run_ended."""
        unfinished = Step.remove(protocol.rollout_episodes(self.index), prompt.qid)
        self.training.add(prompt.qid)
        try:
            trajectories = await self.run_episode(self.agent_for(prompt, self.agents), prompt)
            message = self.trajectory_message(prompt, trajectories)
        except EpisodeFailed as failure:
            if not await asyncio.to_thread(self.ledger.untrained, prompt.qid, failed(failure.reason), (unfinished,)):
                await asyncio.to_thread(self.bus.change, [unfinished])  # settled by another role
            self.count_failure_in_a_row(failure)
        else:
            # labelled with its group id: a learner that cannot read the message still settles its prompt
            await asyncio.to_thread(self.bus.change, [Step.append(protocol.TRAJECTORIES, message, prompt.qid),
                                                      unfinished])
            self.count_success_in_a_row()
        finally:
            self.training.discard(prompt.qid)

    def count_success_in_a_row(self) -> None:
        """An episode counted toward max_failed_in_a_row ended well: the failures in a row, and the evaluation's
        share of them, count from 0 again."""
        self.failed_in_a_row = self.evaluated_in_a_row = 0

    def count_failure_in_a_row(self, failure: EpisodeFailed) -> None:
        """Episodes that all fail mean a broken env or agent, not bad luck: the run stops instead of burning
        through the dataset."""
        self.failed_in_a_row += 1
        limit = self.config.cluster.max_failed_in_a_row
        if limit and self.failed_in_a_row >= limit and not self.cannot_go_on:
            evaluated = self.evaluated_in_a_row
            which = (f"episodes ({evaluated} of them the initial held-out evaluation's, which plays training's "
                     "environments)") if evaluated else "training episodes"
            self.cannot_go_on = RunCannotGoOn(
                f"the last {self.failed_in_a_row} {which} all failed; the latest with {failure}. "
                "Fix the environment or agent (or raise cluster.max_failed_in_a_row)")

    def count_left_running(self) -> None:
        """Calls of user code left running on their threads past their deadlines (rlsys/blocking_calls.py) cannot be
        stopped, and one that hangs for good leaves another with each episode that makes it: past
        cluster.max_threads_left_running the run stops naming them, instead of running on until memory or the thread
        limit ends the worker with an error that names neither."""
        limit = self.config.cluster.max_threads_left_running
        left = left_running() if limit and not self.cannot_go_on else []
        if len(left) >= limit > 0:
            by_call = ", ".join(f"{label}: {n}" for label, n in collections.Counter(left).most_common())
            self.cannot_go_on = RunCannotGoOn(
                f"{len(left)} calls of user code still run on threads their episodes left past their deadlines "
                f"({by_call}), which nothing can stop; each further one would hold another. Make the call return "
                "(a timeout of its own) or raise cluster.max_threads_left_running")

    def count_evaluation_episode(self, episodes: list[asyncio.Task], done: asyncio.Task) -> None:
        """An initial evaluation's episode counted as a training one (evaluation_shares_training_failures): a run whose
        every episode fails stops once max_failed_in_a_row of them have, its other held-out episodes cancelled,
        instead of playing all of them (a minute or two) before training fails as many again."""
        if done.cancelled() or not isinstance(failure := done.exception(), (EpisodeFailed, type(None))):
            return  # not an episode's outcome: evaluate raises it
        if failure is None:
            self.count_success_in_a_row()
            return
        self.evaluated_in_a_row += 1
        self.count_failure_in_a_row(failure)
        if self.cannot_go_on:
            for episode in episodes:
                episode.cancel()

    def trajectory_message(self, prompt: Prompt, trajectories) -> dict:
        try:
            return group_message(prompt.qid, trajectories, int(self.config.cluster.max_message_mb * 2**20))
        except InvalidMessage as e:
            raise self.failed(prompt, EpisodeFailed("invalid_output", str(e))) from None

    def evaluation_due(self, version: int) -> bool:
        """Whether worker 0 starts an evaluation between the first and the last at `version`: once inference serves
        `next_eval`, and not while one runs. Inference loads new weights while one runs, so one started for version 4
        may be all version 6's; a second, started for 6 meanwhile, measured those weights again, and the curve had two
        points at version 6."""
        return bool(self.next_eval) and version >= self.next_eval and (self.evaluating is None
                                                                         or self.evaluating.done())

    async def evaluate_between(self, version: int) -> None:
        """The evaluation started at `version`; the next is due at the next multiple of eval_steps after the newest
        version that generated a token of it, so it measures weights no evaluation has."""
        result = await self.evaluate(f"step-{version}")
        newest = result.get(evaluations.VERSION_MAX, result[evaluations.VERSION])
        self.next_eval = next_evaluation(newest, self.config.eval_steps)

    async def evaluate(self, tag: str, label: str = "") -> dict:
        """Greedy episodes on the held-out set: the mean reward of those that ended, and the accuracy of all (the mean
        of the experiment's `held_out_score`, for most an episode's success, a failed episode scoring 0) where every
        episode has a score, logged (the first and last also stored on the bus: rlsys/evaluations.py) and returned. A
        mixed run's environment types each get their own accuracy by the same rule. The final weights are not
        evaluated again where the last evaluation measured them alone (it ended as inference loaded them): that one is
        the final."""
        version = await self.current_version()
        last = self.last_evaluation
        if tag == evaluations.FINAL and last and last[evaluations.VERSION] == version \
                and evaluations.VERSION_MAX not in last:
            await asyncio.to_thread(evaluations.record, self.bus, tag, last)
            log.info("held-out evaluation final: version %d was evaluated already, and is not again", version)
            return last
        # worker 0 evaluates alone, so on every held-out row: its share of them would shrink with n_rollout_workers
        prompts = list(prompt_stream(self.eval_rows, self.tokenizer, "eval", seed=self.config.seed, shuffle=False))
        episodes = [asyncio.create_task(self.run_episode(self.agent_for(p, self.eval_agents), p, tag)) for p in prompts]
        if tag == evaluations.INITIAL and evaluation_shares_training_failures(self.config):
            for episode in episodes:
                episode.add_done_callback(functools.partial(self.count_evaluation_episode, episodes))
        saying = asyncio.create_task(self.say_failures_due())
        try:
            results = await asyncio.gather(*episodes, return_exceptions=True)
        finally:
            saying.cancel()
        if self.cannot_go_on:
            raise self.cannot_go_on
        for result in results:
            if not isinstance(result, (list, EpisodeFailed)):
                raise result  # not an episode's failure (already counted): a bug or a cancellation
        result = self.evaluation_figures(prompts, results, version)
        self.metrics.log(result[evaluations.VERSION], {f"{evaluations.PREFIX}{k}": v for k, v in result.items()})
        if tag in evaluations.ON_THE_BUS:  # the others' only reader, the summary's curve, reads the records
            await asyncio.to_thread(evaluations.record, self.bus, tag, result)
        self.last_evaluation = result
        _log_evaluation(result, label or tag)
        return result

    async def say_failures_due(self) -> None:
        """The failure counts due, every SAY_DUE_EVERY while an evaluation runs: the train loop asks each pass, but
        worker 0's initial and final evaluations run outside it, and may take minutes."""
        while True:
            self.failures.say_due()
            await asyncio.sleep(SAY_DUE_EVERY)

    def evaluation_figures(self, prompts: list[Prompt], results: list, served: int) -> dict:
        """An evaluation's figures (rlsys/evaluations.py names them) from its episodes' `results` (trajectories or
        EpisodeFailed); `served`: the version served when it began."""
        episodes = [trajectories for trajectories in results if isinstance(trajectories, list)]
        failed = len(results) - len(episodes)
        score = self.config.held_out_score
        # The weights evaluated: those that generated its tokens. Inference goes on loading new versions while it
        # runs beside training, so the version served when it began was often not one of them: every episode of the
        # evaluation at version 4 was generated by version 5.
        low, high = evaluated_versions(episodes, served)
        result = {evaluations.REWARD_OF_ENDED: sum(_mean([t.reward for t in ts]) for ts in episodes)
                  / max(len(episodes), 1),
                  evaluations.VERSION: low, **({evaluations.VERSION_MAX: high} if high != low else {}),
                  evaluations.EPISODES: len(episodes), evaluations.FAILED: failed,
                  **held_out_accuracy(score, episodes, evaluations.ACCURACY, failed)}
        if len(self.config.envs) > 1:  # a mixed run: each environment type's accuracy too
            for name in self.config.envs:
                own = [ts for p, ts in zip(prompts, results) if env_type(self.config, p) == name]
                failed_own = sum(isinstance(ts, EpisodeFailed) for ts in own)
                result.update(held_out_accuracy(score, [ts for ts in own if isinstance(ts, list)],
                                                f"{name}/{evaluations.ACCURACY}", failed_own))
        return result

    async def wait_for_final_weights(self) -> bool:
        """True once inference serves the learner's final version; False if the run is stopped first."""
        final = await self._bus_get(protocol.LEARNER_DONE)
        while not await self._bus_get(protocol.STOP):
            if final is not None and await self.current_version() >= final:
                return True
            self.failures.say_due()  # outside the train loop, which asks each pass
            await asyncio.sleep(0.05)
        return False

    async def _bus_get(self, key: str):
        return await asyncio.to_thread(self.bus.get, key)


def evaluation_shares_training_failures(config) -> bool:
    """Whether a held-out episode fails where a training one would: it plays the same agents (greedily) in the same
    environments, on rows the run checked as it checks training's. An evaluation set up its own way (eval_envs) may
    fail for a reason of its own, and its failures, counted unsolved, must not stop a run that trains."""
    return config.eval_envs == config.envs


def next_evaluation(version: int, every: int) -> int:
    """The version of the next evaluation after `version`: the next multiple of `every` (eval_steps; 0: none). A
    worker restarted, or a run resumed, at version 150 evaluates next at 200, not at 50, 100 and 150 at once."""
    return (version // every + 1) * every if every else 0


def evaluated_versions(episodes: list[list[Trajectory]], served: int) -> tuple[int, int]:
    """The oldest and newest weight version that generated a token of the evaluation's `episodes`; `served` (the
    version served when it began) for both where none generated any."""
    generated = [v for trajectories in episodes for t in trajectories for v in t.versions if v != NOT_GENERATED]
    return min(generated, default=served), max(generated, default=served)


def held_out_accuracy(score, episodes: list[list[Trajectory]], key: str, failed: int = 0) -> dict:
    """{key: the mean score of the episodes and of the `failed` ones, which score 0 (a held-out problem the agent
    or environment failed on was not solved: left out, failures would raise the accuracy)}, or {} where a trajectory
    has no score (None): its outcome is a score of another kind, and there is no accuracy to report. An episode
    scores the mean `score` of its trajectories, so it counts once however many it gave (an openai-agent run whose
    client rewrote its history gives several)."""
    scores = [[score(t) for t in trajectories] for trajectories in episodes]
    if any(None in episode for episode in scores):
        return {}
    return {key: sum(map(_mean, scores)) / max(len(scores) + failed, 1)}


def _log_evaluation(result: dict, label: str) -> None:
    low, high = result[evaluations.VERSION], result.get(evaluations.VERSION_MAX, result[evaluations.VERSION])
    versions = f"version {low}" if high == low else f"versions {low}-{high}"
    failed, episodes = result[evaluations.FAILED], result[evaluations.EPISODES]
    figure = evaluations.headline(result)
    if figure == evaluations.ACCURACY:
        log.info("held-out accuracy %s (%s): %.1f%% of %d%s", label, versions, 100 * result[figure],
                 episodes + failed, f" ({failed} failed, counted unsolved)" if failed else "")
    else:
        log.info("held-out mean reward of the episodes that ended %s (%s): %.3f over %d%s", label, versions,
                 result[figure], episodes, f" ({failed} failed, left out)" if failed else "")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _build_agents(config, variant) -> dict:
    """The experiment's default agent (under None) and every agent a dataset row may name."""
    abstractions = {None: config.agent, **config.agents}
    return {name: make_agent(variant(agent)) for name, agent in abstractions.items()}


def _greedy(agent: AgentAbstraction) -> AgentAbstraction:
    """The same agent sampling one greedy answer per prompt, for evaluation."""
    gconfig = agent.args.get("gconfig")
    if not isinstance(gconfig, GenerationConfig):
        return agent
    greedy = dataclasses.replace(gconfig, n=1, temperature=0.0, top_p=1.0, top_k=-1)
    return AgentAbstraction(agent.name, {**agent.args, "gconfig": greedy})
