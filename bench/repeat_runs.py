"""The same training command again and again: does every run finish, and how did those that did not end?

    python3 bench/repeat_runs.py [--times 20] [--out bench/results/repeat_runs.json] [key=value ...]
    python3 bench/repeat_runs.py --times 20 cluster.backend=ray cluster.n_learner_ranks=2 max_steps=20

Runs `training/main_async_ppo.py` with the given settings `--times` times, one after the other, each in a fresh
output directory, and reads how each ended: its exit code, its minutes, the restarts it logged, and any crash a
role's log or the console shows (a fatal signal such as SIGSEGV or SIGABRT, a Python "Fatal Python error"). A
crash a restart hid still counts. Prints a row per run and writes them as JSON; the last line is the headline,
`finished cleanly: <runs with exit code 0 and no crash>/<runs>`. Every run's directory is kept (`--runs-dir`).
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRASH = re.compile(r"(SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE|Fatal Python error|Segmentation fault|core dumped"
                   r"|died unexpectedly|exited with code -(?:4|6|7|8|11))")


def one_run(settings: list[str], out_dir: Path, timeout: float) -> dict:
    started = time.monotonic()
    command = [sys.executable, str(ROOT / "training" / "main_async_ppo.py"), *settings, f"output_dir={out_dir}",
               "trial_name=repeat"]
    try:
        done = subprocess.run(command, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
        code, console = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code = "timeout"
        console = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    logs = "".join(p.read_text(errors="replace") for p in out_dir.glob("*/repeat/logs/*.log"))
    crashes = sorted(set(CRASH.findall(console + logs)))
    summaries = list(out_dir.glob("*/repeat/summary.json"))
    summary = json.loads(summaries[0].read_text()) if summaries else {}
    return {"exit": code, "minutes": (time.monotonic() - started) / 60, "crashes": crashes,
            "restarts": summary.get("restarts", {}), "steps": summary.get("steps"),
            "console_tail": console[-1500:] if code != 0 or crashes else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "repeat_runs.json"))
    parser.add_argument("--runs-dir", default="", help="where each run's directory is kept (default: a temporary one)")
    parser.add_argument("settings", nargs="*", help="the run's settings, key=value")
    args = parser.parse_args()
    rows = []
    print(f"{'run':>4} {'exit':>7} {'minutes':>8} {'steps':>6}  restarts / crashes", flush=True)
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="repeat-runs-")).resolve()
    for i in range(1, args.times + 1):
        (runs_dir / str(i)).mkdir(parents=True, exist_ok=True)
        row = one_run(args.settings, runs_dir / str(i), args.timeout)  # kept: a crash's logs are read afterwards
        rows.append(row)
        print(f"{i:>4} {row['exit']!s:>7} {row['minutes']:>8.1f} {row['steps']!s:>6}  {row['restarts'] or '-'} / "
              f"{', '.join(row['crashes']) or '-'}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": args.settings, "runs": rows}, indent=2))
    clean = sum(row["exit"] == 0 and not row["crashes"] for row in rows)
    print(f"finished cleanly: {clean}/{len(rows)}")


if __name__ == "__main__":
    main()
