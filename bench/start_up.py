"""How long the default run takes to start: seconds from the command to the learner's first step, side by side with
another checkout of rlsys.

    python3 bench/start_up.py [--baseline DIR] [--repeats 3] [--cold 2] [--out bench/results/start_up.json]

Each run is `training/main_async_ppo.py max_steps=10 eval_steps=0` of its tree, with the default task's dataset and
warm-started model already in the cache (the warm start is not start-up: bench/cold_start.py times it). What it
times is the launcher's imports and checks, the roles' processes and imports, vLLM's engine, the math verifier's
worker, and the initial held-out evaluation. Runs alternate between the trees, so the machine's noise falls on both.
`--cold N` adds N runs of each with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), as on a fresh machine:
whatever torch.compile builds at start-up is then built from nothing. The last line is the headline: the baseline's
seconds to the first step over this tree's, warm cache.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.launched_runs import ROOT, launch, learner_rows  # noqa: E402
from rlsys.metrics import LOGGED_AT  # noqa: E402

STEPS = 10


def start_once(tree: Path, out_dir: Path, trial: str, cold: bool) -> dict[str, float]:
    """One run of `tree`'s training script: seconds to its first learner step and to its end."""
    env = dict(os.environ)
    if cold:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=out_dir)
    started = time.time()  # the learner's metrics are stamped with time.time()
    run_dir, _, seconds = launch([f"max_steps={STEPS}", "eval_steps=0"], out_dir, trial, tree, env)
    return {"first_step_s": learner_rows(run_dir)[0][LOGGED_AT] - started, "total_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="another checkout of rlsys to time beside this one")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, inductor's cache as it is")
    parser.add_argument("--cold", type=int, default=0, help="runs of each tree with an empty inductor cache")
    parser.add_argument("--out", default="bench/results/start_up.json")
    args = parser.parse_args()

    trees = {"this tree": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    out_dir = Path(tempfile.mkdtemp(prefix="start_up-"))
    runs: dict[str, dict[str, list[dict]]] = {name: {"warm": [], "cold": []} for name in trees}
    for cache, count in (("warm", args.repeats), ("cold", args.cold)):
        for i in range(count):
            for name, tree in trees.items():
                trial = f"{name.replace(' ', '_')}-{cache}-{i}"
                runs[name][cache].append(start_once(tree, out_dir, trial, cold=cache == "cold"))
                print(f"{name:10} {cache} {i}: first step at {runs[name][cache][-1]['first_step_s']:.1f} s", flush=True)

    print(f"\ndefault task, {STEPS} steps, runs alternating; medians (each run)")
    print(f"{'tree':10} {'inductor cache':15} {'first step s':>13} {'whole run s':>12}  each run's first step")
    rows = []
    for name in trees:
        for cache in ("warm", "cold"):
            done = runs[name][cache]
            if not done:
                continue
            row = {"tree": name, "path": str(trees[name]), "inductor_cache": cache,
                   "first_step_s": median(r["first_step_s"] for r in done),
                   "total_s": median(r["total_s"] for r in done), "runs": done}
            rows.append(row)
            print(f"{name:10} {cache:15} {row['first_step_s']:13.1f} {row['total_s']:12.1f}  "
                  + " ".join(f"{r['first_step_s']:.1f}" for r in done))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": STEPS, "rows": rows}, indent=1))
    if args.baseline:
        warm = {row["tree"]: row["first_step_s"] for row in rows if row["inductor_cache"] == "warm"}
        print(f"ratio: {warm['baseline'] / warm['this tree']:.2f} (baseline / this tree, seconds to the first step)")
    else:
        print(f"start-up: first step at {rows[0]['first_step_s']:.1f} s")


if __name__ == "__main__":
    main()
