"""A run that can no longer make progress says why and stops, instead of waiting in silence.

Between the initial evaluation and the learner's last step, prompts must keep moving. With no prompt being
generated (every admitted prompt not yet trained already delivered, fewer than a batch, so the learner waits),
none admitted and no new version published, nothing in the run can change that: the learner waits for groups that
nobody is generating, and the rollout workers wait for a gate that only a trained step opens. Held for
`cluster.stall_timeout` seconds, that state stops the run with what the gate and the counters say. Prompts being
generated are not a stall here: a hanging environment, agent or model call is ended by its own timeout and counted.
What is being generated is what the rollout workers say they run (each publishes its count of running episodes),
not what the ledger holds in flight: a prompt in flight that no episode runs would otherwise pass for one being
generated and keep a run waiting in silence; here it stops the run, which names them lost.
Nor is a run whose inference workers are still starting (after a restart, vLLM's start takes about a minute on a
CPU): the clock runs only while every one of them serves; nor one whose rollout workers are (their environments'
warm-up may load a model): only while every one of them has said what it runs since it started.
"""

import time

from rlsys import protocol
from rlsys.prompt_ledger import ADMITTED, PromptLedger, describe
from rlsys.errors import RoleFailed
from rlsys.workers.inference_status import InferenceStatus


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

    def check(self, bus) -> None:
        if not self.timeout:
            return
        now = self.clock()
        # None where a rollout worker has not said yet: it is starting (the launcher deletes the count of one that
        # died, and every count when the roles start again after the learner's death, while the initial evaluation,
        # which tells a start from the rest, is kept)
        running = [bus.get(protocol.rollout_running(i)) for i in range(self.n_rollout_workers)]
        if (not bus.get(protocol.eval_result("initial")) or bus.get(protocol.LEARNER_DONE) is not None
                or not self.inference_serves(bus) or None in running):
            self.state = None  # starting, (re)starting a role, or past the last step: the final evaluation is no stall
            return
        counts = self.ledger.counts()
        weights = bus.get(protocol.WEIGHTS)
        version = weights.get("version") if isinstance(weights, dict) else None
        delivered = bus.stream_length(protocol.TRAJECTORIES)  # one entry a prompt, until the learner trains it
        running = sum(running)
        # A learner that holds a batch's worth is training it (a step of a large model on a CPU takes minutes).
        moving = running > 0 or delivered >= self.ledger.batch_size
        state = (counts[ADMITTED], version, delivered)
        if moving or state != self.state:
            self.state, self.since = (None if moving else state), now
            return
        if now - self.since >= self.timeout:
            lost = counts["in_flight"] - delivered
            behind = {index: status.version for index, status in enumerate(self.statuses(bus))
                      if version is not None and status is not None and status.version < version}
            raise RunStalled(self.explain(counts, version, self.ledger.slots_taken(), delivered, lost, behind))

    def statuses(self, bus) -> list:
        return [InferenceStatus(bus, index).read() for index in range(self.n_inference_workers)]

    def inference_serves(self, bus) -> bool:
        """Every inference worker has published a status and the launcher has not seen its process exit."""
        return all(status is not None and not status.dead for status in self.statuses(bus))

    def explain(self, counts: dict, version, gate, delivered: int, lost: int, behind: dict[int, int]) -> str:
        lost_line = (f" {lost} of the prompts in flight are neither delivered nor run by any rollout worker: they were "
                     "lost (a defect of rlsys or of a plugin that ended an episode's task; please report it)."
                     if lost > 0 else "")
        # A load of a model larger than the timeout allows looks the same from here (the worker's beat goes on while
        # it loads): the gate waits for it, and nothing else moves. Say so rather than leave the user to guess.
        behind_line = (" Inference workers still serving an older version: " + ", ".join(
            f"{index} ({served})" for index, served in behind.items()) + f"; if loading version {version} takes them "
            f"longer than {self.timeout:.0f} s (a large model), raise cluster.stall_timeout." if behind else "")
        return (f"the run stood still for {self.timeout:.0f} s (cluster.stall_timeout): no prompt being generated, "
                f"none admitted, no new weights (last published version: "
                f"{version if version is not None else 'none'}). The learner holds {delivered} groups and waits for "
                f"{self.ledger.batch_size} that nobody is generating.{lost_line} The staleness gate holds "
                f"{gate} prompts against a limit of (version served + {self.ledger.max_head_offpolicyness} + 1) x "
                f"{self.ledger.batch_size}; "
                f"{describe(counts)}.{behind_line} The rollout workers' logs say why they admit nothing")
