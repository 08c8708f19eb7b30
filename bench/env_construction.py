"""What making an episode's environment off the event loop costs: a new thread per call against a hand-over.

    python3 bench/env_construction.py [--envs 4000] [--at-once 64] [--repeats 5]
                                      [--out bench/results/env_construction.json]

An episode's environment is made by `new_env` (rlsys/workers/episode_failure.py): its constructor on a thread to
itself under env_timeout (rlsys/blocking_calls.py), then guarded. The default task's environment
(`math-code-single-step`), `--envs` made a window, `--at-once` together in one event loop (as concurrent episodes
start); this process's CPU time per environment, its threads' included. Sides:

- "on the loop": the constructor and `guard_env` on the event loop, as before the constructor was guarded (a constructor
  that blocks freezes every episode of the worker);
- "a new thread per call": `new_env` with each call on a thread started for it;
- "hand-over" and "hand-over, again": `new_env` as it is, each call handed to a thread whose call returned (a new one
  only when none waits); their ratio is the noise between identical sides.

Windows alternate, the order rotated each repeat; the fastest window of each side (the one least disturbed). The last
line: hand-over / a new thread per call.
"""

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys import blocking_calls  # noqa: E402
from rlsys.api import EnvServiceAbstraction  # noqa: E402
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv  # noqa: E402 (registers it too)
from rlsys.workers.episode_failure import guard_env, new_env  # noqa: E402

ENV_TIMEOUT = 120.0
ENV = EnvServiceAbstraction("math-code-single-step")


async def on_the_loop():
    return guard_env(MathCodeSingleStepEnv(**ENV.args), ENV_TIMEOUT)


async def off_the_loop():
    return await new_env(ENV, ENV_TIMEOUT)


def new_thread(call) -> None:
    threading.Thread(target=call, daemon=True).start()


SIDES = {"on the loop": (on_the_loop, None), "a new thread per call": (off_the_loop, new_thread),
         "hand-over": (off_the_loop, None), "hand-over, again": (off_the_loop, None)}


async def window(make, envs: int, at_once: int) -> float:
    """CPU microseconds of this process per environment made."""
    started = time.process_time()
    for first in range(0, envs, at_once):
        await asyncio.gather(*(make() for _ in range(min(at_once, envs - first))))
    return 1e6 * (time.process_time() - started) / envs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=4000, help="environments made a window")
    parser.add_argument("--at-once", type=int, default=64, help="made together (max_concurrent_rollouts)")
    parser.add_argument("--repeats", type=int, default=5, help="windows a side")
    parser.add_argument("--out", default="bench/results/env_construction.json")
    args = parser.parse_args()
    real_hand_over, names = blocking_calls._hand_over, list(SIDES)
    windows: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            make, hand_over = SIDES[name]
            blocking_calls._hand_over = hand_over or real_hand_over
            try:
                windows[name].append(asyncio.run(window(make, args.envs, args.at_once)))
            finally:
                blocking_calls._hand_over = real_hand_over
    fastest = {name: min(w) for name, w in windows.items()}
    print(f"{args.envs} environments a window, {args.at_once} at once; CPU us of this process per environment")
    print(f"{'side':<24} {'fastest':>8}   windows")
    for name, figure in fastest.items():
        print(f"{name:<24} {figure:>8.1f}   " + " ".join(f"{us:.1f}" for us in windows[name]))
    ratio, same = fastest["hand-over"] / fastest["a new thread per call"], fastest["hand-over, again"] / \
        fastest["hand-over"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "windows": windows, "fastest": fastest,
                                          "ratio": ratio, "identical_sides": same}, indent=2))
    print(f"ratio: {ratio:.3f} (hand-over / a new thread per call, CPU per environment made; identical sides "
          f"{same:.3f}; on the loop {fastest['on the loop']:.1f} us)")


if __name__ == "__main__":
    main()
