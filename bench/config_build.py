"""What building a run's config costs as a process starts (the launcher, and each role again), side by side with
another checkout of rlsys.

    python3 bench/config_build.py --baseline DIR [--repeats 5] [--out bench/results/config_build.json]

For each experiment, a fresh process of each tree (PYTHONPATH and working directory its own) imports rlsys.cli, then
builds the config twice as a run does: `parse_config` of the command line (the launcher's) and `config_from_dict` of
what the launcher sends (a role's, first build in its process: the caches a process fills are empty). The figures are
CPU seconds of the process (time.process_time) for each build, the import left out. Processes alternate between the
trees, so the machine's noise falls on both. The last line is the headline: the baseline's CPU seconds for a role's
build over this tree's, the median over every experiment and repeat.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ["async-ppo-math", "async-ppo-math-tools", "async-ppo-openai-agent", "async-ppo-frozen-lake",
               "async-ppo-sokoban", "async-ppo-mixed-games", "async-ppo-webshop"]
CHILD = """
import json, sys, time
from rlsys.cli import config_from_dict, config_to_dict, parse_config
started = time.process_time()
config = parse_config(["experiment=" + sys.argv[1]])
launcher = time.process_time() - started
payload = config_to_dict(config)
# a role's process starts with nothing cached: the launcher's build above must not serve it
for name in ("attribute_docs", "type_hints"):
    cached = getattr(sys.modules["rlsys.cli"], name, None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
started = time.process_time()
assert config_from_dict(payload) == config
print(json.dumps({"launcher_s": launcher, "role_s": time.process_time() - started}))
"""


def build_once(tree: Path, experiment: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, experiment], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another checkout of rlsys to time beside this one")
    parser.add_argument("--repeats", type=int, default=5, help="processes of each tree for each experiment")
    parser.add_argument("--out", default="bench/results/config_build.json")
    args = parser.parse_args()

    trees = {"this tree": ROOT, "baseline": Path(args.baseline).resolve()}
    runs: dict[str, dict[str, list[dict]]] = {name: {e: [] for e in EXPERIMENTS} for name in trees}
    for i in range(args.repeats):
        for experiment in EXPERIMENTS:
            for name, tree in trees.items():
                runs[name][experiment].append(build_once(tree, experiment))

    print(f"CPU seconds of one config build in a fresh process (median of {args.repeats}; runs alternating)")
    print("| experiment | baseline: launcher | baseline: role | this tree: launcher | this tree: role |")
    print("|---|---|---|---|---|")
    for experiment in EXPERIMENTS:
        cells = [median(r[key] for r in runs[name][experiment]) for name in ("baseline", "this tree")
                 for key in ("launcher_s", "role_s")]
        print(f"| {experiment} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    role = {name: median(r["role_s"] for e in EXPERIMENTS for r in runs[name][e]) for name in trees}
    ratio = role["baseline"] / role["this tree"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "role_median_s": role, "ratio": ratio}, indent=1))
    print(f"\nratio: {ratio:.2f} (baseline / this tree, CPU seconds of a role's config build, median)")


if __name__ == "__main__":
    main()
