"""Routing an episode's generation requests to inference workers, and their replies back to the episode.

- Sticky: every request of an episode goes to the worker that served its first one, so its earlier
  turns are in that worker's prefix cache.
- Least loaded: a new episode goes to the live worker with the fewest requests in flight (its published
  load plus what this router sent it since).
- Nothing lost: a router remembers every request until its reply arrives. When a worker stops beating
  or restarts (a new epoch: its queue was cleared), the requests it held are re-sent to a live worker;
  the episode just waits a little longer. When the bus server restarts, a request or reply may have been
  lost on the way, so every unanswered request is sent again (a worker drops a copy of a request it is
  running). A late duplicate reply is dropped.
- Nothing generated for nobody: the requests of an episode that ends unanswered (it failed) are aborted on the
  worker that holds them, which drops them from its batch.
- Nothing sent that a worker's parser would refuse: each request is checked by the parser the inference
  worker runs. A worker sets a bad request aside and never answers it, so the router refuses it instead, and
  the episode fails at once with the reason rather than waiting for a reply that never comes. What only the
  engine can check (the model's context length, its vocabulary) the worker answers with a refusal, which fails
  the episode the same way; so does a reply the router cannot use (NaN logprobs), set aside with its reason.
"""

import asyncio
import collections
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field

from rlsys import protocol
from rlsys.api import GenerationConfig
from rlsys.api.messages import GenerationAbort, GenerationRefusal, GenerationRequest, InvalidMessage, \
    parse_generation_request, parse_reply
from rlsys.bus import ServerRestarts, Undecodable
from rlsys.bus.dead_letters import set_aside
from rlsys.cancellation import cancel_and_wait
from rlsys.errors import EpisodeFailed
from rlsys.workers.episode_activity import EpisodeActivity, awaiting_at, stuck_for
from rlsys.workers.inference_status import InferenceStatus, read_statuses

REFRESH_INTERVAL = 0.05  # seconds between reads of the workers' status keys
UNDELIVERED = -1  # the epoch of a request that must be sent again (no worker epoch is negative)
LATENCY_WINDOW = 100_000  # request latencies kept for percentiles


@dataclass
class WorkerView:
    """One inference worker as this router last saw it."""

    epoch: int = 0
    beat: int = -1
    version: int = 0
    load: int = 0
    beat_seen_at: float = 0.0  # monotonic time the beat last moved
    sent_since_refresh: int = 0  # requests this router sent it since the status it last published
    seen: bool = False
    dead: bool = False  # the launcher saw this epoch's process exit


class InferenceWorkers:
    """Liveness, load and served version of every inference worker, from their status keys."""

    def __init__(self, bus, n_workers: int, dead_after: float):
        self.bus, self.dead_after = bus, dead_after
        self.views = [WorkerView() for _ in range(n_workers)]
        self.statuses = [InferenceStatus(bus, index) for index in range(n_workers)]

    def refresh(self) -> None:
        now = time.monotonic()
        for view, status in zip(self.views, read_statuses(self.bus, self.statuses)):
            if status is None:
                continue
            if not view.seen or status.beat != view.beat or status.epoch != view.epoch:
                view.beat_seen_at = now
            # A status published again counts the requests the worker took; one read again (a refresh comes five
            # times a beat) counts none of those sent since, which stay counted here.
            if not view.seen or (status.epoch, status.beat, status.version, status.load) != \
                    (view.epoch, view.beat, view.version, view.load):
                view.sent_since_refresh = 0
            view.seen = True
            view.epoch, view.beat, view.version, view.load = status.epoch, status.beat, status.version, status.load
            view.dead = status.dead

    def is_alive(self, index: int) -> bool:
        """Marked dead by the launcher that saw it exit (at once), or silent for `dead_after` seconds (a worker
        no launcher here watches)."""
        view = self.views[index]
        return view.seen and not view.dead and time.monotonic() - view.beat_seen_at < self.dead_after

    def serves(self, index: int, epoch: int) -> bool:
        """Whether a request sent to `index` in `epoch` is still in a live worker's hands."""
        return self.is_alive(index) and self.views[index].epoch == epoch

    def least_loaded(self) -> int | None:
        live = [i for i in range(len(self.views)) if self.is_alive(i)]
        return min(live, key=lambda i: self.views[i].load + self.views[i].sent_since_refresh, default=None)

    def served_version(self) -> int:
        """The oldest version a live worker serves: new requests are generated with it or newer."""
        versions = [v.version for i, v in enumerate(self.views) if self.is_alive(i)]
        return min(versions or [v.version for v in self.views if v.seen] or [0])


@dataclass
class PendingRequest:
    qid: str  # the agent's id for it, restored on the reply
    act_queue: asyncio.Queue
    message: dict
    put_at: float  # when the agent asked (monotonic), for latency
    worker: int = -1
    epoch: int = 0
    calls: list | None = None  # the episode's call log, when it is traced (rlsys/tracing.py)
    refused: asyncio.Future | None = None  # the episode's: set with the reason if a worker refuses a request
    activity: EpisodeActivity | None = None  # the episode's: counts the request until its reply is put


