"""The inference worker: keeps its engine full with the requests routed to it, and serves the newest weights.

Continuous batching: between two engine steps the worker takes whatever requests arrived and adds them
to the running batch, so a request never waits for another to finish. Weight updates interrupt the batch
(see GenerationEngine.update_weights). A heartbeat thread publishes the worker's status (epoch, a beat
counter, the version it serves, its load) so that routers can pick the least loaded worker, notice a dead
one and re-send its requests elsewhere.
"""

import logging
import threading
import time

from rlsys import protocol, run_counters
from rlsys.alarms import probe_totals
from rlsys.api.messages import MAX_REASON_CHARS, GenerationAbort, GenerationRefusal, InvalidMessage, WorkerStatus, \
    parse_published_weights, parse_worker_request, string
from rlsys.bus import Undecodable
from rlsys.bus.dead_letters import set_aside
from rlsys.engine.generation import GenerationEngine
from rlsys.weight_checksum import WeightChecksumMismatch
from rlsys.weight_transport import Received, WeightReceiver, given_checksum
from rlsys.workers.inference_status import InferenceStatus

log = logging.getLogger(__name__)

IDLE_WAIT = 0.02  # seconds an idle worker blocks on its queue before checking for weights and stop again
CONTROL_INTERVAL = 0.1  # while busy, how often the worker checks for new weights and the stop flag (each check
# is two round trips on the engine's own thread; a learner step takes far longer than this). An idle worker
# checks after every IDLE_WAIT: in the synchronous setting the next batch waits on it.


