"""Trained samples per wall-second and held-out accuracy over time at max_head_offpolicyness 0, 1, 2 and 4.

    python3 bench/async_vs_sync.py [--steps 40] [--offpolicyness 0,1,2,4] [--out bench/results/async_vs_sync.json]

Each setting is one real run of the default task (`training/main_async_ppo.py`, the default model, data and
hyper-parameters) of `--steps` steps, one after the other in the order given; 0 is rlsys's synchronous
setting (on-policy: a batch is generated only after the learner published the weights it trains). Held-out
greedy accuracy on the 500 problems is evaluated every `--eval-steps` steps beside training, as every run does,
and reported with the wall seconds since the run's first training step. Trained samples/s is measured from
the learner's step times after `--warmup` steps. The last line is the headline: samples/s of the default (2)
over the synchronous setting (0).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.launched_runs import launch, learner_rows, parse_run_arguments, training_speed  # noqa: E402
from rlsys import evaluations  # noqa: E402
from rlsys.learner_figures import STALENESS_MEAN  # noqa: E402
from rlsys.metrics import LOGGED_AT, read_jsonl_metrics  # noqa: E402
from rlsys.run_files import logs_dir  # noqa: E402


def accuracy_over_time(run_dir: Path) -> list[tuple[int, float, float]]:
    """(version, seconds since the first step ended, held-out accuracy) of each evaluation."""
    start = learner_rows(run_dir)[0][LOGGED_AT]
    rows = read_jsonl_metrics(evaluations.records_path(logs_dir(run_dir)))
    return [(int(e[evaluations.VERSION]), max(row[LOGGED_AT] - start, 0.0), e[evaluations.ACCURACY])
            for row in rows if evaluations.ACCURACY in (e := evaluations.figures(row))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-steps", type=int, default=10, help="held-out evaluation every this many steps")
    parser.add_argument("--offpolicyness", default="0,1,2,4", help="max_head_offpolicyness values, comma-separated")
    args, out_dir = parse_run_arguments(parser, steps=40, out="bench/results/async_vs_sync.json")
    results = []
    for eta in [int(x) for x in args.offpolicyness.split(",")]:
        settings = [f"max_head_offpolicyness={eta}", f"max_steps={args.steps}", f"eval_steps={args.eval_steps}",
                    f"logging_steps={args.steps}", *args.overrides]
        run_dir, command, wall = launch(settings, out_dir, f"eta{eta}")
        results.append({"max_head_offpolicyness": eta, **training_speed(run_dir, args.warmup),
                        "accuracy": accuracy_over_time(run_dir), "command": " ".join(command), "wall_s": wall})
        print(f"  max_head_offpolicyness={eta}: {results[-1]['samples_per_second']:.1f} samples/s ({wall:.0f} s)",
              flush=True)

    print(f"default task, {args.steps} steps per run ({args.warmup} left out of samples/s), 16 prompts x 8 samples")
    print(f"{'eta':>3} {'samples/s':>10} {'s/step':>7} {'learner s':>10} {'wait s':>7} {'staleness':>9}  "
          "held-out accuracy (version @ seconds)")
    for r in results:
        curve = "  ".join(f"v{v} {100 * a:.1f}% @{t:.0f}s" for v, t, a in r["accuracy"])
        print(f"{r['max_head_offpolicyness']:>3} {r['samples_per_second']:>10.1f} {r['seconds_per_step']:>7.2f} "
              f"{r['learner_compute_s']:>10.2f} {r['learner_wait_s']:>7.2f} {r[STALENESS_MEAN]:>9.2f}  {curve}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    by_eta = {r["max_head_offpolicyness"]: r["samples_per_second"] for r in results}
    if 0 in by_eta and 2 in by_eta:
        print(f"ratio: trained samples/s at max_head_offpolicyness=2 / 0 = {by_eta[2] / by_eta[0]:.2f}")


if __name__ == "__main__":
    main()
