"""A run that keeps learning while things break around it: seeded faults, and how the run answered each.

    python3 bench/chaos.py [--steps 200] [--each 2] [--seed 0] [--out bench/results/chaos.json] [key=value ...]

Two runs of `training/main_async_ppo.py`, one after the other, with the same run seed and settings (a checkpoint
every 10 steps, `env_timeout=5`, room for the restarts below): a clean one of the default experiment, and one
under chaos. The chaos run's experiment is `chaos-math` (bench/chaos_plugin.py): the default experiment whose
environment and agent misbehave on a seeded 9% of the training prompts (a reward that raises, one that hangs, an
agent that raises, a hostile client on the endpoint). And at seeded random steps, `--each` times each, the bench
kills the inference worker and the rollout worker (SIGKILL), shuts the private redis-server down (SIGTERM) and
kills the learner (SIGKILL: the run restarts from its last checkpoint).

Printed and written as JSON: every fault with the step it hit and how the run answered it (the restart the
launcher logged, the seconds until the learner logged its next step), the prompts admitted against those
accounted (trained, filtered or failed with a reason), the prompts trained twice (the final checkpoint's consumed
ids), the hostile requests' answers, and both runs' held-out gain. The last line is the headline,
`ratio: chaos run's held-out gain / clean run's`. `tests/test_chaos.py` runs a short form in the slow tier.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launched_runs import learner_rows  # noqa: E402
from rlsys.checkpoint import CHECKPOINTS_DIR, latest_checkpoint, read_trainer_state  # noqa: E402
from rlsys.metrics import LOGGED_AT, STEP  # noqa: E402
from rlsys.run_files import SUMMARY_FILE  # noqa: E402

PLUGIN = ROOT / "bench" / "chaos_plugin.py"
KILLS = {"inference0": signal.SIGKILL, "rollout0": signal.SIGKILL, "redis-server": signal.SIGTERM,
         "learner0": signal.SIGKILL}
SAVE_STEPS = 10


@dataclasses.dataclass
class Fault:
    role: str
    step: int  # injected once the learner has logged this step
    sent_at: float | None = None  # wall time
    recovered_s: float | None = None  # until the learner logged its next step


def plan(steps: int, each: int, seed: int) -> list[Fault]:
    """`each` faults of every kind at distinct seeded steps, after the first checkpoint and before the last tenth."""
    first, last = SAVE_STEPS + 1, max(SAVE_STEPS + 2, int(steps * 0.9))
    at = random.Random(seed).sample(range(first, last), each * len(KILLS))
    return sorted((Fault(role, step) for role, step in zip(list(KILLS) * each, at)), key=lambda f: f.step)


def run_settings(steps: int, each: int) -> list[str]:
    return [f"max_steps={steps}", f"save_steps={SAVE_STEPS}", "env_timeout=5", "cluster.inference_dead_after=2",
            f"cluster.max_role_restarts={2 * each + 2}"]


def role_process(run: subprocess.Popen, role: str) -> psutil.Process | None:
    for process in psutil.Process(run.pid).children(recursive=True):
        try:
            if process.name() == role:
                return process
        except psutil.NoSuchProcess:
            continue
    return None


def run_directory(settings: list[str], out_dir: Path, trial: str) -> Path:
    """Where the training command writes a run of these settings (its first `experiment=`, or the default's)."""
    experiment = next((s.split("=", 1)[1] for s in settings if s.startswith("experiment=")), "async-ppo-math")
    return out_dir / experiment / trial


def inject(run: subprocess.Popen, run_dir: Path, faults: list[Fault], signals: dict = KILLS) -> None:
    """Sends the faults in order (each role its signal in `signals`), each once the learner has logged its step (a
    role being restarted is waited for), and times how long the learner then takes to log another step, until the
    run ends."""
    while run.poll() is None:
        try:
            rows = learner_rows(run_dir)
        except FileNotFoundError:  # the learner has logged no step yet
            rows = []
        pending = next((f for f in faults if f.sent_at is None), None)
        if pending and rows and rows[-1][STEP] >= pending.step and (process := role_process(run, pending.role)):
            process.send_signal(signals[pending.role])
            pending.sent_at = time.time()
        for fault in faults:
            after = [row[LOGGED_AT] for row in rows if fault.sent_at is not None and row[LOGGED_AT] > fault.sent_at]
            if after and fault.recovered_s is None:
                fault.recovered_s = after[0] - fault.sent_at
        time.sleep(0.2)


def launch(settings: list[str], out_dir: Path, trial: str, faults: list[Fault], env: dict) -> dict:
    """One run to its end; its summary, console and final checkpoint's state."""
    command = [sys.executable, str(ROOT / "training" / "main_async_ppo.py"), *settings, f"output_dir={out_dir}",
               f"trial_name={trial}"]
    started = time.monotonic()
    with open(out_dir / f"{trial}.log", "w") as log:
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir, env=env)
    run_dir = run_directory(settings, out_dir, trial)
    try:
        inject(run, run_dir, faults)
    finally:
        if run.poll() is None:
            run.kill()
    console = (out_dir / f"{trial}.log").read_text()
    if run.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit code {run.returncode}):\n{console[-3000:]}")
    consumed = read_trainer_state(latest_checkpoint(run_dir / CHECKPOINTS_DIR))["consumed_prompts"]
    return {"command": command, "seconds": time.monotonic() - started,
            "summary": json.loads((run_dir / SUMMARY_FILE).read_text()),
            "consumed": len(set(consumed)), "trained_twice": len(consumed) - len(set(consumed)), "console": console}


