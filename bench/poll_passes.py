"""Polls of the bus, as they were and as they are, side by side: the rollout worker's loop asking whether to go on,
the learner's inbox asking whether Redis restarted, the rollout worker's router watching the inference workers.

    python3 bench/poll_passes.py [--passes 2000] [--repeats 5] [--out bench/results/poll_passes.json]

Each pass of the rollout worker's train loop (rlsys/workers/rollout_worker.py, `train`) first reads whether the
learner is done (protocol.LEARNER_DONE) and whether the run is being stopped (protocol.STOP), from an asyncio event
loop, over the run's Redis. Over a private Redis, in an event loop, `--passes` passes a window:

- "a call each": `bus.get` of each key in a thread of its own (`asyncio.to_thread`), as the loop did before 2026-12-07:
  two round trips and two thread hops;
- "one call" and "one call, again": `bus.get_keys` of both in one thread hop, as it does now, twice; their ratio is the
  noise between identical sides on this machine at this time.

Windows alternate, the order rotated each repeat; medians of the microseconds a pass takes, of this process's CPU time
(the event loop's thread and the pool thread together; the machine is shared, so CPU time is the figure) and of wall
time. Redis's own CPU is not counted. The last line is the headline: a call each / one call, CPU time.

The learner's inbox asks the bus for its server's id before each read (rlsys/delivery.py, TrajectoryInbox.receive: a
restart may have lost entries it handed out). `--passes` asks a window, on this thread, as the learner does:

- "INFO parsed": INFO's server section, parsed by redis-py, and its run_id, as RedisBus.server_id did before 2026-12-07;
- "run id alone": a script of its own that sends back the run id alone, as RedisBus.server_id did until the cleanup of
  2026-12-07;
- "run id" and "run id, again": RedisBus.server_id as it is (Bus.server_id_and_keys with no keys: the script that sends
  back the run id and the keys' values), twice. The table's ratio is run id alone / run id.

The rollout worker's router reads the inference workers' statuses and asks whether Redis restarted every
REFRESH_INTERVAL (rlsys/workers/routing.py, EpisodeRouter.watch_workers), in an event loop:

- "a hop each": each in a thread hop of its own, as before 2026-12-07;
- "one hop" and "one hop, again": both in one hop (EpisodeRouter.look_at_the_bus), as now.

Within that hop, InferenceWorkers.refresh reads each inference worker's status key. With `--workers` 2 and 4 (each
status published), `--passes` reads of all of them a window, on this thread:

- "a GET each": each with InferenceStatus.read, a round trip each, as before 2026-12-07;
- "one MGET" and "one MGET, again": all with read_statuses, one round trip, as now.
"""

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys import protocol  # noqa: E402
from rlsys.bus import EmbeddedRedis, RedisBus, connect  # noqa: E402
from rlsys.api.messages import WorkerStatus  # noqa: E402
from rlsys.workers.inference_status import InferenceStatus, read_statuses  # noqa: E402
from rlsys.workers.routing import EpisodeRouter  # noqa: E402


async def a_call_each(bus) -> bool:
    return not await asyncio.to_thread(bus.get, protocol.LEARNER_DONE) and \
        not await asyncio.to_thread(bus.get, protocol.STOP)


async def one_call(bus) -> bool:
    return not any(await asyncio.to_thread(bus.get_keys, [protocol.LEARNER_DONE, protocol.STOP]))


SIDES = {"a call each": a_call_each, "one call": one_call, "one call, again": one_call}


def info_parsed(bus) -> str:
    return bus._client.info("server")["run_id"]


RUN_ID_ALONE = "return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')"


@functools.cache
def run_id_alone_script(client):
    return client.register_script(RUN_ID_ALONE)  # sent by its hash, as RedisBus's scripts are


def run_id_alone(bus) -> str:
    return run_id_alone_script(bus._client)().decode()


SERVER_ID_SIDES = {"INFO parsed": info_parsed, "run id alone": run_id_alone, "run id": RedisBus.server_id,
                   "run id, again": RedisBus.server_id}


async def a_hop_each(router: EpisodeRouter) -> bool:
    await asyncio.to_thread(router.workers.refresh)
    return not await asyncio.to_thread(router.server_restarts.happened)


async def one_hop(router: EpisodeRouter) -> bool:
    return not await asyncio.to_thread(router.look_at_the_bus)


ROUTER_SIDES = {"a hop each": a_hop_each, "one hop": one_hop, "one hop, again": one_hop}


def a_get_each(statuses: list[InferenceStatus]) -> list:
    return [status.read() for status in statuses]


def one_mget(statuses: list[InferenceStatus]) -> list:
    return read_statuses(statuses[0].bus, statuses)


REFRESH_SIDES = {"a GET each": a_get_each, "one MGET": one_mget, "one MGET, again": one_mget}