class InferenceWorker:
    def __init__(self, engine: GenerationEngine, bus, index: int, max_batch_requests: int,
                 weights: WeightReceiver | None = None):
        self.engine, self.bus, self.index = engine, bus, index
        # An engine that lists the tensors it holds has those checked: the bytes that arrive need no checksum.
        self.weights = weights or WeightReceiver(checksum_arrived=engine.backend.loaded_weights() is None,
                                                 pinned=engine.backend.loads_from_pinned_memory)
        self.max_batch_requests = max_batch_requests
        self.reply_to: dict[str, str] = {}  # request id -> the router's reply queue
        self.queue = protocol.generation_requests(index)
        self.status = InferenceStatus(bus, index)
        self.refused = 0  # requests set aside as malformed
        self.refused_announcement = None  # the weight announcement last set aside as malformed
        self.epoch = 0
        self.copies_dropped = 0  # requests that arrived again while running
        self.aborted = 0  # requests stopped unfinished: their episode ended without them
        self._stopping = threading.Event()
        self._next_control = 0.0
        self.beat = 0  # the heartbeat's counter
        # The version the status announces: the engine's once a load is whole and checked. While one loads, the
        # engine's own is already the new one, which the load may yet back out of (a transfer that broke off).
        self.served_version = engine.version
        self._status_lock = threading.Lock()

    def run(self) -> None:
        self.load_newest_weights()
        # A resumed run's worker goes live once it serves the checkpoint's version: its engine starts from model.path's
        # weights, and the evaluation at the resumed step and the first rollouts run on the first worker live.
        resumed = self.bus.get(protocol.RESUMED_VERSION) or 0
        while self.engine.version < resumed:
            if self.bus.get(protocol.STOP):
                return
            time.sleep(IDLE_WAIT)
            self.load_newest_weights()
        self.start_epoch()
        heartbeat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        heartbeat.start()
        try:
            while not self._control(idle=not self.engine.in_flight):
                self.take_requests(timeout=0.0 if self.engine.in_flight else IDLE_WAIT)
                if self.engine.in_flight:
                    self.reply(self.engine.step())
        finally:
            self._stopping.set()
            heartbeat.join()

    def start_epoch(self) -> None:
        """A new process on this index: whatever a dead predecessor left queued is re-sent by the routers."""
        self.bus.delete(self.queue)
        self.epoch = self.bus.incr(protocol.inference_epoch(self.index))
        self.publish_status()
        log.info("inference worker %d ready (epoch %d, version %d)", self.index, self.epoch, self.engine.version)

    def _control(self, idle: bool) -> bool:
        """Every CONTROL_INTERVAL, or whenever idle: load new weights; True once the run is stopping."""
        now = time.monotonic()
        if now < self._next_control and not idle:
            return False
        self._next_control = now + CONTROL_INTERVAL
        if self.bus.get(protocol.STOP):
            return True
        self.load_newest_weights()
        return False

    def load_newest_weights(self) -> None:
        message = self.bus.get(protocol.WEIGHTS)
        if message is None or message == self.refused_announcement:
            return
        try:
            published = parse_published_weights(message)
        except InvalidMessage as e:
            set_aside(self.bus, protocol.WEIGHTS, str(e), message)
            # Set aside once and left for the learner's next version to replace: deleting it here could delete that
            # one, published between this read and the delete.
            self.refused_announcement = message
            return
        if published.version > self.engine.version:
            received = self.weights.receive(published, as_they_arrive=self.engine.backend.loads_as_they_arrive)
            if received is None or received.version <= self.engine.version:
                return
            # The probe is the learner's logprobs under an older version: scored if that is the one served so far.
            before = self.engine.version
            probe = published.probe_ids if published.probe_version == before else ()
            interrupted, scored = self.engine.update_weights(received.weights, received.version, probe)
            whole = self.weights.settle(received)
            if whole is None:  # it broke off mid-load: the engine holds a mix of two versions
                held = self.weights.held
                self.engine.update_weights(held.weights, held.version)
                self.verify_weights(held)
                self.served_version = held.version
                log.warning("version %d broke off while loading; version %d loaded again", received.version,
                            held.version)
                return
            self.verify_weights(whole)
            # Once the version is in: a load that breaks off goes back to the same weights, and its retry scores the
            # probe again; reported at both, its tokens would count twice in the learner's alarms/probe_*.
            if scored:
                self.bus.put(protocol.LOGPROB_PROBES, {"worker": self.index, "version": before,
                                                       "totals": probe_totals(published.probe_logprobs, scored)})
            self.served_version = whole.version
            # Now, not at the next beat: the staleness gate admits the next prompts on the version served. Not
            # before start_epoch (the first load of a restarted worker): its status would carry no epoch.
            if self.epoch:
                self.publish_status()
            log.info("version %d loaded%s", self.engine.version,
                     f"; {interrupted} samples resumed under it" if interrupted else "")

    def verify_weights(self, received: Received) -> None:
        """After every update: the checksum of what the engine holds (or, for an engine that cannot list its own,
        of what it was given) equals the learner's, or the run stops."""
        if not received.checksum:  # a publisher that sends none (tests of other parts)
            return
        loaded = given_checksum(received, self.engine.backend.loaded_weights())
        if loaded != received.checksum:
            raise WeightChecksumMismatch(f"inference worker {self.index}", received.version, received.checksum,
                                         loaded)
        run_counters.count_weight_check(self.bus)

    def take_requests(self, timeout: float) -> None:
        copies = 0
        messages = self.bus.get_many(self.queue, self.max_batch_requests, timeout, protocol.MAX_QUEUE_MESSAGE_BYTES)
        for message in messages:
            try:
                if isinstance(message, Undecodable):
                    raise InvalidMessage(message.reason)
                request = parse_worker_request(message)
            except InvalidMessage as e:
                self.refused += 1
                set_aside(self.bus, self.queue, str(e), message)
                self.answer_unread(message, f"inference worker {self.index} could not read it: {e}")
                continue
            if isinstance(request, GenerationAbort):  # a no-op for one already answered, or never taken
                self.aborted += self.engine.is_running(request.rid)
                self.engine.abort_request(request.rid)
                self.reply_to.pop(request.rid, None)
                continue
            if self.engine.is_running(request.rid):  # a router sent it again after a bus server restart
                copies += 1
                continue
            try:
                self.engine.add_request(request.rid, request.token_ids, request.gconfig)
            except ValueError as e:  # what only the engine can check: the vocabulary, the model's length
                self.engine.abort_request(request.rid)
                self.refused += 1
                set_aside(self.bus, self.queue, f"the engine refused request {request.rid}: {e}", message)
                # the episode that asked fails with the reason rather than waiting for a reply that never comes
                reason = f"the engine of inference worker {self.index} refused it: {e}"[:MAX_REASON_CHARS]
                self.bus.put(request.reply_to, GenerationRefusal(request.rid, reason).to_message())
                continue
            self.reply_to[request.rid] = request.reply_to
        if copies:
            self.copies_dropped += copies
            log.info("dropped %d copies of requests already running", copies)

    def answer_unread(self, message, fault: str) -> None:
        """A request that decoded but is none this worker reads (from a role of another version, or a plugin's own
        writer) fails its episode at once with `fault`, where its id and reply queue can be read: else the episode
        waits for its timeout. Undecodable bytes (not msgpack, over the size limit) hold both inside the body, which
        a second encoding of each message, beside it, would be needed to read."""
        if not isinstance(message, dict):
            return
        try:
            rid, reply_to = string(message.get("rid"), "rid"), string(message.get("reply_to"), "reply_to")
        except InvalidMessage:
            return
        self.bus.put(reply_to, GenerationRefusal(rid, fault[:MAX_REASON_CHARS]).to_message())

    def reply(self, replies) -> None:
        by_queue: dict[str, list[dict]] = {}
        for reply in replies:
            by_queue.setdefault(self.reply_to.pop(reply.rid), []).append(reply.to_message())
        for queue, messages in by_queue.items():
            self.bus.put_many(queue, messages)

    def publish_status(self) -> None:
        # The heartbeat thread and a weight update both publish; the version is read under the lock, so the
        # last write holds the newest version.
        with self._status_lock:
            self.status.publish(WorkerStatus(self.epoch, self.beat, self.served_version, self.engine.in_flight,
                                             weights_streamed=self.weights.received_streamed))

    def _heartbeat(self) -> None:
        """On its own thread, so a long engine step never makes a live worker look dead."""
        while not self._stopping.wait(protocol.HEARTBEAT_INTERVAL):
            self.beat += 1
            try:
                self.publish_status()
            except Exception:  # the bus may be briefly unreachable; the next beat tries again
                log.warning("heartbeat failed", exc_info=True)
