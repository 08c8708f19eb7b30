"""What the log says of failed episodes. The role's log file keeps each failure in full (INFO); the console, which
hears WARNING and above (rlsys/console.py), gets the first failure of each kind in full (of KINDS_IN_FULL kinds a
reason at most: a detail may name the episode's own values), and then, for a reason's further failures, a count at
most every COUNT_EVERY seconds: a broken reward fails every episode, and a line each would bury the run's progress
lines. A count falls due COUNT_EVERY after its reason was last said, and the worker asks for those due (`say_due`)
each pass of its train loop, while it evaluates and while it waits for the final weights: said only with the reason's
next failure, the last failures of a run whose failures stopped stayed unsaid for as long as it went on."""

import collections
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

COUNT_EVERY = 60.0  # seconds between the console's count lines of one reason
KINDS_IN_FULL = 3  # a reason's kinds of failure the console hears of in full


def kind(detail: str) -> str:
    """A failure's kind: what raised, without the message, which may name the episode's own values
    (`FaultyEnv.step raised ZeroDivisionError`)."""
    return detail.split(": ", 1)[0]


class FailureLog:
    """Failed episodes by reason (`by_reason`), and their log lines; `say_due` says the counts due, `close` those not
    said yet."""

    def __init__(self, log_file: Path, clock=time.monotonic):
        self.log_file, self.clock = log_file, clock
        self.by_reason: collections.Counter[str] = collections.Counter()
        self.kinds_said: dict[str, set[str]] = collections.defaultdict(set)  # reason -> kinds said in full
        self.unsaid: collections.Counter[str] = collections.Counter()  # reason -> failures the console has not heard
        self.said_at: dict[str, float] = {}  # reason -> when the console last heard of it

    def failed(self, qid: str, reason: str, detail: str) -> None:
        self.by_reason[reason] += 1
        said = self.kinds_said[reason]
        first = kind(detail) not in said and len(said) < KINDS_IN_FULL
        log.log(logging.WARNING if first else logging.INFO, "episode %s failed (%s): %s", qid, reason, detail)
        if first:
            said.add(kind(detail))
            self.said_at[reason] = self.clock()
            return
        self.unsaid[reason] += 1
        self.say_due()

    def say_due(self) -> None:
        """Says the count of each reason with failures unsaid whose last line is COUNT_EVERY old."""
        now = self.clock()
        for reason, n in self.unsaid.items():
            if n and now - self.said_at[reason] >= COUNT_EVERY:
                self.say_count(reason)

    def say_count(self, reason: str) -> None:
        log.warning("%d more episodes failed (%s), %d in all: see %s", self.unsaid[reason], reason,
                    self.by_reason[reason], self.log_file)
        self.unsaid[reason] = 0
        self.said_at[reason] = self.clock()

    def close(self) -> None:
        for reason, n in self.unsaid.items():
            if n:
                self.say_count(reason)