async def window(bus, goes_on, passes: int) -> tuple[float, float]:
    """(CPU, wall) microseconds a pass takes, mean over `passes` passes; `bus` is what `goes_on` takes."""
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        if not await goes_on(bus):
            raise RuntimeError("a side read the run as ended, or a restart: neither happened")
    return 1e6 * (time.process_time() - started_cpu) / passes, 1e6 * (time.perf_counter() - started) / passes


def server_id_window(bus, server_id, passes: int) -> tuple[float, float]:
    """(CPU, wall) microseconds an ask takes, mean over `passes` asks."""
    reference = bus.server_id()
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        if server_id(bus) != reference:
            raise RuntimeError("a side read another server id")
    return 1e6 * (time.process_time() - started_cpu) / passes, 1e6 * (time.perf_counter() - started) / passes


def statuses_window(statuses: list[InferenceStatus], read, passes: int) -> tuple[float, float]:
    """(CPU, wall) microseconds a read of all `statuses` takes, mean over `passes` reads."""
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        if None in read(statuses):
            raise RuntimeError("a side read a status as missing or malformed: each was published")
    return 1e6 * (time.process_time() - started_cpu) / passes, 1e6 * (time.perf_counter() - started) / passes


def published_statuses(bus, workers: int) -> list[InferenceStatus]:
    statuses = [InferenceStatus(bus, index) for index in range(workers)]
    for index, status in enumerate(statuses):
        status.publish(WorkerStatus(epoch=1, beat=index, version=3, load=index))
    return statuses


async def measure(subject, sides: dict, timed, passes: int, repeats: int) -> dict:
    """Windows of each of `sides` on `subject` (the bus, or the router), timed by `timed` (a coroutine function or a
    function), the order rotated."""
    async def run(side, count):
        return await timed(subject, side, count) if asyncio.iscoroutinefunction(timed) else timed(subject, side, count)
    windows = {name: {"cpu_us": [], "wall_us": []} for name in sides}
    await run(next(iter(sides.values())), passes // 4)  # warm-up: the pool's thread, the connection, the script
    names = list(sides)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            cpu, wall = await run(sides[name], passes)
            windows[name]["cpu_us"].append(cpu)
            windows[name]["wall_us"].append(wall)
    return windows


def report(title: str, windows: dict, before: str, after: str, again: str) -> tuple[dict, float, float]:
    """Prints the table; (medians, identical sides, before / after), of CPU time."""
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    print(title)
    print(f"{'side':<16} {'CPU us':>7} {'wall us':>8}   CPU us of each window")
    for name, m in medians.items():
        print(f"{name:<16} {m['cpu_us']:>7.1f} {m['wall_us']:>8.1f}   "
              + " ".join(f"{us:.1f}" for us in windows[name]["cpu_us"]))
    same = medians[again]["cpu_us"] / medians[after]["cpu_us"]
    ratio = medians[before]["cpu_us"] / medians[after]["cpu_us"]
    print(f"identical sides ({again} / {after}), CPU time: {same:.3f}; {before} / {after}: {ratio:.3f}")
    return medians, same, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2000, help="passes a window")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="inference workers a refresh reads")
    parser.add_argument("--out", default="bench/results/poll_passes.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        bus = connect(server.url)
        bus.delete(protocol.LEARNER_DONE, protocol.STOP)
        windows = asyncio.run(measure(bus, SIDES, window, args.passes, args.repeats))
        asks = asyncio.run(measure(bus, SERVER_ID_SIDES, server_id_window, args.passes, args.repeats))
        router = EpisodeRouter(bus, protocol.replies(0), n_inference_workers=1)
        watches = asyncio.run(measure(router, ROUTER_SIDES, window, args.passes, args.repeats))
        refreshes = {n: asyncio.run(measure(published_statuses(bus, n), REFRESH_SIDES, statuses_window, args.passes,
                                            args.repeats)) for n in args.workers}
        bus.close()
    print(f"{args.passes} passes (asks) a window, {args.repeats} windows a side")
    medians, same, ratio = report("the rollout worker's loop: whether to go on", windows, *SIDES)
    id_medians, id_same, id_ratio = report("the learner's inbox: the server's id", asks,
                                            "run id alone", "run id", "run id, again")
    watch_medians, watch_same, watch_ratio = report("the router's watch: statuses and the server's id", watches,
                                                    *ROUTER_SIDES)
    refresh = {n: dict(zip(("medians", "identical_sides", "ratio"), report(
        f"the router's refresh: the statuses of {n} workers", windows_n, *REFRESH_SIDES)), windows=windows_n)
        for n, windows_n in refreshes.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "windows": windows, "medians": medians, "identical_sides": same, "ratio": ratio,
        "server_id": {"windows": asks, "medians": id_medians, "identical_sides": id_same, "ratio": id_ratio},
        "router": {"windows": watches, "medians": watch_medians, "identical_sides": watch_same, "ratio": watch_ratio},
        "refresh": refresh},
        indent=2))
    print(f"ratio: {ratio:.2f} (a call each / one call, CPU time of a pass's reads)")


if __name__ == "__main__":
    main()
