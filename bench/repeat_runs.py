"""The same training command again and again: does every run finish, and how did those that did not end?

    python3 bench/repeat_runs.py [--times 20] [--out bench/results/repeat_runs.json] [key=value ...]
    python3 bench/repeat_runs.py --times 20 cluster.backend=ray cluster.n_learner_ranks=2 max_steps=20
    python3 bench/repeat_runs.py --times 5 --kill-seed 0 cluster.backend=ray cluster.n_learner_ranks=2 max_steps=20

Runs `training/main_async_ppo.py` with the given settings `--times` times, one after the other, each in a fresh
output directory, and reads how each ended: its exit code, its minutes, the restarts it logged, and any crash a
role's log or the console shows (a fatal signal such as SIGSEGV or SIGABRT, a Python "Fatal Python error"). A
crash a restart hid still counts. Prints a row per run and writes them as JSON; the last line is the headline,
`finished cleanly: <runs with exit code 0 and no crash>/<runs>`. Every run's directory is kept (`--runs-dir`).

With `--kill-seed`, each run also has one of its roles killed (SIGKILL) once the learner has logged a seeded random
step: the role (an inference worker, the rollout worker or a learner rank) and the step are drawn per run from
the seed. Such a run is answered when it finishes, or stops with an error within a minute of the kill; the last
line is then `answered: <runs answered>/<runs>`. The kill is bench/chaos.py's.
"""

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos import Fault, inject, run_directory  # noqa: E402
from rlsys.cli import parse_config  # noqa: E402
from rlsys.protocol import role_name  # noqa: E402
from rlsys.run_files import SUMMARY_FILE  # noqa: E402

RAY_WORKER_DIED = "A worker died or was killed while executing a task"
ANSWER_WITHIN_S = 60  # a run whose role was killed finishes, or stops with an error this soon after the kill
CRASH = re.compile(r"(SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE|Fatal Python error|Segmentation fault|core dumped"
                   r"|died unexpectedly|exited with code -(?:4|6|7|8|11))")


def one_run(settings: list[str], out_dir: Path, timeout: float, kill: Fault | None = None) -> dict:
    started = time.monotonic()
    command = [sys.executable, str(ROOT / "training" / "main_async_ppo.py"), *settings, f"output_dir={out_dir}",
               "trial_name=repeat"]
    with open(out_dir / "console.log", "w") as console_file:
        run = subprocess.Popen(command, cwd=out_dir, stdout=console_file, stderr=subprocess.STDOUT)
    run_dir = run_directory(settings, out_dir, "repeat")
    if kill is not None:
        threading.Thread(target=inject, args=(run, run_dir, [kill], {kill.role: signal.SIGKILL}), daemon=True).start()
    try:
        code = run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        code = "timeout"
    ended = time.time()
    console = (out_dir / "console.log").read_text(errors="replace")
    logs = "".join(p.read_text(errors="replace") for p in run_dir.glob("logs/*.log"))
    if kill:  # the reports of the one killed role are the fault, not a crash (Ray's lists SIGSEGV among causes)
        console = without_reports_of(kill.role, console)
    crashes = sorted(set(CRASH.findall(console + logs)))
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    row = {"exit": code, "minutes": (time.monotonic() - started) / 60, "crashes": crashes,
           "restarts": summary.get("restarts", {}), "steps": summary.get("steps"),
           "console_tail": console[-1500:] if code != 0 or crashes else ""}
    if kill is not None:
        stopped_after = None if kill.sent_at is None else ended - kill.sent_at
        row["kill"] = {"role": kill.role, "step": kill.step, "sent": kill.sent_at is not None,
                       "next_step_s": kill.recovered_s, "ended_s_after_kill": stopped_after,
                       "answered": code == 0 or (stopped_after is not None and stopped_after <= ANSWER_WITHIN_S)}
    return row


def without_reports_of(role: str, console: str) -> str:
    """The console less the launcher's line on `role`'s death and Ray's first report of a dead worker (its own
    words for one killed process); a second death still shows."""
    lines, raylet_seen = [], False
    for line in console.splitlines():
        if line.startswith(f"{role} died") or (RAY_WORKER_DIED in line and not raylet_seen):
            raylet_seen = raylet_seen or RAY_WORKER_DIED in line
            continue
        lines.append(line)
    return "\n".join(lines)


def planned_kill(seed: int, run: int, settings: list[str]) -> Fault:
    """One role and one step for this run, drawn from the seed: any role, any step but the first and the last two."""
    config = parse_config(settings)
    steps, ranks = config.max_steps, config.cluster.n_learner_ranks
    rng = random.Random(f"{seed}-{run}")
    roles = [role_name("inference", 0), role_name("rollout", 0)] + [role_name("learner", rank) for rank in range(ranks)]
    return Fault(rng.choice(roles), rng.randint(2, max(2, steps - 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "repeat_runs.json"))
    parser.add_argument("--runs-dir", default="", help="where each run's directory is kept (default: a temporary one)")
    parser.add_argument("--kill-seed", type=int, default=None, help="kill one role of each run at a seeded step")
    parser.add_argument("settings", nargs="*", help="the run's settings, key=value")
    args = parser.parse_args()
    rows = []
    print(f"{'run':>4} {'exit':>7} {'minutes':>8} {'steps':>6}  restarts / crashes", flush=True)
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="repeat-runs-")).resolve()
    for i in range(1, args.times + 1):
        (runs_dir / str(i)).mkdir(parents=True, exist_ok=True)
        kill = None if args.kill_seed is None else planned_kill(args.kill_seed, i, args.settings)
        row = one_run(args.settings, runs_dir / str(i), args.timeout, kill)  # kept: a crash's logs are read afterwards
        rows.append(row)
        kill_note = ""
        if kill is not None:
            k = row["kill"]
            answer = ("never sent: the run ended first" if not k["sent"] else "finished" if row["exit"] == 0 else
                      f"stopped {k['ended_s_after_kill']:.0f} s after it")
            kill_note = f" / killed {k['role']} after step {k['step']}: {answer}"
        print(f"{i:>4} {row['exit']!s:>7} {row['minutes']:>8.1f} {row['steps']!s:>6}  {row['restarts'] or '-'} / "
              f"{', '.join(row['crashes']) or '-'}{kill_note}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": args.settings, "runs": rows}, indent=2))
    clean = sum(row["exit"] == 0 and not row["crashes"] for row in rows)
    if args.kill_seed is None:
        print(f"finished cleanly: {clean}/{len(rows)}")
    else:
        print(f"answered: {sum(row['kill']['answered'] for row in rows)}/{len(rows)} (finished, or stopped with an "
              f"error within {ANSWER_WITHIN_S} s of the kill; {clean} finished cleanly)")


if __name__ == "__main__":
    main()
