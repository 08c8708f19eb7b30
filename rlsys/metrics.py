"""Per-step metrics to TensorBoard and a JSONL file (one object per line, easy to test and plot).

The event files are written with TensorBoard's own writer, the one torch's SummaryWriter wraps: a rollout worker
logs metrics too, and importing torch for its SummaryWriter would cost it a second of CPU while the other roles start.
"""

import json
import os
import time
from pathlib import Path

from rlsys.run_privacy import append_private


class MetricsLogger:
    def __init__(self, log_dir: Path, name: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = os.fdopen(append_private(self.log_dir / f"{name}.jsonl"), "a", buffering=1)
        self.writer = EventFileWriter(str(self.log_dir / "tensorboard" / name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        scalars = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=scalars)))

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def read_jsonl_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
