"""What the whole-run benchmarks share: start a real run (training/main_async_ppo.py) and read its speed back."""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import yaml

from rlsys.learner_figures import COMPUTE, STALENESS_MEAN, WAIT_DATA
from rlsys.metrics import LEARNER_RECORDS, LOGGED_AT, STEP, read_jsonl_metrics, records_file
from rlsys.run_files import CONFIG_FILE, logs_dir

ROOT = Path(__file__).resolve().parents[1]


def launch(settings: list[str], out_dir: Path, trial: str, tree: Path = ROOT,
           env: dict[str, str] | None = None) -> tuple[Path, list[str], float]:
    """Runs `training/main_async_ppo.py` of `tree` (this checkout by default) with `settings` to the end; (its run
    directory, the command, seconds). The console goes to <out_dir>/<trial>.log; a failed run raises, naming that
    log."""
    command = [sys.executable, "training/main_async_ppo.py", *settings, f"output_dir={out_dir}", f"trial_name={trial}"]
    started = time.monotonic()
    log = out_dir / f"{trial}.log"
    with open(log, "w") as f:
        if subprocess.run(command, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"{' '.join(command)} failed; see {log}")
    run_dir = next(out_dir.glob(f"*/{trial}"))
    return run_dir, command, time.monotonic() - started


def learner_rows(run_dir: Path) -> list[dict]:
    return read_jsonl_metrics(records_file(logs_dir(run_dir), LEARNER_RECORDS))


def training_speed(run_dir: Path, warmup: int) -> dict[str, float]:
    """Trained samples/s between the end of step `warmup` and the last step (start-up and the first batches left
    out), with the learner's mean update and wait per step over that window."""
    rows = learner_rows(run_dir)
    config = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    per_step = config["ppo"]["batch_size"] * config["group_size"]  # trajectories a step trains (one per sample)
    first, last, window = rows[warmup - 1], rows[-1], rows[warmup:]
    steps, seconds = last[STEP] - first[STEP], last[LOGGED_AT] - first[LOGGED_AT]
    return {"samples_per_second": steps * per_step / seconds, "seconds_per_step": seconds / steps,
            "learner_compute_s": mean(r[COMPUTE] for r in window),
            "learner_wait_s": mean(r[WAIT_DATA] for r in window),
            STALENESS_MEAN: mean(r[STALENESS_MEAN] for r in window)}


def parse_run_arguments(parser: argparse.ArgumentParser, steps: int, out: str) -> tuple[argparse.Namespace, Path]:
    """The arguments every whole-run benchmark takes, parsed; and the directory its runs are written to."""
    parser.add_argument("--steps", type=int, default=steps, help="learner steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the throughput")
    parser.add_argument("--out", default=out)
    parser.add_argument("--runs-dir", default="", help="where the runs are written (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="settings for every run, key=value")
    args = parser.parse_args()
    out_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix=Path(out).stem + "-")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, out_dir