# A rollout worker's figures of its requests in its records (`RouterStats.figures`), which the benchmarks read
RESENT, LATENCY_P50, LATENCY_P99 = "requests/resent", "requests/latency_p50", "requests/latency_p99"


@dataclass
class RouterStats:
    latencies: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))
    resent: int = 0
    refused: int = 0  # malformed replies set aside

    def latency_percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def figures(self) -> dict[str, float]:
        """What a rollout worker logs of its requests: how many it resent, and its replies' latency (the median
        and the 99th percentile)."""
        return {RESENT: self.resent, LATENCY_P50: self.latency_percentile(0.5),
                LATENCY_P99: self.latency_percentile(0.99)}


class EpisodeRouter:
    """One per rollout worker. Start `dispatch_replies` and `watch_workers` as tasks, and one `forward`
    task per episode."""

    def __init__(self, bus, reply_queue: str, n_inference_workers: int, dead_after: float = 3.0):
        self.bus, self.reply_queue = bus, reply_queue
        self.workers = InferenceWorkers(bus, n_inference_workers, dead_after)
        self.waiting: dict[str, PendingRequest] = {}  # request id -> request not yet answered
        self.stats = RouterStats()
        self.server_restarts = ServerRestarts(bus)

    async def serve(self, episode: Awaitable, obs_queue: asyncio.Queue, act_queue: asyncio.Queue,
                    calls: list | None = None, activity: EpisodeActivity | None = None, stuck_after: float = 0.0):
        """Runs `episode` (an agent's `collect_trajectory` over these queues) with its requests forwarded, and
        returns what it returns. A request the router or an inference worker refuses cancels it and raises
        InvalidMessage. With `stuck_after` (and the `activity` its environment counts its calls in), one stuck on
        something of its own (rlsys/workers/episode_activity.py) is cancelled and raises EpisodeFailed("agent_stuck")
        saying where its agent waited."""
        activity = activity or EpisodeActivity()
        refused = asyncio.get_running_loop().create_future()
        forwarder = asyncio.create_task(self.forward(obs_queue, act_queue, calls, refused, activity))
        playing = asyncio.ensure_future(episode)
        watcher = asyncio.create_task(stuck_for(playing, activity, obs_queue, act_queue, stuck_after) if stuck_after
                                      else asyncio.Event().wait())
        try:
            await asyncio.wait([playing, forwarder, refused, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not playing.done():
                if watcher.done():
                    where = "\n".join(awaiting_at(playing))
                    raise EpisodeFailed("agent_stuck", f"the agent {watcher.result()}; it waits at:\n{where}")
                (forwarder if forwarder.done() else refused).result()  # each ends only by raising
            return playing.result()
        finally:
            forwarder.cancel()
            watcher.cancel()
            if refused.done() and not refused.cancelled():
                refused.exception()  # a refusal of a request the episode no longer awaited: retrieved, not logged
            refused.cancel()
            await cancel_and_wait([playing])  # the agent's own cleanup runs before its environment closes
            aborts = self.forget(act_queue)
            if aborts and not asyncio.current_task().cancelling():  # a run that ends stops its workers anyway
                await self.abort(aborts)

    async def forward(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue, calls: list | None = None,
                      refused: asyncio.Future | None = None, activity: EpisodeActivity | None = None) -> None:
        """Sends one episode's requests, all to the worker that took its first, while that worker lives (or to the
        one its last request was re-sent to, when that one died).
        `calls`: if given, each answered request appends when it was sent, how long it took and its sizes.
        Raises InvalidMessage on a request an inference worker would refuse; `refused` gets the reason of one its
        engine refuses. `activity` counts the requests taken until their replies are put in `act_queue`."""
        worker, pending = None, None
        activity = activity or EpisodeActivity()
        while True:
            qid, message = self.checked_request(await obs_queue.get())
            activity.count_request(1)
            put_at = time.monotonic()
            if pending is not None:  # where the last request went: one re-sent took the episode's prefix with it
                worker = pending.worker
            if worker is None or not self.workers.is_alive(worker):
                worker = await self.live_worker()
            pending = self.waiting[message["rid"]] = PendingRequest(qid, act_queue, message, put_at, calls=calls,
                                                                    refused=refused, activity=activity)
            await self.send(pending, worker)

    def checked_request(self, request) -> tuple[str, dict]:
        """The agent's ModelRequest (or the seed's plain `(qid, token_ids, gconfig)`, the same tuple) and the
        message an inference worker takes for it, checked as the worker checks it."""
        if not (isinstance(request, tuple) and len(request) == 3 and isinstance(request[2], GenerationConfig)):
            raise InvalidMessage(f"an episode's request must be a ModelRequest(qid, token_ids, GenerationConfig), "
                                 f"got {request!r:.80}")
        qid, token_ids, gconfig = request
        rid = uuid.uuid4().hex  # agents may reuse a qid across turns; request ids never repeat
        token_ids = list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids
        message = GenerationRequest(rid, token_ids, gconfig, self.reply_queue).to_message()
        try:
            parse_generation_request(message)
        except InvalidMessage as e:
            raise InvalidMessage(f"request {qid!r:.80}: {e}") from None
        return qid, message

    async def live_worker(self) -> int:
        while (worker := self.workers.least_loaded()) is None:
            await asyncio.sleep(REFRESH_INTERVAL)
        return worker

    async def send(self, pending: PendingRequest, worker: int) -> None:
        pending.worker, pending.epoch = worker, self.workers.views[worker].epoch
        self.workers.views[worker].sent_since_refresh += 1
        await asyncio.to_thread(self.bus.put, protocol.generation_requests(worker), pending.message)

    async def dispatch_replies(self) -> None:
        while True:
            for message in await asyncio.to_thread(self.bus.get_many, self.reply_queue, 4096, 0.1,
                                                   protocol.MAX_QUEUE_MESSAGE_BYTES):
                try:
                    if isinstance(message, Undecodable):
                        raise InvalidMessage(message.reason)
                    reply = parse_reply(message)
                except InvalidMessage as e:
                    self.stats.refused += 1
                    await asyncio.to_thread(set_aside, self.bus, self.reply_queue, str(e), message)
                    # The episode that waits for it fails with the reason: a live worker would not send it again (its
                    # model gave NaN logprobs, say). One that names no request waiting here is left at that.
                    rid = message.get("rid") if isinstance(message, dict) else None
                    if isinstance(rid, str) and (pending := self.waiting.pop(rid, None)) is not None:
                        self.fail(pending, f"its reply could not be used: {e}")
                    continue
                pending = self.waiting.pop(reply.rid, None)
                if pending is None:
                    continue  # a duplicate of a re-sent request, or the episode was cancelled
                if isinstance(reply, GenerationRefusal):
                    self.fail(pending, reply.refused)
                    continue
                latency = time.monotonic() - pending.put_at
                self.stats.latencies.append(latency)
                output = reply.output(pending.qid)
                if pending.calls is not None:
                    pending.calls.append({"qid": pending.qid, "sent": time.time() - latency, "seconds": latency,
                                          "worker": pending.worker, "prompt_tokens": len(output.prompt_ids),
                                          "output_tokens": [len(ids) for ids in output.output_ids]})
                pending.act_queue.put_nowait(output)
                if pending.activity is not None:
                    pending.activity.count_request(-1)

    @staticmethod
    def fail(pending: PendingRequest, reason: str) -> None:
        """The episode that asked fails with `reason` instead of waiting for a reply that never comes."""
        if pending.refused is not None and not pending.refused.done():
            pending.refused.set_exception(InvalidMessage(f"request {pending.qid!r:.80}: {reason}"))

    async def watch_workers(self) -> None:
        while True:
            if await asyncio.to_thread(self.look_at_the_bus):
                for pending in self.waiting.values():
                    pending.epoch = UNDELIVERED
            await self.resend_orphans()
            await asyncio.sleep(REFRESH_INTERVAL)

    def look_at_the_bus(self) -> bool:
        """The workers' statuses read again, then whether the bus's server restarted since the last look: both in the
        one thread hop of a pass of `watch_workers`, which makes one every REFRESH_INTERVAL."""
        self.workers.refresh()
        return self.server_restarts.happened()

    async def resend_orphans(self) -> None:
        """Requests whose worker died or restarted, or that a bus restart may have lost, go to their worker
        if it lives, else to the least loaded live one (they wait if there is none). One answered, or whose episode
        ended, while an earlier one was being sent is no longer waiting: sent again, it would be generated for nobody
        (its abort went to the worker that held it)."""
        for rid, pending in list(self.waiting.items()):
            if self.waiting.get(rid) is not pending or self.workers.serves(pending.worker, pending.epoch):
                continue
            worker = pending.worker if self.workers.is_alive(pending.worker) else self.workers.least_loaded()
            if worker is None:
                return
            self.stats.resent += 1
            await self.send(pending, worker)

    def forget(self, act_queue: asyncio.Queue) -> dict[int, list[dict]]:
        """An episode ended: its unanswered requests (if it failed or was cancelled) need no reply. Returns the
        aborts that stop them, by the worker that holds them (`abort`)."""
        aborts: dict[int, list[dict]] = {}
        for rid in [rid for rid, p in self.waiting.items() if p.act_queue is act_queue]:
            pending = self.waiting.pop(rid)
            if pending.worker >= 0:
                aborts.setdefault(pending.worker, []).append(GenerationAbort(rid).to_message())
        return aborts

    async def abort(self, aborts: dict[int, list[dict]]) -> None:
        """The workers stop generating what nobody will take (after the request, on its queue)."""
        for worker, messages in aborts.items():
            await asyncio.to_thread(self.bus.put_many, protocol.generation_requests(worker), messages)
