"""The stuck-agent watch's cost: a rollout worker's event loop running episodes with their watchers and with none.

    python3 bench/stuck_watch.py [--episodes 64 256 1024] [--reply-ms 5] [--seconds 3] [--repeats 2]
                                 [--out bench/results/stuck_watch.json]

Each episode in flight has a watcher (rlsys/workers/episode_activity.py, `stuck_for`) that looks at it about once a
second for as long as it runs; `agent_stuck_after=0` starts none. In one event loop, `--episodes` episodes run at
once, each through the rollout worker's own `EpisodeRouter.serve` (its forwarding task, its watcher, its end), with
the model in the same loop, in two shapes:

- "busy": each request is answered `--reply-ms` later, and an episode asks one request after another for about two
  seconds, then the next episode takes its place (the first ones end at spread times);
- "waiting": each request is answered after longer than the window: every episode waits on the model all along,
  which is what a watcher sees most of the time. The loop does little else: what the watchers cost, alone.

After a warm-up of one episode's length, a window of `--seconds` counts this process's CPU time (one thread: nothing
here hops to a thread). The machine is shared: a loaded one runs the episodes slower than they would run alone, so
the busy shape's figure is CPU microseconds per reply times the replies an episode gets a second alone (1000 /
reply_ms): a second of an episode's work. The waiting shape's is CPU microseconds per episode and second of wall time
(a watcher's timer keeps to the wall clock). Sides:

- "watchers": agent_stuck_after=600, the default: a watcher each episode;
- "none" and "none, again": agent_stuck_after=0, twice; their ratio is the noise between identical sides.

Windows alternate, the order rotated each repeat; medians. The watchers' share: what they cost an episode-second
(waiting: watchers less none) over what a busy episode-second costs with none. The last line is the headline:
watchers / none, busy, at the first `--episodes` (the default run's max_concurrent_rollouts, 64), and the share.
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys import protocol  # noqa: E402
from rlsys.api import GenerationConfig, ModelRequest  # noqa: E402
from rlsys.bus import InProcessBus  # noqa: E402
from rlsys.workers.episode_activity import ActQueue, EpisodeActivity  # noqa: E402
from rlsys.workers.routing import EpisodeRouter  # noqa: E402

SIDES = {"watchers": 600.0, "none": 0.0, "none, again": 0.0}  # agent_stuck_after
EPISODE_SECONDS = 2.0  # how long a busy episode asks, unhindered; the warm-up
WAITING_REPLY_S = 3600.0  # a waiting episode's reply: after every window
GCONFIG = GenerationConfig(max_new_tokens=8)


class ModelInTheLoop(EpisodeRouter):
    """The router with its model in the event loop: a request is answered `reply_s` after it is taken, as
    dispatch_replies answers it (the reply put, the request no longer counted)."""

    def __init__(self, reply_s: float):
        super().__init__(InProcessBus(), protocol.replies(0), n_inference_workers=1)
        self.reply_s, self.replies = reply_s, 0

    async def forward(self, obs_queue, act_queue, calls=None, refused=None, activity=None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            request = await obs_queue.get()
            activity.count_request(1)
            loop.call_later(self.reply_s, self.answer, request, act_queue, activity)

    def answer(self, request: ModelRequest, act_queue: asyncio.Queue, activity: EpisodeActivity) -> None:
        act_queue.put_nowait({"qid": request.qid, "output_ids": [1, 2], "version": 0})
        activity.count_request(-1)
        self.replies += 1


async def asks(turns: int, obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> list:
    """An agent's episode: `turns` requests, each sent once the last is answered."""
    for turn in range(turns):
        await obs_queue.put(ModelRequest(f"q{turn}", [1, 2, 3], GCONFIG))
        await act_queue.get()
    return []


async def slot(router: ModelInTheLoop, turns: int, first_share: float, stuck_after: float) -> None:
    """Episodes one after another; the first runs `first_share` of one, so that episodes end at spread times."""
    share = first_share
    while True:
        obs_queue, act_queue = asyncio.Queue(), ActQueue()
        await router.serve(asks(max(1, int(turns * share)), obs_queue, act_queue), obs_queue, act_queue, None,
                           EpisodeActivity(), stuck_after)
        share = 1.0


