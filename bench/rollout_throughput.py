"""Rollout throughput: generated tokens per second through the whole rollout path vs the engine alone.

    python3 bench/rollout_throughput.py [--episodes 640] [--concurrency 64] [--repeats 3] [key=value ...]
    python3 bench/rollout_throughput.py --tracing [...]   # the full path with every episode traced vs none

Same prompts (the default run's training set, in the rollout worker's order) and settings (the default
experiment: math-single-step, 8 samples per prompt, up to 8 new tokens, temperature 1) on both sides:

- engine alone: a GenerationEngine on vLLM in this process, `concurrency` requests kept in flight, with the
  inference worker's thread setting (`inference.num_threads`);
- full path: a private Redis, inference worker process(es) and a real rollout worker process running
  `concurrency` episodes at once (agent, math env, episode router, bus); trajectories are read off the bus.

Windows of `episodes` finished requests (engine) or episodes (full path) alternate, `repeats` times each,
after a warm-up. Both sides are timed in steady state: a window starts with `concurrency` requests or
episodes in flight and ends with as many unfinished (the full path's pipeline is refilled, untimed, before
each window). While the engine alone is timed, the full path is paused by closing its admission gate, so
the two never share the machine; the ratio is of the medians. The last line is the headline: the full
path's throughput with one inference worker over the engine's.

`--tracing`: two full paths side by side instead (one inference worker each), one recording every episode
as a trace (`trace.sample_rate=1.0`) and one recording none (0), their windows alternating while the other
is paused; the headline is traced over untraced.
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys import protocol  # noqa: E402
from rlsys.assets import prepare_assets  # noqa: E402
from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.cli import config_to_dict, parse_config  # noqa: E402
from rlsys.data.dataset import load_rows, write_jsonl  # noqa: E402
from rlsys.data.prompts import prompt_stream  # noqa: E402
from rlsys.run_start import initialize_bus_state  # noqa: E402
from rlsys.placement.local import LocalPlacement  # noqa: E402
from rlsys.metrics import read_jsonl_metrics, records_file, rollout_records  # noqa: E402
from rlsys.model.tokenizer import load_tokenizer  # noqa: E402
from rlsys.prompt_ledger import PromptLedger  # noqa: E402
from rlsys.roles import limit_threads, run_role  # noqa: E402
from rlsys.run_files import logs_dir  # noqa: E402
from rlsys.supervisor import stop_processes  # noqa: E402
from rlsys.tracing import read_traces  # noqa: E402
from rlsys.workers.routing import LATENCY_P50, LATENCY_P99, RESENT  # noqa: E402

WARM_UP_EPISODES = 64
EVAL_ROWS = 16  # the rollout worker evaluates before it trains; a small held-out file keeps that short
GATE_CLOSED = 10**15  # an admitted-prompt count no staleness limit allows


class EngineAlone:
    """The engine with `concurrency` requests in flight, fed from the same prompt stream as the rollout worker."""

    def __init__(self, config, concurrency: int):
        from rlsys.engine.generation import GenerationEngine
        from rlsys.engine.vllm_engine import VLLMBackend

        limit_threads(config.inference.num_threads)  # as the inference worker does: the same engine on both sides
        self.engine = GenerationEngine(VLLMBackend(config.model.path, config.inference, config.seed))
        rows = load_rows(config.dataset.path)
        self.prompts = prompt_stream(rows, load_tokenizer(config.model.path), "train", seed=config.seed, shuffle=True)
        self.gconfig, self.concurrency = config.agent.args["gconfig"], concurrency

    def generated_tokens(self, requests: int) -> int:
        """Runs until `requests` more requests finished, refilling as they finish; their generated tokens."""
        finished = tokens = 0
        while finished < requests:
            while self.engine.in_flight < self.concurrency:
                prompt = next(self.prompts)
                self.engine.add_request(prompt.qid, prompt.token_ids, self.gconfig)
            for output in self.engine.step():
                finished += 1
                tokens += sum(len(ids) for ids in output.output_ids)
        return tokens


class FullPath:
    """A private Redis, inference worker(s) and a rollout worker; paused and resumed through the admission gate."""

    def __init__(self, config, n_workers: int, concurrency: int, run_dir: Path):
        self.config = dataclasses.replace(config, max_concurrent_rollouts=concurrency, max_head_offpolicyness=10**9,
                                          logging_dir=str(logs_dir(run_dir)))
        self.config.cluster = dataclasses.replace(config.cluster, n_inference_workers=n_workers)
        self.run_dir, self.n_workers, self.concurrency = run_dir, n_workers, concurrency

    @contextlib.contextmanager
    def running(self):
        with EmbeddedRedis(self.run_dir / "redis") as server:
            self.bus = connect(server.url)
            initialize_bus_state(self.bus, self.config, trainer_state={})
            self.ledger = PromptLedger.of(self.bus, self.config)
            self.ledger.hold_slots(GATE_CLOSED)
            roles = [("inference", i) for i in range(self.n_workers)] + [("rollout", 0)]
            placement = LocalPlacement(self.config, run_role)
            args = (config_to_dict(self.config), server.url, str(self.run_dir))
            processes = {(role, i): placement.start(role, i, args) for role, i in roles}
            try:
                yield self
            finally:
                stop_processes(self.bus, processes.values(), self.config.cluster.stop_grace_seconds)
                self.bus.close()

    def tokens_per_second(self, episodes: int) -> float:
        """Opens the gate, times `episodes` episodes with the pipeline full, and closes the gate again.

        The first `concurrency` episodes only fill the pipeline and are not timed: the engine alone is timed
        with its requests already in flight (it is never drained), so both sides start a window full and
        end it with work in flight. Timing the fill too charged the full path a pipeline's worth of latency.
        """
        self.ledger.hold_slots(0)
        self.generated_tokens(self.concurrency)
        rate = tokens_per_second(self.generated_tokens, episodes)
        self.ledger.hold_slots(GATE_CLOSED)
        return rate

    def generated_tokens(self, episodes: int) -> int:
        return sum(self.take_episode() for _ in range(episodes))

    def take_episode(self) -> int:
        """Generated tokens of the next episode on the trajectory stream, read as the learner would."""
        while not (entries := self.bus.stream_read(protocol.TRAJECTORIES, protocol.LEARNERS, "bench", 1, 60)):
            pass
        self.bus.stream_ack(protocol.TRAJECTORIES, protocol.LEARNERS, [entries[0].id])
        message = entries[0].decode(protocol.TRAJECTORIES)
        return sum(sum(t["loss_mask"]) for t in message["trajectories"])

    def drain(self) -> None:
        """Waits until every admitted episode has finished, then drops what they produced."""
        while any((self.bus.get(protocol.inference_status(i)) or {"load": 1})["load"] for i in range(self.n_workers)):
            time.sleep(0.05)
        time.sleep(0.5)  # the last replies reach their episodes, which finish and post trajectories
        while self.bus.stream_length(protocol.TRAJECTORIES):
            self.take_episode()

    def latencies(self) -> tuple[float, float]:
        records = read_jsonl_metrics(records_file(logs_dir(self.run_dir), rollout_records(0)))
        (routing,) = [r for r in records if RESENT in r]
        return routing[LATENCY_P50], routing[LATENCY_P99]


def alternate_windows(path: FullPath, alone: EngineAlone, args, engine_rates: list[float]) -> list[float]:
    """After a warm-up (`args.warm_up` episodes), `repeats` windows of the engine alone (appended to
    `engine_rates`) and of the path, in turn; the path's rates."""
    warm_up(path, args.warm_up)
    rates = []
    for _ in range(args.repeats):
        engine_rates.append(tokens_per_second(alone.generated_tokens, args.episodes))
        rates.append(path.tokens_per_second(args.episodes))
        # As they come: a long run cut short (a timeout) still shows the windows it measured.
        print(f"window: engine alone {engine_rates[-1]:.0f}, path {rates[-1]:.0f} tokens/s", flush=True)
        path.drain()
    return rates


