"""Endpoint throughput: generated tokens per second through the OpenAI-compatible endpoint vs the queue path vs
the engine alone, in one run.

    python3 bench/endpoint_throughput.py [--episodes 256] [--concurrency 64] [--repeats 3]
        [--only-endpoint] [key=value ...]

The same prompts and settings on every side (the default experiment's: 8 samples per prompt, up to 8 new
tokens, temperature 1, the default tiny model), set up as bench/rollout_throughput.py does. An agent's
workload is closer with a real chat model and longer answers, given as overrides that every side takes:

    python3 -m rlsys.model.convert smollm2 /tmp/smollm2     # SmolLM2-135M-Instruct, about a minute
    python3 bench/endpoint_throughput.py --episodes 32 --repeats 1 --warm-up 1 model.path=/tmp/smollm2 \
        gen.max_new_tokens=64 inference.max_model_len=512 group_size=4

- engine alone: a GenerationEngine on vLLM in this process, `concurrency` requests (8 samples each) in flight;
- queue path: Redis, one inference worker, a rollout worker running `concurrency` math-single-step episodes;
- endpoint path: the same, with `openai-agent` episodes: per prompt, 8 runs of rlsys/impl/agent/openai_example.py
  (the real `openai` client, one chat call each, its own API key) over HTTP to the rollout worker's endpoint,
  the answer scored by the env. Its requests are n=1 each, 8 per episode, where the queue path asks n=8 once.

Windows alternate (engine alone, then a path), `repeats` times per path, each path timed in steady state with
its pipeline full; the ratios are of the medians. The last line is the headline: the endpoint path over the
engine alone.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_throughput import (EVAL_ROWS, WARM_UP_EPISODES, EngineAlone, FullPath,  # noqa: E402
                                alternate_windows, model_label, parse_arguments, print_table)

from rlsys.assets import prepare_assets  # noqa: E402
from rlsys.cli import parse_config  # noqa: E402
from rlsys.data.dataset import load_rows, write_jsonl  # noqa: E402

ENDPOINT = ["experiment=async-ppo-openai-agent", "agent_function=rlsys.impl.agent.openai_example:run"]


def main() -> None:
    args = parse_arguments(__doc__, 256, "bench/results/endpoint_throughput.json", ("--only-endpoint", dict(
        action="store_true", help="the endpoint path and the engine alone only (quick iteration; no queue path)")))

    configs = {"queue path": parse_config(args.overrides), "endpoint path": parse_config(args.overrides + ENDPOINT)}
    if args.only_endpoint:
        del configs["queue path"]
    model = model_label(configs["endpoint path"])
    for config in configs.values():
        prepare_assets(config)
    results: dict[str, dict] = {}
    engine_rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        eval_path = str(write_jsonl(load_rows(configs["endpoint path"].dataset.eval_path)[:EVAL_ROWS],
                                    tmp / "eval.jsonl"))
        alone = EngineAlone(configs["endpoint path"], args.concurrency)
        alone.generated_tokens(WARM_UP_EPISODES)
        for name, config in configs.items():
            config.dataset.eval_path = eval_path
            with FullPath(config, 1, args.concurrency, tmp / name.replace(" ", "-")).running() as path:
                rates = alternate_windows(path, alone, args, engine_rates)
            p50, p99 = path.latencies()
            results[name] = {"tokens_per_second": statistics.median(rates), "windows": rates, "latency_p50": p50,
                             "latency_p99": p99}
    results["engine alone"] = {"tokens_per_second": statistics.median(engine_rates), "windows": engine_rates}

    reference = results["engine alone"]["tokens_per_second"]
    ratios = {name: results[name]["tokens_per_second"] / reference for name in configs}
    print_table(args, configs["endpoint path"], results, model)
    if "queue path" in ratios:
        print(f"queue path / engine alone: {ratios['queue path']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "model": model, "results": results, "ratios": ratios},
                                         indent=2))
    print(f"ratio: {ratios['endpoint path']:.3f} (endpoint path / engine alone)")


if __name__ == "__main__":
    main()