async def window(episodes: int, stuck_after: float, reply_s: float, seconds: float) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, replies) of a window of `episodes` running at once."""
    router, rng = ModelInTheLoop(reply_s), random.Random(episodes)
    turns = max(1, int(EPISODE_SECONDS / reply_s))
    slots = [asyncio.create_task(slot(router, turns, rng.random(), stuck_after)) for _ in range(episodes)]
    await asyncio.sleep(EPISODE_SECONDS)  # warm-up: every slot past its first episode's start
    replies, started, started_cpu = router.replies, time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    cpu, wall, replies = time.process_time() - started_cpu, time.perf_counter() - started, router.replies - replies
    for task in slots:
        task.cancel()
    await asyncio.gather(*slots, return_exceptions=True)
    return cpu, wall, replies


def busy_figures(episodes: int, reply_s: float, cpu: float, wall: float, replies: int) -> dict:
    """CPU us per episode-second of work (per reply, times an unhindered episode's replies a second), the replies an
    episode got a second of wall time (1 / reply_s on an idle machine), and the loop's load (CPU / wall)."""
    return {"cpu_us": 1e6 * cpu / max(replies, 1) / reply_s, "replies": replies / (episodes * wall),
            "load": cpu / wall}


def waiting_figures(episodes: int, reply_s: float, cpu: float, wall: float, replies: int) -> dict:
    """CPU us per episode and second of wall time, and the loop's load."""
    return {"cpu_us": 1e6 * cpu / (episodes * wall), "load": cpu / wall}


SHAPES = {"busy": busy_figures, "waiting": waiting_figures}


def measure(shape: str, episodes: int, reply_s: float, seconds: float, repeats: int) -> dict:
    """Each side's figures of each window, the order rotated each repeat."""
    windows: dict[str, dict[str, list]] = {name: {} for name in SIDES}
    names = list(SIDES)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            measured = asyncio.run(window(episodes, SIDES[name], reply_s, seconds))
            for key, value in SHAPES[shape](episodes, reply_s, *measured).items():
                windows[name].setdefault(key, []).append(value)
    return windows


def report(title: str, windows: dict) -> dict:
    """Prints a table; its medians, identical sides and ratio (watchers / none, CPU time)."""
    medians = {name: {m: statistics.median(v) for m, v in w.items()} for name, w in windows.items()}
    columns = list(next(iter(medians.values())))
    print(title)
    print(f"{'side':<12} " + " ".join(f"{c:>9}" for c in columns) + "   CPU us of each window")
    for name, m in medians.items():
        print(f"{name:<12} " + " ".join(f"{m[c]:>9.2f}" for c in columns) + "   "
              + " ".join(f"{us:.2f}" for us in windows[name]["cpu_us"]))
    same = medians["none, again"]["cpu_us"] / medians["none"]["cpu_us"]
    ratio = medians["watchers"]["cpu_us"] / medians["none"]["cpu_us"]
    watch = medians["watchers"]["cpu_us"] - min(medians["none"]["cpu_us"], medians["none, again"]["cpu_us"])
    print(f"identical sides (none, again / none): {same:.3f}; watchers / none: {ratio:.3f}; "
          f"watchers less none: {watch:.2f} us")
    return {"windows": windows, "medians": medians, "identical_sides": same, "ratio": ratio, "watchers_us": watch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[64, 256, 1024], help="episodes at once")
    parser.add_argument("--reply-ms", type=float, default=5.0, help="milliseconds the model takes to answer (busy)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds a window")
    parser.add_argument("--repeats", type=int, default=2, help="windows a side")
    parser.add_argument("--out", default="bench/results/stuck_watch.json")
    args = parser.parse_args()
    reply_s = {"busy": args.reply_ms / 1000, "waiting": WAITING_REPLY_S}
    results = {shape: {n: measure(shape, n, reply_s[shape], args.seconds, args.repeats) for n in args.episodes}
               for shape in SHAPES}
    print(f"busy: replies after {args.reply_ms:g} ms; {args.seconds:g} s windows, {args.repeats} windows a side; "
          "CPU us per episode-second")
    tables = {shape: {n: report(f"{shape}, {n} episodes at once", windows) for n, windows in by_n.items()}
              for shape, by_n in results.items()}
    shares = {n: tables["waiting"][n]["watchers_us"] / tables["busy"][n]["medians"]["none"]["cpu_us"]
              for n in args.episodes}
    print("the watchers' share of a busy episode's CPU: "
          + ", ".join(f"{n} episodes {100 * share:.2f}%" for n, share in shares.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "shapes": tables, "shares": shares}, indent=2))
    first = args.episodes[0]
    busy = tables["busy"][first]
    print(f"ratio: {busy['ratio']:.3f} (watchers / none, busy, CPU time per episode-second, {first} episodes; "
          f"identical sides {busy['identical_sides']:.3f}; the watchers' share {100 * shares[first]:.2f}%)")


if __name__ == "__main__":
    main()
