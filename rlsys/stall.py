"""A run that can no longer make progress says why and stops, instead of waiting in silence.

Between the initial evaluation and the learner's last step, prompts must keep moving. With no prompt being
generated (every admitted prompt not yet trained already delivered, fewer than a batch, so the learner waits),
none admitted and no new version published, nothing in the run can change that: the learner waits for groups that
nobody is generating, and the rollout workers wait for a gate that only a trained step opens. Held for
`cluster.stall_timeout` seconds, that state stops the run with what the gate and the counters say. Prompts being
generated are not a stall here: a hanging environment, agent or model call is ended by its own timeout and counted.
What is being generated is what the rollout workers say they run (each publishes its count of running episodes),
not what the ledger holds in flight: a prompt in flight that no episode runs would otherwise pass for one being
generated and keep a run waiting in silence; here it stops the run, which names them lost. Each count comes with a
beat, new at each publication (every protocol.ROLLOUT_BEAT_INTERVAL s): a worker whose beat has not changed for
BEAT_LOST_AFTER seconds has an event loop that a plugin blocks (a synchronous call in an async function), and its
episodes, which cannot end, count as none being generated; the error names that worker.
Nor is a run whose inference workers are still starting (after a restart, vLLM's start takes about a minute on a
CPU): the clock runs only while every one of them serves; nor one whose rollout workers are (their environments'
warm-up may load a model; worker 0 evaluates first): only once every one of them says it trains. A rollout worker
beats from its start, saying it is starting: one whose beat stands still for `cluster.stall_timeout` before it trains
has an event loop that a plugin blocks in its warm-up or the first evaluation, which then cannot end; that stops the
run, naming the worker.
"""

import time

from rlsys import protocol
from rlsys.api.messages import RolloutRunning, parse_rollout_running
from rlsys.bus.dead_letters import read_beat
from rlsys.evaluations import initial_evaluation_ended
from rlsys.prompt_ledger import ADMITTED, PromptLedger, describe
from rlsys.errors import RoleFailed
from rlsys.workers.inference_status import InferenceStatus

# A live rollout worker publishes a new beat every ROLLOUT_BEAT_INTERVAL; ten missed ones are no slow machine's hiccup
# (and the run must then still stand still for cluster.stall_timeout to stop).
BEAT_LOST_AFTER = 10 * protocol.ROLLOUT_BEAT_INTERVAL
BLOCKING_CALL = ("An agent or environment calls something that blocks (time.sleep, a synchronous HTTP request, a long "
                 "computation) in an async function: await an async version, or write the environment method or "
                 "tool call that blocks as a plain def, which runs on a thread of its own under its time limit")


class RunStalled(RoleFailed):
    """Nothing in flight, nothing admitted, no new weights: the run would wait forever."""


