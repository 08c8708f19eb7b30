"""A pass of the learner's wait for a batch: three round trips to the bus, as before, and two, as now, side by side.

    python3 bench/learner_wait.py [--passes 1000] [--repeats 5] [--out bench/results/learner_wait.json]

Each pass of the learner's wait (rlsys/workers/learner.py, `wait_for_batch`) reads whether the run is being stopped
(protocol.STOP), then its inbox asks whether the bus server restarted (rlsys/delivery.py, TrajectoryInbox.receive: a
restart may have lost entries it handed out), then reads the trajectory stream. Over a private Redis (a run's bus),
with one entry waiting for each pass (a small payload: what is measured is the bus's part, not the message checks),
`--passes` passes a window, on this thread, as the learner makes them:

- "three trips": `bus.get(STOP)`, `bus.server_id()`, then `bus.stream_read`, as before 2026-12-07;
- "two trips" and "two trips, again": `bus.server_id_and_keys([STOP])`, then `bus.stream_read`, as now, twice; their
  ratio is the noise between identical sides on this machine at this time.

Windows alternate, the order rotated each repeat; medians of the microseconds a pass takes, of this process's CPU time
(the machine is shared, so CPU time is the figure; Redis's own is not counted) and of wall time (what the learner's
thread waits). The last line is the headline: three trips / two trips, CPU time.
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

STREAM, GROUP, CONSUMER = protocol.TRAJECTORIES, protocol.LEARNERS, "learner"


def three_trips(bus, server: str) -> list:
    if bus.get(protocol.STOP) or bus.server_id() != server:
        raise RuntimeError("a side read a stop or a restart: neither happened")
    return bus.stream_read(STREAM, GROUP, CONSUMER, 1, 0.5)


def two_trips(bus, server: str) -> list:
    if bus.server_id_and_keys([protocol.STOP]) != (server, [None]):
        raise RuntimeError("a side read a stop or a restart: neither happened")
    return bus.stream_read(STREAM, GROUP, CONSUMER, 1, 0.5)


SIDES = {"three trips": three_trips, "two trips": two_trips, "two trips, again": two_trips}


def window(bus, server: str, read_pass, passes: int) -> tuple[float, float]:
    """(CPU, wall) microseconds a pass takes, mean over `passes` passes, each finding one entry waiting."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=1000, help="passes a window")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--out", default="bench/results/learner_wait.json")
    args = parser.parse_args()
    windows = {name: {"cpu_us": [], "wall_us": []} for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        bus = connect(server.url)
        server_id = bus.server_id()
        window(bus, server_id, two_trips, args.passes // 4)  # warm-up: the connection, the scripts, the group
        names = list(SIDES)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                cpu, wall = window(bus, server_id, SIDES[name], args.passes)
                windows[name]["cpu_us"].append(cpu)
                windows[name]["wall_us"].append(wall)
        bus.close()
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    print(f"{args.passes} passes a window, {args.repeats} windows a side")
    print(f"{'side':<17} {'CPU us':>7} {'wall us':>8}   CPU us of each window")
    for name, m in medians.items():
        print(f"{name:<17} {m['cpu_us']:>7.1f} {m['wall_us']:>8.1f}   "
              + " ".join(f"{us:.1f}" for us in windows[name]["cpu_us"]))
    same = medians["two trips, again"]["cpu_us"] / medians["two trips"]["cpu_us"]
    ratio = medians["three trips"]["cpu_us"] / medians["two trips"]["cpu_us"]
    wall = medians["three trips"]["wall_us"] / medians["two trips"]["wall_us"]
    print(f"identical sides (two trips, again / two trips), CPU time: {same:.3f}; wall time, three trips / two trips: "
          f"{wall:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": windows, "medians": medians,
                                          "identical_sides": same, "wall_ratio": wall, "ratio": ratio}, indent=2))
    print(f"ratio: {ratio:.2f} (three trips / two trips, CPU time of a pass of the learner's wait)")


if __name__ == "__main__":
    main()
