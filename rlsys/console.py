"""The console a person reads: the run's progress lines (ProgressReporter), and quiet roles. A role process's own
output (and its libraries': vLLM's per-reload progress bars and warnings, transformers' notices, anything a C
extension or child process writes) goes to its log file in the run directory; only rlsys warnings and errors, which
may need the user, still reach the console."""

import contextlib
import faulthandler
import logging
import os
import sys
import time
from pathlib import Path

import redis

from rlsys.evaluations import (ACCURACY, EPISODES, FAILED, REWARD_OF_ENDED, VERSION, VERSION_MAX, figures, headline,
                               initial_evaluation_ended)
from rlsys.learner_figures import BATCH_REWARD, COMPUTE, STALENESS_MEAN, WAIT_DATA
from rlsys.metrics import STEP, JsonlFollower
from rlsys.prompt_ledger import TRAINED, PromptLedger
from rlsys.run_privacy import append_private


def role_output_to_file(log_file: Path, role: str) -> None:
    """File descriptors 1 and 2 point at `log_file` from now on, so the process's children inherit it too;
    rlsys' loggers still write WARNING and above to the console the process was started with. A process killed by a
    fatal signal (a native abort or segfault) leaves every thread's Python stack there, so the log says where."""
    console = os.fdopen(os.dup(2), "w", buffering=1)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = append_private(log_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    to_console = logging.StreamHandler(console)
    to_console.setLevel(logging.WARNING)
    to_console.setFormatter(logging.Formatter(f"{role} %(levelname)s %(message)s"))
    logging.getLogger("rlsys").addHandler(to_console)


# an evaluation's figures (`headline`), as said
HELD_OUT_NAMES = {ACCURACY: "accuracy", REWARD_OF_ENDED: "mean reward of the episodes that ended"}


def held_out(summary: dict) -> tuple[str, float | None, float | None]:
    """A run's held-out figure (an evaluation's ACCURACY or REWARD_OF_ENDED), before and after: its accuracy, or,
    where its episodes have no success to count (rewards from a reward model), the mean reward of those that ended.
    None where the run did not evaluate."""
    tags = ("initial", "final")  # the summary's keys: rlsys/run_summary.py
    figure = ACCURACY if any(summary.get(f"{tag}_{ACCURACY}") is not None for tag in tags) \
        or all(summary.get(f"{tag}_{REWARD_OF_ENDED}") is None for tag in tags) else REWARD_OF_ENDED
    return figure, summary.get(f"initial_{figure}"), summary.get(f"final_{figure}")


def held_out_text(figure: str, value: float | None) -> str:
    """The value of an evaluation's `figure` (ACCURACY or REWARD_OF_ENDED) as the console and the report show it."""
    return "n/a" if value is None else f"{value:.1%}" if figure == ACCURACY else f"{value:.3f}"


def held_out_line(summary: dict) -> str:
    """A run's last word on what it learned. A resumed run's minutes are its last launch's, while its steps and its
    change count from the run's start: the line says so. A warm start's minutes are said apart from the run's, and
    held-out episodes that failed, where any did."""
    figure, before, after = held_out(summary)
    change = "" if before is None or after is None else \
        f" ({100 * (after - before):+.1f} points)" if figure == ACCURACY else f" ({after - before:+.3f})"
    since = f" since its resume at step {summary['resumed']['step']}" if summary.get("resumed") else ""
    warm_start = summary.get("warm_start_minutes")
    after_warm_start = f", after a {warm_start:.1f} min warm start" if warm_start else ""
    failed = [summary.get(key) or 0 for key in ("initial_failed", "final_failed")]
    counted = "counted unsolved" if figure == ACCURACY else "left out of the mean"
    failures = f"; held-out episodes failed: {failed[0]} before, {failed[1]} after ({counted})" if any(failed) else ""
    steps = f"{summary['steps']} step{'' if summary['steps'] == 1 else 's'}"
    return (f"held-out {HELD_OUT_NAMES[figure]}: {held_out_text(figure, before)} before, "
            f"{held_out_text(figure, after)} after {steps}{change} in {summary['minutes']:.1f} min"
            f"{since}{after_warm_start}{failures}")


class ProgressReporter:
    """Prints a line every `logging_steps` learner steps, read from the learner's metrics file, and one for each
    held-out evaluation between the first and the last, read from `evaluations_file` (rollout worker 0's metrics,
    where its evaluations are written); and, while no line comes for `quiet_seconds` (vLLM starting, the first
    evaluation, a slow step), one that says what the run is waiting for, so that a long step does not look hung.
    A run resumed from a checkpoint (`resumed`: its step and weight version) says nothing of the steps and evaluations
    before it, which the files still hold: the launch that ran them said them."""

    def __init__(self, metrics_file: Path, every: int, max_steps: int, bus=None, ledger: PromptLedger | None = None,
                 quiet_seconds: float = 20.0, evaluations_file: Path | None = None, resumed: tuple[int, int] = (0, 0)):
        self.every, self.max_steps = max(every, 1), max_steps
        self.bus, self.ledger, self.quiet_seconds = bus, ledger, quiet_seconds
        self.steps = JsonlFollower(metrics_file)
        self.evaluations = JsonlFollower(evaluations_file) if evaluations_file is not None else None
        # the last learner step and evaluated version read; resumed, the evaluation of the checkpoint's weights is new
        self.step_seen, self.evaluation_seen = resumed[0], max(resumed[1] - 1, 0)
        self.started = time.monotonic()
        self.last_line = self.started

    def __call__(self) -> None:
        for row in self.steps():
            if row[STEP] <= self.step_seen:  # a step a resume took back and trains again was said already
                continue
            self.step_seen = row[STEP]
            if row[STEP] % self.every == 0 or row[STEP] == self.max_steps:
                self.print(f"step {row[STEP]:>5}/{self.max_steps}  reward {row[BATCH_REWARD]:.3f}  "
                           f"staleness {row[STALENESS_MEAN]:.2f}  wait {row[WAIT_DATA]:.2f}s  "
                           f"update {row[COMPUTE]:.2f}s")
        for evaluation in self.new_evaluations():
            figure = headline(evaluation)
            failed = evaluation.get(FAILED, 0)  # counted in the accuracy, as unsolved
            # an evaluation runs beside training: weights it began with may be replaced before it ends
            versions = (f", versions {evaluation[VERSION]}-{evaluation[VERSION_MAX]}"
                        if VERSION_MAX in evaluation else "")
            self.print(f"step {evaluation[VERSION]:>5}/{self.max_steps}  held-out {HELD_OUT_NAMES[figure]} "
                       f"{held_out_text(figure, evaluation[figure])} "
                       f"(greedy, {evaluation[EPISODES] + failed} problems"
                       + (f", {failed} failed" if failed else "") + versions + ")")
        if self.bus is not None and time.monotonic() - self.last_line >= self.quiet_seconds:
            with contextlib.suppress(redis.ConnectionError):  # our server restarting: the supervisor sees to it
                self.print(self.waiting_line())

    def new_evaluations(self) -> list[dict]:
        """Evaluations after the first and before the last (the run's summary gives those two) not printed yet, as
        `figures` names them."""
        if self.evaluations is None:
            return []
        new = [evaluation for evaluation in map(figures, self.evaluations())
               if VERSION in evaluation and self.evaluation_seen < evaluation[VERSION] < self.max_steps]
        self.evaluation_seen = max([self.evaluation_seen] + [evaluation[VERSION] for evaluation in new])
        return new

    def waiting_line(self) -> str:
        elapsed = f"{time.monotonic() - self.started:.0f}s in"
        if self.step_seen >= self.max_steps:
            return f"{elapsed}: training done, final held-out evaluation"
        if not initial_evaluation_ended(self.bus):
            return f"{elapsed}: starting the roles and the initial held-out evaluation"
        c = self.ledger.counts()
        return (f"{elapsed}: step {self.step_seen + 1}/{self.max_steps} collecting episodes: {c['in_flight']} prompts "
                f"in flight, {c[TRAINED]} trained so far")

    def print(self, line: str) -> None:
        print(line, flush=True)
        self.last_line = time.monotonic()
