"""The decoupled objective's proximal logprobs: from the first step's own passes, or a pass of their own, side by side.

    python3 bench/proximal_pass.py [--uniform 0.5] [--threads 1] [--repeats 6] [--out bench/results/proximal_pass.json]
                                   [key=value ...]

The learner's `train_step` with `ppo.decoupled_loss=true` on a default step's batch (`bench/learner_vs_plain.py`'s:
16 prompts x 8 samples of the default task), in which a `--uniform` share of the groups got one reward (advantage 0
on every token: GRPO groups all right or all wrong). Three sides, which update alike (`tests/test_learner.py`):

- "first step's passes": the learner as it is. Before the step's first update the policy is the proximal one, so the
  first optimizer step's forward passes give the proximal logprobs of its sequences; a pass without gradients
  computes only those a later mini-batch computes and the first does not (none with one mini-batch, the default);
- "restricted pass": a pass of their own before the step, over the sequences an optimizer step computes (the
  learner from 2026-12-02 until this bench's second version);
- "every sequence": a pass of their own over every sequence (the learner before 2026-12-02);

and for reference "plain PPO", the same learner with `ppo.decoupled_loss=false` (no proximal logprobs at all).

Repeats alternate the sides after one warm-up each; medians are reported. The last line is the headline: every
sequence's step time / the first step's passes'.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uniform", type=float, default=0.5, help="share of the groups that got one reward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner role's)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="bench/results/proximal_pass.json")
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        config = prepared_config(["ppo.decoupled_loss=true", *args.overrides], tmp)
        trajectories = default_step_batch(config, seed=0)
        groups = sorted({t.group_id for t in trajectories})
        uniform = set(groups[:round(args.uniform * len(groups))])
        trajectories = [dataclasses.replace(t, reward=1.0) if t.group_id in uniform else t for t in trajectories]
        learner = PolicyTrainer(config, Ranks(), config.model.path)
        prepare, restricted = learner.prepare_batch, learner.proximal_logprobs

        def every_sequence(batch, mini_batches, first_fills):
            return learner.per_token(learner._policy_logprobs(learner.model), batch)

        sides = {  # name: (prepare_batch, proximal_logprobs, ppo.decoupled_loss)
            "first step's passes": (prepare, restricted, True),
            # without the mini-batches, prepare_batch's pass computes what any step computes, and the first fills none
            "restricted pass": (lambda trajectories, mini_batches: prepare(trajectories), restricted, True),
            "every sequence": (lambda trajectories, mini_batches: prepare(trajectories), every_sequence, True),
            "plain PPO": (prepare, restricted, False)}
        times = {name: [] for name in sides}
        for repeat in range(args.repeats + 1):  # the first of each side warms up
            for name, (learner.prepare_batch, learner.proximal_logprobs, learner.ppo.decoupled_loss) in sides.items():
                started = time.perf_counter()
                learner.train_step(trajectories)
                synchronize(learner.device)
                if repeat:
                    times[name].append(time.perf_counter() - started)

    rows = {name: {"seconds_per_step": statistics.median(t), "seconds": t} for name, t in times.items()}
    ratio = rows["every sequence"]["seconds_per_step"] / rows["first step's passes"]["seconds_per_step"]
    print(f"default step batch, {len(trajectories)} sequences, {len(uniform)} of {len(groups)} groups with one "
          f"reward, ppo.decoupled_loss=true, {args.threads} thread(s), {learner.device}")
    print(f"{'proximal logprobs':<20} {'s/step':>7}  runs")
    for name, row in rows.items():
        print(f"{name:<20} {row['seconds_per_step']:>7.3f}  {' '.join(f'{t:.3f}' for t in row['seconds'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.2f} (every sequence's step time / the first step's passes')")


if __name__ == "__main__":
    main()
