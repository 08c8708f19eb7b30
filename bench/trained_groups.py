"""A learner step's groups recorded trained: one atomic change of the bus against one change a group, side by side.

    python3 bench/trained_groups.py [--groups 16] [--steps 200] [--repeats 5] [--out bench/results/trained_groups.json]

After each train step the learner records the step's groups trained in the prompt ledger (rlsys/prompt_ledger.py),
on the learner's own thread, between publishing the version and logging the step. Over a private Redis (a run's bus),
`--groups` prompts (the default step's 16) are admitted, untimed, then settled, timed, `--steps` times a window:

- "one by one": `PromptLedger.trained` for each group, as the learner did before 2026-12-07: a round trip each;
- "one change" and "one change, again": `PromptLedger.trained_all` on the step's groups, as it does now, twice; their
  ratio is the noise between identical sides on this machine at this time.

Windows alternate, the order rotated each repeat; medians of the milliseconds a step takes, of wall time (what the
learner waits) and of this process's CPU time. The last line is the headline: one by one / one change, wall time.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.prompt_ledger import PromptLedger  # noqa: E402


def one_by_one(ledger: PromptLedger, prompt_ids: list[str]) -> None:
    for prompt_id in prompt_ids:
        ledger.trained(prompt_id)


SIDES = {"one by one": one_by_one, "one change": PromptLedger.trained_all,
         "one change, again": PromptLedger.trained_all}


def window(ledger: PromptLedger, settle, groups: int, steps: int, first: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds a step's settling takes, mean over `steps` steps; prompt ids from `first` on."""
    wall = cpu = 0.0
    for step in range(steps):
        prompt_ids = [f"p{first + step * groups + i}" for i in range(groups)]
        for prompt_id in prompt_ids:
            ledger.admit(prompt_id, 10**9)
        started, started_cpu = time.perf_counter(), time.process_time()
        settle(ledger, prompt_ids)
        wall += time.perf_counter() - started
        cpu += time.process_time() - started_cpu
    if ledger.counts()["in_flight"]:
        raise RuntimeError("a side left prompts in flight: it did not record them trained")
    return 1e3 * wall / steps, 1e3 * cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="groups a step (ppo.batch_size)")
    parser.add_argument("--steps", type=int, default=200, help="steps a window")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--out", default="bench/results/trained_groups.json")
    args = parser.parse_args()
    windows = {name: {"wall_ms": [], "cpu_ms": []} for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        bus = connect(server.url)
        ledger = PromptLedger(bus, args.groups, 0)
        ledger.start()
        window(ledger, PromptLedger.trained_all, args.groups, args.steps, -args.groups * args.steps)  # warm-up
        names, first = list(SIDES), 0
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                wall, cpu = window(ledger, SIDES[name], args.groups, args.steps, first)
                first += args.groups * args.steps
                windows[name]["wall_ms"].append(wall)
                windows[name]["cpu_ms"].append(cpu)
        bus.close()
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    print(f"{args.groups} groups a step, {args.steps} steps a window, {args.repeats} windows a side")
    print(f"{'side':<18} {'wall ms':>8} {'CPU ms':>7}   wall ms of each window")
    for name, m in medians.items():
        print(f"{name:<18} {m['wall_ms']:>8.3f} {m['cpu_ms']:>7.3f}   "
              + " ".join(f"{ms:.3f}" for ms in windows[name]["wall_ms"]))
    same = medians["one change, again"]["wall_ms"] / medians["one change"]["wall_ms"]
    ratio = medians["one by one"]["wall_ms"] / medians["one change"]["wall_ms"]
    print(f"identical sides (one change, again / one change), wall time: {same:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": windows, "medians": medians,
                                          "identical_sides": same, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.2f} (one by one / one change, wall time of a step's settling)")


if __name__ == "__main__":
    main()
