"""How long each experiment takes to get its dataset and tiny model from an empty cache (its cold start).

    python3 bench/cold_start.py [--experiments NAME,NAME] [--out bench/results/cold_start.json]

For each experiment (default: every built-in one) `prepare_assets` runs as the launcher runs it, in a fresh
temporary cache: the generated dataset, then the tiny model's warm start, with the experiment's defaults. The
table gives the seconds of each, the warm start's last held-out accuracy and its target; the last line is the
slowest cold start. The roles' start (vLLM, the first evaluation) comes after this and is not counted.
"""

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import experiments  # noqa: E402,F401  (registers the experiments)
from experiments import EXPERIMENTS  # noqa: E402
from rlsys.assets import prepare_assets  # noqa: E402
from rlsys.cli import parse_config  # noqa: E402

BUILT_IN = [name for name in EXPERIMENTS.names() if EXPERIMENTS.lookup(name).__module__.startswith("experiments.")]


def cold_start(name: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        config = parse_config([f"experiment={name}", f"model.cache_dir={cache}"])
        lines = []
        started = time.monotonic()
        prepare_assets(config, log=lines.append)
        seconds = time.monotonic() - started
    reached = re.search(r"warm start reached ([\d.]+)%.* in (\d+)s", lines[-1])
    return {"experiment": name, "seconds": round(seconds, 1), "warm_start_seconds": int(reached.group(2)),
            "accuracy": float(reached.group(1)) / 100, "target": config.model.warm_start_accuracy,
            "stopped_at_step_limit": "at its limit" in lines[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", default=",".join(BUILT_IN))
    parser.add_argument("--out", default="bench/results/cold_start.json")
    args = parser.parse_args()
    results = []
    print(f"{'experiment':<28} {'cold start':>10} {'warm start':>10} {'accuracy':>8} {'target':>6}  step limit")
    for name in args.experiments.split(","):
        r = cold_start(name)
        results.append(r)
        print(f"{name:<28} {r['seconds']:>9.0f}s {r['warm_start_seconds']:>9}s {r['accuracy']:>8.1%} "
              f"{r['target']:>6.0%}  {'reached' if r['stopped_at_step_limit'] else 'no'}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    slowest = max(results, key=lambda r: r["seconds"])
    print(f"slowest cold start: {slowest['experiment']} {slowest['seconds']:.0f}s")


if __name__ == "__main__":
    main()
