"""Adding requests to vLLM: VLLMBackend.add as it is against one that lets vLLM deep-copy each request's parameters.

    python3 bench/request_adds.py [--episodes 320] [--concurrency 64] [--repeats 3]
                                  [--out bench/results/request_adds.json] [key=value ...]

The inference worker adds each sample of a request to vLLM as a request of its own, and each sample a weight update
interrupted again (rlsys/engine/generation.py). Three sides share one engine (bench/rollout_throughput.py's
EngineAlone: the default run's prompts and settings, `concurrency` requests in flight, the inference worker's threads)
and take windows of `episodes` finished requests in turn, the order rotated each repeat:

- "deep copy": the add of before 2026-12-07: parameters vLLM deep-copies (`skip_clone` unset), and vLLM's names looked
  up through its package's lazy attributes at each call;
- "as added" and "as added, again": VLLMBackend.add as it is, twice; their ratio is the noise between two identical
  sides on this machine at this time.

Each window gives generated tokens per second of wall time and of the process's CPU time, and the CPU microseconds the
engine's thread spent inside `add` per sample added: CPU time, since on a machine shared with other work a window's
wall time moves with the load more than with what it computes. Medians are reported. The last line is the headline:
the CPU time of an add, deep copy / as added.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout_throughput import WARM_UP_EPISODES, EngineAlone, parse_arguments  # noqa: E402
from rlsys.assets import prepare_assets  # noqa: E402
from rlsys.cli import parse_config  # noqa: E402
from rlsys.engine.backend import SamplingSettings  # noqa: E402
from rlsys.engine.vllm_engine import VLLMBackend  # noqa: E402

AS_ADDED = VLLMBackend.add


def deep_copied_add(self, seq_id: str, token_ids: list[int], sampling: SamplingSettings, arrival: float = 0.0) -> None:
    """VLLMBackend.add before 2026-12-07 (its error handling left out: no request here is refused)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=0,
        output_kind=RequestOutputKind.DELTA, detokenize=False)
    self.engine.add_request(seq_id, TokensPrompt(prompt_token_ids=list(token_ids)), params, arrival_time=arrival)
    self._running.add(seq_id)


SIDES = {"deep copy": deep_copied_add, "as added": AS_ADDED, "as added, again": AS_ADDED}


def window(alone: EngineAlone, add, episodes: int) -> dict[str, float]:
    """One window of `episodes` finished requests: generated tokens per second of wall time and per second of the
    process's CPU time, and the CPU microseconds spent inside `add` per sample added (the engine's thread's own)."""
    spent = [0.0, 0]  # CPU seconds in add, samples added

    def timed(backend, *args, **kwargs) -> None:
        started = time.thread_time()
        add(backend, *args, **kwargs)
        spent[0] += time.thread_time() - started
        spent[1] += 1

    VLLMBackend.add = timed
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = alone.generated_tokens(episodes)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        VLLMBackend.add = AS_ADDED
    return {"tokens_per_second": tokens / wall, "tokens_per_cpu_second": tokens / cpu,
            "add_cpu_us": 1e6 * spent[0] / max(spent[1], 1)}


def main() -> None:
    args = parse_arguments(__doc__, 320, "bench/results/request_adds.json")
    config = parse_config(args.overrides)
    prepare_assets(config)
    alone = EngineAlone(config, args.concurrency)
    alone.generated_tokens(max(args.warm_up, WARM_UP_EPISODES))
    measures = ("tokens_per_second", "tokens_per_cpu_second", "add_cpu_us")
    windows: dict[str, dict[str, list[float]]] = {name: {m: [] for m in measures} for name in SIDES}
    names = list(SIDES)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            for measure, value in window(alone, SIDES[name], args.episodes).items():
                windows[name][measure].append(value)
    medians = {name: {m: statistics.median(values) for m, values in w.items()} for name, w in windows.items()}
    print(f"windows of {args.episodes} requests, {args.concurrency} in flight, {args.repeats} per side")
    print(f"{'side':<16} {'tokens/s':>9} {'tokens/CPU s':>12} {'CPU us/add':>10}   CPU us/add of each window")
    for name, m in medians.items():
        print(f"{name:<16} {m['tokens_per_second']:>9.0f} {m['tokens_per_cpu_second']:>12.0f} "
              f"{m['add_cpu_us']:>10.0f}   " + " ".join(f"{us:.0f}" for us in windows[name]["add_cpu_us"]))
    same = {m: medians["as added, again"][m] / medians["as added"][m] for m in measures}
    print("identical sides (as added, again / as added): "
          + ", ".join(f"{m} {ratio:.3f}" for m, ratio in same.items()))
    cpu_ratio = medians["as added"]["tokens_per_cpu_second"] / medians["deep copy"]["tokens_per_cpu_second"]
    print(f"tokens per CPU second, as added / deep copy: {cpu_ratio:.3f}")
    ratio = medians["deep copy"]["add_cpu_us"] / medians["as added"]["add_cpu_us"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": windows, "medians": medians,
                                          "identical_sides": same, "tokens_per_cpu_second_ratio": cpu_ratio,
                                          "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.3f} (CPU time of an add, deep copy / as added)")


if __name__ == "__main__":
    main()
