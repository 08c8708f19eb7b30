"""A run whose private redis-server is shut down again and again: does it finish, with every prompt accounted?

    python3 bench/redis_restarts.py [--restarts 12] [--every 3] [--after 20]
        [--out bench/results/redis_restarts.json] [key=value ...]

Runs `training/main_async_ppo.py` (the default experiment, `max_steps=60` unless overridden) in a fresh
output directory and, from `--after` seconds on, sends its redis-server SIGTERM every `--every` seconds,
`--restarts` times or until the run ends. Each shutdown drops the replies of commands the server already
ran, so clients retry them: pushes can arrive twice and pops can vanish. Prints one row (restarts, role
restarts, prompts admitted and accounted, request copies dropped) and writes it as JSON. The last line is
the headline, `survived: <shutdowns ridden out>/<shutdowns sent>`: all of them if the run finished with
no restart but the server's and every prompt accounted, else 0.
"""

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.run_files import SUMMARY_FILE  # noqa: E402


def shut_down_redis_repeatedly(run: subprocess.Popen, restarts: int, every: float, after: float) -> int:
    sent = 0
    time.sleep(after)
    while run.poll() is None and sent < restarts:
        servers = [p for p in psutil.Process(run.pid).children(recursive=True) if p.name() == "redis-server"]
        if servers:
            servers[0].send_signal(signal.SIGTERM)
            sent += 1
        time.sleep(every)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=12)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=20.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "redis_restarts.json"))
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as output_dir:
        log_path = Path(output_dir) / "run.log"
        command = [sys.executable, str(ROOT / "training" / "main_async_ppo.py"), "max_steps=60",
                   f"cluster.max_role_restarts={args.restarts}", f"output_dir={output_dir}", "trial_name=restarts",
                   *overrides]
        with open(log_path, "w") as log:
            run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=output_dir)
        sent = shut_down_redis_repeatedly(run, args.restarts, args.every, args.after)
        exit_code = run.wait()
        log_text = log_path.read_text()
        summaries = list(Path(output_dir).glob(f"*/restarts/{SUMMARY_FILE}"))
        if exit_code != 0 or not summaries:
            sys.exit(f"the run failed (exit code {exit_code}):\n{log_text[-3000:]}")
        summary = json.loads(summaries[0].read_text())
    prompts = summary["prompts"]
    row = {
        "shutdowns_sent": sent, "restarts": summary["restarts"], "steps": summary["steps"],
        "admitted": prompts["admitted"], "trained": prompts["trained"], "filtered": prompts["filtered"],
        "failed": prompts["failed"], "accounted": summary["prompts_accounted"],
        "request_copies_dropped": sum(int(n) for n in re.findall(r"dropped (\d+) copies of requests", log_text)),
        "lost_stream_entries_taken_again": sum(
            int(n) for n in re.findall(r"(\d+) trajectory messages it had handed out never arrived", log_text)),
        "minutes": round(summary["minutes"], 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2))
    for key, value in row.items():
        print(f"{key:34s} {value}")
    survived = sent if summary["restarts"] == {"redis-server": sent} and summary["prompts_accounted"] else 0
    print(f"survived: {survived}/{sent}")


if __name__ == "__main__":
    main()
