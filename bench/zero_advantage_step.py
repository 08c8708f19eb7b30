"""A train step on a batch none of whose sequences can move the policy: no pass, or every sequence computed.

    python3 bench/zero_advantage_step.py [--threads 1] [--repeats 6] [--out bench/results/zero_advantage_step.json]
                                         [key=value ...]

The learner's `train_step` on a default step's batch (`bench/learner_vs_plain.py`'s: 16 prompts x 8 samples of the
default task) in which every sample got one reward: every advantage is 0, as on a run whose model never earns a
reward (the math-tools task on the tiny model). Two sides, which leave the same weights (`tests/test_learner.py`):

- "no pass": the learner as it is (`ppo.skip_zero_advantage=auto`): its optimizer steps on zero gradients;
- "every sequence": `ppo.skip_zero_advantage=false`, each update's forward and backward passes over every sequence,
  as the learner did on such a batch before 2026-12-07.

Repeats alternate the sides after one warm-up each; medians of wall and of this process's CPU seconds are reported.
The last line is the headline: every sequence's step time / no pass's.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_vs_plain import default_step_batch, prepared_config  # noqa: E402
from rlsys.distributed import Ranks  # noqa: E402
from rlsys.training_step import PolicyTrainer, synchronize  # noqa: E402

SIDES = {"no pass": "auto", "every sequence": "false"}  # name: ppo.skip_zero_advantage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner role's)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="bench/results/zero_advantage_step.json")
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        config = prepared_config(list(args.overrides), tmp)
        trajectories = [dataclasses.replace(t, reward=1.0) for t in default_step_batch(config, seed=0)]
        learner = PolicyTrainer(config, Ranks(), config.model.path)
        times = {name: {"wall": [], "cpu": []} for name in SIDES}
        for repeat in range(args.repeats + 1):  # the first of each side warms up
            for name, skip in SIDES.items():
                learner.ppo.skip_zero_advantage = skip
                wall, cpu = time.perf_counter(), time.process_time()
                learner.train_step(trajectories)
                synchronize(learner.device)
                if repeat:
                    times[name]["wall"].append(time.perf_counter() - wall)
                    times[name]["cpu"].append(time.process_time() - cpu)

    rows = {name: {"seconds_per_step": statistics.median(t["wall"]),
                   "cpu_seconds_per_step": statistics.median(t["cpu"]), **t} for name, t in times.items()}
    ratio = rows["every sequence"]["cpu_seconds_per_step"] / rows["no pass"]["cpu_seconds_per_step"]
    print(f"default step batch, {len(trajectories)} sequences, every advantage 0, {args.threads} thread(s), "
          f"{learner.device}")
    print(f"{'side':<16} {'s/step':>7} {'CPU s/step':>10}")
    for name, row in rows.items():
        print(f"{name:<16} {row['seconds_per_step']:>7.3f} {row['cpu_seconds_per_step']:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.1f} (every sequence's CPU seconds a step / no pass's)")


if __name__ == "__main__":
    main()
