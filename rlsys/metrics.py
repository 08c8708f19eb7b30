"""Per-step metrics to TensorBoard and a JSONL file (one object per line, easy to test and plot)."""

import json
import os
import time
from pathlib import Path

from rlsys.run_privacy import append_private


class MetricsLogger:
    def __init__(self, log_dir: Path, name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = os.fdopen(append_private(self.log_dir / f"{name}.jsonl"), "a", buffering=1)
        self.writer = SummaryWriter(str(self.log_dir / "tensorboard" / name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def read_jsonl_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
