"""The learner's round trips to the bus, as they were and as they are, side by side: the prompt ledger's counts it logs
each step, and each pass of its wait for a batch.

    python3 bench/learner_round_trips.py [--reads 1000] [--repeats 5] [--out bench/results/learner_round_trips.json]

After each step the learner logs where the run's prompts stand (rlsys/workers/learner.py, `delivery_metrics`):
`PromptLedger.counts` (rlsys/prompt_ledger.py), on the learner's own thread, the role that bounds a default run. Over
a private Redis (a run's bus), with every outcome counted and prompts in flight, `--reads` reads a window:

- "a GET each": each outcome's counter with a `bus.get` of its own (12 round trips), then the two sets in flight
  (2 more), as `counts` did before 2026-12-07;
- "one MGET" and "one MGET, again": `PromptLedger.counts` as it is (the counters with one `bus.get_keys`, then the
  two sets), twice; their ratio is the noise between identical sides on this machine at this time.

Each pass of the learner's wait (`wait_for_batch`) reads whether the run is being stopped (protocol.STOP), asks
whether the bus server restarted (rlsys/delivery.py, TrajectoryInbox.receive: a restart may have lost entries it
handed out), then reads the trajectory stream. With one entry waiting for each pass (a small payload: what is
measured is the bus's part, not the message checks), `--reads` passes a window:

- "three trips": `bus.get(STOP)`, `bus.server_id()`, then `bus.stream_read`, as before 2026-12-07;
- "two trips" and "two trips, again": `bus.server_id_and_keys([STOP])`, then `bus.stream_read`, as now, twice.

Windows alternate, the order rotated each repeat; medians of the microseconds a read (a pass) takes, of this process's
CPU time (the machine is shared, so CPU time is the figure; Redis's own is not counted) and of wall time (what the
learner's thread waits). The last line is the headline: a GET each / one MGET, CPU time of a read of the counts.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys import protocol  # noqa: E402
from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.prompt_ledger import (_CARRIED, _IN_FLIGHT, ADMITTED, FAILURE_REASONS, FILTER_REASONS,  # noqa: E402
                                 TRAINED, PromptLedger, _outcome_key, failed, filtered)

STREAM, GROUP, CONSUMER = protocol.TRAJECTORIES, protocol.LEARNERS, "learner"


def a_get_each(ledger: PromptLedger) -> dict:
    """`counts` as it was before 2026-12-07."""
    bus = ledger.bus

    def by_reason(reasons, key):
        found = {reason: bus.get(_outcome_key(key(reason))) or 0 for reason in reasons}
        return {reason: n for reason, n in found.items() if n}

    return {ADMITTED: bus.get(_outcome_key(ADMITTED)) or 0, TRAINED: bus.get(_outcome_key(TRAINED)) or 0,
            "filtered": by_reason(FILTER_REASONS, filtered), "failed": by_reason(FAILURE_REASONS, failed),
            "in_flight": bus.set_size(_IN_FLIGHT) + bus.set_size(_CARRIED)}


COUNTS_SIDES = {"a GET each": a_get_each, "one MGET": PromptLedger.counts, "one MGET, again": PromptLedger.counts}
EXPECTED = {ADMITTED: len(FILTER_REASONS) + len(FAILURE_REASONS) + 3, TRAINED: 1,
            "filtered": dict.fromkeys(FILTER_REASONS, 1), "failed": dict.fromkeys(FAILURE_REASONS, 1), "in_flight": 2}


def three_trips(bus, server: str) -> list:
    if bus.get(protocol.STOP) or bus.server_id() != server:
        raise RuntimeError("a side read a stop or a restart: neither happened")
    return bus.stream_read(STREAM, GROUP, CONSUMER, 1, 0.5)


def two_trips(bus, server: str) -> list:
    if bus.server_id_and_keys([protocol.STOP]) != (server, [None]):
        raise RuntimeError("a side read a stop or a restart: neither happened")
    return bus.stream_read(STREAM, GROUP, CONSUMER, 1, 0.5)


WAIT_SIDES = {"three trips": three_trips, "two trips": two_trips, "two trips, again": two_trips}


def counted_ledger(bus) -> PromptLedger:
    """A ledger with each outcome counted once, one prompt trained and two still in flight (EXPECTED)."""
    ledger = PromptLedger(bus, 16, 1)
    ledger.start()
    outcomes = [filtered(r) for r in FILTER_REASONS] + [failed(r) for r in FAILURE_REASONS]
    for i in range(len(outcomes) + 3):
        ledger.admit(f"p{i}", 100)
    ledger.trained("p0")
    for i, outcome in enumerate(outcomes, start=1):
        ledger.untrained(f"p{i}", outcome)
    return ledger


def counts_window(ledger: PromptLedger, read, reads: int) -> tuple[float, float]:
    """(CPU, wall) microseconds a read of the counts takes, mean over `reads` reads."""
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(reads):
        if read(ledger) != EXPECTED:
            raise RuntimeError("a side read other counts than the ledger holds")
    return 1e6 * (time.process_time() - started_cpu) / reads, 1e6 * (time.perf_counter() - started) / reads


def wait_window(subject: tuple, read_pass, passes: int) -> tuple[float, float]:
    """(CPU, wall) microseconds a pass of the wait takes, mean over `passes` passes, each finding one entry waiting;
    `subject` is (the bus, its server's id)."""
    bus, server = subject
    for i in range(passes):
        bus.stream_add(STREAM, {"group_id": f"g{i}", "trajectories": []})
    read = []
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        read += read_pass(bus, server)
    cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
    if len(read) != passes:
        raise RuntimeError(f"a side read {len(read)} entries in {passes} passes, one waiting for each")
    bus.stream_ack(STREAM, GROUP, [entry.id for entry in read])
    return 1e6 * cpu / passes, 1e6 * wall / passes


def measure(subject, sides: dict, timed, reads: int, repeats: int) -> dict:
    """Windows of each of `sides` on `subject`, timed by `timed`, the order rotated."""
    windows = {name: {"cpu_us": [], "wall_us": []} for name in sides}
    timed(subject, list(sides.values())[1], reads // 4)  # warm-up: the connection, the scripts, the stream's group
    names = list(sides)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            cpu, wall = timed(subject, sides[name], reads)
            windows[name]["cpu_us"].append(cpu)
            windows[name]["wall_us"].append(wall)
    return windows


def report(title: str, windows: dict) -> dict:
    """Prints the table; the medians, identical sides and before / after, of CPU time (and of wall time)."""
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    before, after, again = medians
    print(title)
    print(f"{'side':<17} {'CPU us':>7} {'wall us':>8}   CPU us of each window")
    for name, m in medians.items():
        print(f"{name:<17} {m['cpu_us']:>7.1f} {m['wall_us']:>8.1f}   "
              + " ".join(f"{us:.1f}" for us in windows[name]["cpu_us"]))
    result = {"windows": windows, "medians": medians,
              "identical_sides": medians[again]["cpu_us"] / medians[after]["cpu_us"],
              "ratio": medians[before]["cpu_us"] / medians[after]["cpu_us"],
              "wall_ratio": medians[before]["wall_us"] / medians[after]["wall_us"]}
    print(f"identical sides ({again} / {after}), CPU time: {result['identical_sides']:.3f}; {before} / {after}: "
          f"{result['ratio']:.3f} CPU time, {result['wall_ratio']:.3f} wall time")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=1000, help="reads of the counts (passes of the wait) a window")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--out", default="bench/results/learner_round_trips.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        bus = connect(server.url)
        counts = measure(counted_ledger(bus), COUNTS_SIDES, counts_window, args.reads, args.repeats)
        passes = measure((bus, bus.server_id()), WAIT_SIDES, wait_window, args.reads, args.repeats)
        bus.close()
    print(f"{args.reads} reads (passes) a window, {args.repeats} windows a side")
    results = {"counts": report("the ledger's counts, each step", counts),
               "wait": report("a pass of the wait for a batch", passes)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), **results}, indent=2))
    print(f"ratio: {results['counts']['ratio']:.2f} (a GET each / one MGET, CPU time of a read of the counts; "
          f"the wait's pass, three trips / two trips: {results['wait']['ratio']:.2f})")


if __name__ == "__main__":
    main()
