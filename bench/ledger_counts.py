"""The prompt ledger's counts read a round trip a counter, as before, and in one, as now, side by side.

    python3 bench/ledger_counts.py [--reads 1000] [--repeats 5] [--out bench/results/ledger_counts.json]

After each step the learner logs where the run's prompts stand (rlsys/workers/learner.py, `delivery_metrics`):
`PromptLedger.counts` (rlsys/prompt_ledger.py), on the learner's own thread, the role that bounds a default run. Over
a private Redis (a run's bus), with every outcome counted and prompts in flight, `--reads` reads a window:

- "a GET each": each outcome's counter with a `bus.get` of its own (12 round trips), then the two sets in flight
  (2 more), as `counts` did before 2026-12-07;
- "one MGET" and "one MGET, again": `PromptLedger.counts` as it is (the counters with one `bus.get_keys`, then the
  two sets), twice; their ratio is the noise between identical sides on this machine at this time.

Windows alternate, the order rotated each repeat; medians of the microseconds a read takes, of this process's CPU
time (the machine is shared, so CPU time is the figure; Redis's own is not counted) and of wall time (what the
learner's thread waits). The last line is the headline: a GET each / one MGET, CPU time.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.prompt_ledger import (_CARRIED, _IN_FLIGHT, ADMITTED, FAILURE_REASONS, FILTER_REASONS,  # noqa: E402
                                 TRAINED, PromptLedger, _outcome_key, failed, filtered)


def a_get_each(ledger: PromptLedger) -> dict:
    """`counts` as it was before 2026-12-07."""
    bus = ledger.bus

    def by_reason(reasons, key):
        found = {reason: bus.get(_outcome_key(key(reason))) or 0 for reason in reasons}
        return {reason: n for reason, n in found.items() if n}

    return {ADMITTED: bus.get(_outcome_key(ADMITTED)) or 0, TRAINED: bus.get(_outcome_key(TRAINED)) or 0,
            "filtered": by_reason(FILTER_REASONS, filtered), "failed": by_reason(FAILURE_REASONS, failed),
            "in_flight": bus.set_size(_IN_FLIGHT) + bus.set_size(_CARRIED)}


SIDES = {"a GET each": a_get_each, "one MGET": PromptLedger.counts, "one MGET, again": PromptLedger.counts}


def counted_ledger(bus) -> PromptLedger:
    """A ledger with each outcome counted once, one prompt trained and two still in flight."""
    ledger = PromptLedger(bus, 16, 1)
    ledger.start()
    outcomes = [filtered(r) for r in FILTER_REASONS] + [failed(r) for r in FAILURE_REASONS]
    for i in range(len(outcomes) + 3):
        ledger.admit(f"p{i}", 100)
    ledger.trained("p0")
    for i, outcome in enumerate(outcomes, start=1):
        ledger.untrained(f"p{i}", outcome)
    return ledger


def window(ledger: PromptLedger, read, reads: int, expected: dict) -> tuple[float, float]:
    """(CPU, wall) microseconds a read takes, mean over `reads` reads."""
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(reads):
        if read(ledger) != expected:
            raise RuntimeError("a side read other counts than the ledger holds")
    return 1e6 * (time.process_time() - started_cpu) / reads, 1e6 * (time.perf_counter() - started) / reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=1000, help="reads a window")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--out", default="bench/results/ledger_counts.json")
    args = parser.parse_args()
    windows = {name: {"cpu_us": [], "wall_us": []} for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        bus = connect(server.url)
        ledger = counted_ledger(bus)
        expected = {ADMITTED: len(FILTER_REASONS) + len(FAILURE_REASONS) + 3, TRAINED: 1,
                    "filtered": dict.fromkeys(FILTER_REASONS, 1), "failed": dict.fromkeys(FAILURE_REASONS, 1),
                    "in_flight": 2}
        window(ledger, PromptLedger.counts, args.reads // 4, expected)  # warm-up: the connection
        names = list(SIDES)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                cpu, wall = window(ledger, SIDES[name], args.reads, expected)
                windows[name]["cpu_us"].append(cpu)
                windows[name]["wall_us"].append(wall)
        bus.close()
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    print(f"{args.reads} reads a window, {args.repeats} windows a side")
    print(f"{'side':<16} {'CPU us':>7} {'wall us':>8}   CPU us of each window")
    for name, m in medians.items():
        print(f"{name:<16} {m['cpu_us']:>7.1f} {m['wall_us']:>8.1f}   "
              + " ".join(f"{us:.1f}" for us in windows[name]["cpu_us"]))
    same = medians["one MGET, again"]["cpu_us"] / medians["one MGET"]["cpu_us"]
    ratio = medians["a GET each"]["cpu_us"] / medians["one MGET"]["cpu_us"]
    wall = medians["a GET each"]["wall_us"] / medians["one MGET"]["wall_us"]
    print(f"identical sides (one MGET, again / one MGET), CPU time: {same:.3f}; wall time, a GET each / one MGET: "
          f"{wall:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": windows, "medians": medians,
                                          "identical_sides": same, "wall_ratio": wall, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.2f} (a GET each / one MGET, CPU time of a read of the counts)")


if __name__ == "__main__":
    main()