class StallWatch:
    """Called every supervisor poll; raises RunStalled once the run has stood still for `timeout` seconds (0: never)."""

    def __init__(self, config, ledger: PromptLedger, clock=time.monotonic):
        self.timeout, self.ledger = config.cluster.stall_timeout, ledger
        self.n_inference_workers = config.cluster.n_inference_workers
        self.n_rollout_workers = config.cluster.n_rollout_workers
        self.clock = clock
        self.state: tuple | None = None
        self.since = 0.0
        self.beats: dict[int, tuple[object, float]] = {}  # rollout worker -> (its last beat, when it was first seen)

    def check(self, bus) -> None:
        if not self.timeout:
            return
        now = self.clock()
        # None where a rollout worker has not said yet: it is starting (the launcher deletes the count of one that
        # died, and every count when the roles start again after the learner's death, while the initial evaluation,
        # which tells a start from the rest, is kept)
        published = [self.running_of(bus, i) for i in range(self.n_rollout_workers)]
        silent = self.silent_for(published, now)
        starting = {i for i, p in enumerate(published) if p is None or p.starting}
        if blocked := {i: seconds for i, seconds in silent.items()
                       if i in starting and seconds >= max(self.timeout, BEAT_LOST_AFTER)}:
            raise RunStalled(self.explain_blocked_start(blocked))
        if (not initial_evaluation_ended(bus) or bus.get(protocol.LEARNER_DONE) is not None
                or self.ledger.closed() or not self.inference_serves(bus) or starting):
            # starting, (re)starting a role, or past the last step: the final save and evaluation are no stall
            self.state = None
            return
        counts = self.ledger.counts()
        weights = bus.get(protocol.WEIGHTS)
        version = weights.get("version") if isinstance(weights, dict) else None
        delivered = bus.stream_length(protocol.TRAJECTORIES)  # one entry a prompt, until the learner trains it
        # a count a blocked loop left behind: its episodes will never end (they are named below, not lost)
        blocked = {i: (published[i].running, seconds) for i, seconds in silent.items() if seconds >= BEAT_LOST_AFTER}
        running = sum(p.running for i, p in enumerate(published) if i not in blocked)
        # A learner that holds a batch's worth is training it (a step of a large model on a CPU takes minutes).
        moving = running > 0 or delivered >= self.ledger.batch_size
        state = (counts[ADMITTED], version, delivered)
        if moving or state != self.state:
            self.state, self.since = (None if moving else state), now
            return
        if now - self.since >= self.timeout:
            carried = self.ledger.carried()  # in flight, run by no episode until admitted again: not lost
            lost = counts["in_flight"] - carried - delivered - sum(n for n, _ in blocked.values())
            behind = {index: status.version for index, status in enumerate(self.statuses(bus))
                      if version is not None and status is not None and status.version < version}
            raise RunStalled(self.explain(counts, version, self.ledger.slots_taken(), delivered, lost, carried, behind)
                             + self.explain_blocked(blocked))

    @staticmethod
    def running_of(bus, index: int) -> RolloutRunning | None:
        """What rollout worker `index` published last; None if nothing, or something malformed (set aside with its
        reason, and deleted: the worker's next beat writes a good one)."""
        return read_beat(bus, protocol.rollout_running(index), parse_rollout_running)

    def silent_for(self, published: list[RolloutRunning | None], now: float) -> dict[int, float]:
        """{rollout worker: seconds since its beat last changed} of each that published one."""
        for index, value in enumerate(published):
            if value is None:
                self.beats.pop(index, None)
            elif self.beats.get(index, (None,))[0] != value.beat:
                self.beats[index] = (value.beat, now)
        return {index: now - seen for index, (_, seen) in self.beats.items()}

    @staticmethod
    def explain_blocked(blocked: dict[int, tuple[int, float]]) -> str:
        return "".join(
            f". Rollout worker {index} has not published its count for {seconds:.0f} s, with {running} episodes "
            f"running: its event loop is blocked, so none of them can end. {BLOCKING_CALL}"
            for index, (running, seconds) in blocked.items())

    @staticmethod
    def explain_blocked_start(blocked: dict[int, float]) -> str:
        return ". ".join(
            f"Rollout worker {index} has not published its count for {seconds:.0f} s while starting: its event loop "
            f"is blocked, so its environments' warm-up{' or the initial evaluation' if index == 0 else ''} cannot "
            f"end (cluster.stall_timeout). {BLOCKING_CALL}" for index, seconds in blocked.items())

    def statuses(self, bus) -> list:
        return [InferenceStatus(bus, index).read() for index in range(self.n_inference_workers)]

    def inference_serves(self, bus) -> bool:
        """Every inference worker has published a status and the launcher has not seen its process exit."""
        return all(status is not None and not status.dead for status in self.statuses(bus))

    def explain(self, counts: dict, version, gate, delivered: int, lost: int, carried: int,
                behind: dict[int, int]) -> str:
        lost_line = (f" {lost} of the prompts in flight are neither delivered nor run by any rollout worker: they were "
                     "lost (a defect of rlsys or of a plugin that ended an episode's task; please report it)."
                     if lost > 0 else "")
        carried_line = (f" {carried} of the prompts in flight were in flight at the checkpoint the run resumed from: "
                        "they run once a rollout worker admits them again, as its place in the dataset reaches them."
                        if carried else "")
        # A load of a model larger than the timeout allows looks the same from here (the worker's beat goes on while
        # it loads): the gate waits for it, and nothing else moves. Say so rather than leave the user to guess.
        behind_line = (" Inference workers still serving an older version: " + ", ".join(
            f"{index} ({served})" for index, served in behind.items()) + f"; if loading version {version} takes them "
            f"longer than {self.timeout:.0f} s (a large model), raise cluster.stall_timeout." if behind else "")
        return (f"the run stood still for {self.timeout:.0f} s (cluster.stall_timeout): no prompt being generated, "
                f"none admitted, no new weights (last published version: "
                f"{version if version is not None else 'none'}). The learner holds {delivered} groups and waits for "
                f"{self.ledger.batch_size} that nobody is generating.{lost_line}{carried_line} The staleness gate "
                f"holds {gate} prompts against a limit of (version served + {self.ledger.max_head_offpolicyness} + 1)"
                f" x {self.ledger.batch_size}; "
                f"{describe(counts)}.{behind_line} The rollout workers' logs say why they admit nothing")