def model_label(config) -> str:
    """What the table names as the model: the `model.path` given, or the default tiny model (before
    prepare_assets fills the path in)."""
    return f"model {config.model.path}" if config.model.path else "default tiny model"


def warm_up(path: FullPath, episodes: int) -> None:
    """`episodes` untimed episodes after a pipeline fill, then a drain. It also waits out the path's start
    (vLLM's, the rollout worker's evaluation), which must not overlap the engine alone's first window: in a run
    without it (2026-11-26, SmolLM2, other load beside it) that window measured a third of the queue path's."""
    path.tokens_per_second(episodes)
    path.drain()


def print_table(args, config, results: dict[str, dict], model: str) -> None:
    """The settings, then per path its median tokens/s, request latencies (where measured) and every window."""
    print(f"windows of {args.episodes} episodes, {args.concurrency} in flight, {args.repeats} per side, "
          f"{args.warm_up} warm-up episodes per path, {model}, "
          f"{config.group_size} samples x up to {config.gen.max_new_tokens} tokens each, "
          f"{config.inference.num_threads or 'engine-chosen'} thread(s) per engine")
    width = max(len(name) for name in results) + 2
    print(f"{'path':<{width}} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8}   windows")
    for name, row in results.items():
        p50, p99 = (f"{1000 * row[k]:8.1f}" if k in row else f"{'-':>8}" for k in ("latency_p50", "latency_p99"))
        windows = " ".join(f"{rate:.0f}" for rate in row["windows"])
        print(f"{name:<{width}} {row['tokens_per_second']:>9.0f} {p50} {p99}   {windows}")