def hostile_answers(log: Path) -> dict:
    """Per request kind: how often it was sent, and how often answered as a sound endpoint answers it."""
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def sound(row: dict) -> bool:
        return row["status"] == row["expected"] and row["expected_param"] in (None, row["param"])

    sent = Counter(row["request"] for row in rows)
    answered = Counter(row["request"] for row in rows if sound(row))
    return {"sent": len(rows), "sound": sum(answered.values()),
            "by_request": {k: [sent[k], answered[k]] for k in sent},
            "server_errors": sum(1 for row in rows if row["status"] >= 500 or row["status"] == 0),
            "unsound": [row for row in rows if not sound(row)][:10]}


def measure(steps: int, each: int, seed: int, overrides: list[str], out_dir: Path, clean: bool = True) -> dict:
    """The chaos run (and, with `clean`, the clean run first); what `report` prints."""
    chaos_log = out_dir / "hostile_requests.jsonl"
    env = {**os.environ, "RLSYS_CHAOS_SEED": str(seed), "RLSYS_CHAOS_LOG": str(chaos_log)}
    settings = run_settings(steps, each) + overrides
    result = {"steps": steps, "each": each, "seed": seed, "overrides": overrides}
    if clean:
        result["clean"] = launch(settings, out_dir, "clean", [], env)
    faults = plan(steps, each, seed)
    result["chaos"] = launch(settings + ["experiment=chaos-math", f"plugins=[{PLUGIN}]"], out_dir, "chaos", faults, env)
    result["faults"] = [dataclasses.asdict(f) for f in faults]
    result["hostile"] = hostile_answers(chaos_log)
    return result


def gain(run: dict) -> float:
    return run["summary"]["final_accuracy"] - run["summary"]["initial_accuracy"]


def report(result: dict, out: Path) -> None:
    chaos = result["chaos"]
    prompts = chaos["summary"]["prompts"]
    print(f"chaos run: {result['steps']} steps, {chaos['seconds']:.0f} s, seed {result['seed']}")
    print(f"{'fault':<34} {'at step':>7} {'next step':>9}  how the run answered")
    restarts = chaos["summary"]["restarts"]
    for fault in result["faults"]:
        how = ("the run restarted from its last checkpoint" if fault["role"] == "learner0" else
               f"{fault['role']} restarted")
        answered = "never" if fault["recovered_s"] is None else f"{fault['recovered_s']:.1f} s"
        if fault["sent_at"] is None:
            answered, how = "-", "not sent: the run ended first"
        print(f"{'kill ' + fault['role']:<34} {fault['step']:>7} {answered:>9}  {how}")
    for reason, n in sorted(prompts["failed"].items()):
        print(f"{'episodes failed: ' + reason:<34} {'':>7} {n:>9}  prompts failed, counted, the run went on")
    hostile = result["hostile"]
    print(f"{'hostile requests on the endpoint':<34} {'':>7} {hostile['sent']:>9}  {hostile['sound']} answered "
          f"as a sound endpoint does (4xx naming the field, 401, 410, 200 for the valid one); "
          f"{hostile['server_errors']} server errors or no answer")
    print(f"role restarts logged: {restarts}")
    print(f"prompts: {prompts['admitted']} admitted, accounted {chaos['summary']['prompts_accounted']} "
          f"(trained {prompts['trained']}, filtered {prompts['filtered']}, failed {prompts['failed']}); "
          f"trained twice: {chaos['trained_twice']}")
    line = f"held-out: chaos {chaos['summary']['initial_accuracy']:.1%} -> {chaos['summary']['final_accuracy']:.1%}"
    if "clean" in result:
        clean = result["clean"]
        p1, p2 = clean["summary"]["final_accuracy"], chaos["summary"]["final_accuracy"]
        noise = 2 * math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / 500)  # two standard errors of the difference
        line += (f", clean {clean['summary']['initial_accuracy']:.1%} -> {p1:.1%} ({clean['seconds']:.0f} s); "
                 f"final accuracies differ by {100 * (p2 - p1):+.1f} points (two standard errors: {100 * noise:.1f})")
    print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: ({**v, "console": v["console"][-2000:]} if k in ("clean", "chaos") else v)
                               for k, v in result.items()}, indent=2))
    if "clean" in result:
        print(f"ratio: chaos run's held-out gain / clean run's = {gain(chaos) / gain(result['clean']):.2f} "
              f"({100 * gain(chaos):+.1f} against {100 * gain(result['clean']):+.1f} points)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="learner steps of each run")
    parser.add_argument("--each", type=int, default=2, help="kills of each role during the chaos run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults: their steps and which prompts")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    parser.add_argument("--runs-dir", default="", help="where the runs are written (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="settings for both runs, key=value")
    args = parser.parse_args()
    out_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="chaos-")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    report(measure(args.steps, args.each, args.seed, args.overrides, out_dir), Path(args.out))


if __name__ == "__main__":
    main()
