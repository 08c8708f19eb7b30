"""Per-step metrics to TensorBoard and a JSONL file (one object per line, easy to test and plot).

The file is strict JSON, which `jq` and every JSON parser read: a metric that is not a finite number (a NaN loss, an
infinite logprob difference) is written as the string "NaN", "Infinity" or "-Infinity", the names Python's json
gives them bare, and `read_jsonl_metrics` and `JsonlFollower` read those strings back as the floats.

The event files are written with TensorBoard's own writer, the one torch's SummaryWriter wraps: a rollout worker
logs metrics too, and importing torch for its SummaryWriter would cost it a second of CPU while the other roles start.
"""

import json
import math
import os
import time
from pathlib import Path

from rlsys.run_privacy import PRIVATE_UMASK, append_private, write_private


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict_json(value):
    """`value` as strict JSON takes it: a non-finite float, also in the dicts and lists it holds, as its name in
    NON_FINITE (the trace files' records nest theirs)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def number(value):
    """A number as strict_json wrote it, a float again: its readers call it only where a number stands, since a
    text may be "NaN" itself."""
    return NON_FINITE.get(value, value) if isinstance(value, str) else value


def parse_record(line: str | bytes) -> dict:
    """One line of a metrics file, its non-finite numbers floats again (files from before they were strings wrote
    them bare, which Python's json reads too)."""
    return {key: number(value) for key, value in json.loads(line).items()}


LEARNER_RECORDS = "learner"  # the learner's records: <logging dir>/learner.jsonl and tensorboard/learner
ROLLOUT_RECORDS = "rollout"  # rollout worker i's: rollout<i>.jsonl and tensorboard/rollout<i>
# What every row of the records holds beside the figures logged: the step it was logged at, and when (seconds since
# the epoch)
STEP = "step"
LOGGED_AT = "time"


def rollout_records(index: int) -> str:
    return f"{ROLLOUT_RECORDS}{index}"


def records_file(log_dir: Path, name: str) -> Path:
    """Where MetricsLogger(log_dir, name) appends: the name the launcher's resume, the report and MLflow read."""
    return Path(log_dir) / f"{name}.jsonl"


def rollout_records_files(log_dir: Path) -> list[Path]:
    """Every rollout worker's records file in `log_dir`, in order of name."""
    return sorted(Path(log_dir).glob(f"{ROLLOUT_RECORDS}*.jsonl"))


class MetricsLogger:
    def __init__(self, log_dir: Path, name: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = os.fdopen(append_private(records_file(self.log_dir, name)), "a", buffering=1)
        self.writer = EventFileWriter(str(self.log_dir / "tensorboard" / name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {STEP: step, LOGGED_AT: time.time(), **strict_json(metrics)}
        self.jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        scalars = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=scalars)))

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def read_jsonl_metrics(path: Path) -> list[dict]:
    return [parse_record(line) for line in Path(path).read_text().splitlines() if line.strip()]


class JsonlFollower:
    """Each call returns the records appended to a JSON-lines file since the last, so that following a run's file
    costs what its new lines cost, not what the whole file does (read every poll, that grows with the run's steps).
    Whole lines only: one its writer is still writing is returned by the next call. A file replaced or cut shorter
    (a resume takes back the steps after its checkpoint) is read again from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode = Path(path), 0, None

    def __call__(self) -> list[dict]:
        try:
            file = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with file:
            stat = os.fstat(file.fileno())
            if stat.st_ino != self.inode or stat.st_size < self.offset:
                self.inode, self.offset = stat.st_ino, 0
            file.seek(self.offset)
            data = file.read()
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return [parse_record(line) for line in whole.splitlines() if line.strip()]


ABANDONED = ".abandoned"  # <file>.jsonl.abandoned: the records a resume took back, kept apart for a post-mortem


def drop_records_after(path: Path, last_step: int) -> int:
    """A run resumed from a checkpoint trains the steps after it again: the records of the JSONL file at `path`
    (learner.jsonl, rollout0.jsonl, traces/trained.jsonl) with a step after `last_step`, written before the resume,
    are moved to `<path>.abandoned`. Returns how many. Only while nothing writes the file (the launcher, before the
    roles start)."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line)[STEP]
        except (ValueError, KeyError, TypeError):  # a line a kill cut short
            dropped.append(line if line.endswith("\n") else line + "\n")
            continue
        (dropped if step > last_step else kept).append(line)
    if dropped:
        with os.fdopen(append_private(path.with_name(path.name + ABANDONED)), "a") as abandoned:
            abandoned.writelines(dropped)
        write_private(path, "".join(kept))
    return len(dropped)


def mark_restart(log_dir: Path, name: str, step: int) -> None:
    """Tells TensorBoard that `name`'s events start again at `step` (a SessionLog START, as TensorFlow's resumed
    runs write): it then drops the events of that step and later that it read before, the abandoned steps'."""
    events = Path(log_dir) / "tensorboard" / name
    if not events.is_dir():
        return
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    umask = os.umask(PRIVATE_UMASK)  # the launcher's own is the user's; the roles' files are owner-only
    try:
        writer = EventFileWriter(str(events), filename_suffix=".resumed")
        writer.add_event(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        writer.close()
    finally:
        os.umask(umask)