def tokens_per_second(measure, units: int) -> float:
    started = time.perf_counter()
    tokens = measure(units)
    return tokens / (time.perf_counter() - started)


def tracing_cost(config, args, tmp: Path) -> None:
    """Throughput of the full path with every training episode traced against none, windows alternating."""
    paths = {name: FullPath(dataclasses.replace(config, trace=dataclasses.replace(config.trace, sample_rate=rate)),
                            1, args.concurrency, tmp / name) for name, rate in (("untraced", 0.0), ("traced", 1.0))}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    with paths["untraced"].running(), paths["traced"].running():
        for path in paths.values():
            warm_up(path, args.warm_up)
        for _ in range(args.repeats):
            for name, path in paths.items():
                rates[name].append(path.tokens_per_second(args.episodes))
                path.drain()
    traces = len(read_traces(tmp / "traced"))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratio = medians["traced"] / medians["untraced"]
    print(f"windows of {args.episodes} episodes, {args.concurrency} in flight, {args.repeats} per side; "
          f"{traces} episodes traced on the traced path")
    print(f"{'path':<34} {'tokens/s':>9}   windows")
    for name, r in rates.items():
        label = f"full path, trace.sample_rate={1.0 if name == 'traced' else 0.0}"
        print(f"{label:<34} {medians[name]:>9.0f}   " + " ".join(f"{rate:.0f}" for rate in r))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": rates, "medians": medians,
                                          "traces": traces, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.3f} (traced / untraced tokens per second)")


def parse_arguments(doc: str, episodes: int, out: str, *extra: tuple[str, dict]) -> argparse.Namespace:
    """The benches' common arguments, and `extra` ones given as (flag, argparse keywords)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, options in extra:
        parser.add_argument(flag, **options)
    parser.add_argument("--episodes", type=int, default=episodes, help="timed episodes (requests) per window")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes (requests) in flight")
    parser.add_argument("--repeats", type=int, default=3, help="windows per side")
    parser.add_argument("--warm-up", type=int, default=WARM_UP_EPISODES,
                        help="untimed episodes each path runs before its first window, beside each window's "
                             "pipeline fill (at least 1: the warm-up also waits out the path's start)")
    parser.add_argument("--out", default=out)
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value (e.g. inference.num_threads=0)")
    args = parser.parse_args()
    if args.warm_up < 1:
        parser.error(f"--warm-up must be at least 1, got {args.warm_up}")
    return args


def main() -> None:
    args = parse_arguments(__doc__, 640, "", ("--tracing", dict(
        action="store_true", help="traced (sample rate 1.0) vs untraced full path")))

    config = parse_config(args.overrides)
    model = model_label(config)
    prepare_assets(config)
    results: dict[str, dict] = {}
    engine_rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config.dataset.eval_path = str(write_jsonl(load_rows(config.dataset.eval_path)[:EVAL_ROWS],
                                                   tmp / "eval.jsonl"))
        if args.tracing:
            args.out = args.out or "bench/results/rollout_tracing.json"
            return tracing_cost(config, args, tmp)
        args.out = args.out or "bench/results/rollout_throughput.json"
        alone = EngineAlone(config, args.concurrency)
        alone.generated_tokens(WARM_UP_EPISODES)
        for n_workers in (1, 2):
            with FullPath(config, n_workers, args.concurrency, tmp / f"run{n_workers}").running() as path:
                rates = alternate_windows(path, alone, args, engine_rates)
            p50, p99 = path.latencies()
            results[f"full path, {n_workers} inference worker(s)"] = {
                "tokens_per_second": statistics.median(rates), "windows": rates, "latency_p50": p50, "latency_p99": p99}
    results["engine alone"] = {"tokens_per_second": statistics.median(engine_rates), "windows": engine_rates}

    reference = results["engine alone"]["tokens_per_second"]
    ratios = {n: results[f"full path, {n} inference worker(s)"]["tokens_per_second"] / reference for n in (1, 2)}
    print_table(args, config, results, model)
    print(f"ratio with 2 inference workers: {ratios[2]:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "ratio_1_worker": ratios[1],
                                          "ratio_2_workers": ratios[2]}, indent=2))
    print(f"ratio: {ratios[1]:.3f}")


if __name__ == "__main__":
    main()
