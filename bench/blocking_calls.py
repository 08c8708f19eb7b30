"""What running synchronous user code off the loop costs the default task's reward (math-verify), per episode.

    python3 bench/blocking_calls.py [--episodes 256] [--at-once 64] [--repeats 3] [--calls 20000]
                                    [--out bench/results/blocking_calls.json]

An episode of the default task is the rollout worker's guarded env (rlsys/workers/episode_failure.py, `guard_env`
with env_timeout 120 s): `reset`, one `step` scoring a group of 8 answers with the shared math-verify pool (6 plain
numbers, decided in-process, and 2 written out, checked by a verifier worker), `close`. `--at-once` run together in
one event loop, `--episodes` a window; this process's CPU time per episode (the verifier workers' processes are not
counted: nothing here changes them). Sides:

- "as it was": the guard as before rlsys/blocking_calls.py (`async_form` replaced by the method itself);
- "now" and "now, again": the guard as it is; their ratio is the noise between identical sides. The default env's
  methods are `async def`: the guard reads that once and calls them as before;
- "def step on a thread": the same reward in a plain `def step` (the plain numbers in-process, the rest through the
  pool's blocking call), which the guard runs on a thread of its own per call: what a user's synchronous reward pays.

Windows alternate, the order rotated each repeat; medians. On a loaded machine an episode's CPU time varies by more
than the guard could change it, so a second table times the guard alone: `--calls` envs whose `async def step`
returns at once, each guarded as an episode's is and stepped once, one after another, the same three sides (as it
was, now, now again); the fastest window of each side (the one least disturbed). The last line: now / as it was of
the guard alone, with the episodes' medians and the thread's cost.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.api import EnvironmentService  # noqa: E402
from rlsys.impl.env import math_verifier  # noqa: E402
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv  # noqa: E402
from rlsys.workers import episode_failure  # noqa: E402

ENV_TIMEOUT = 120.0
ANSWERS = ["46", "45", "46", "47", "146", "-46", "The sum is $46$.", "so 12 + 34 = \\boxed{46}"]


class SyncStepEnv(MathCodeSingleStepEnv):
    """The default reward in a synchronous `def step`."""

    def step(self, action):
        pool, answers = math_verifier.shared_pool(self.verifier_workers), action[1]
        verdicts = [pool._plain_numbers(a, self.reference) or pool.check_blocking(a, self.reference,
                                                                                  self.verify_timeout)
                    for a in answers]
        return None, [float(v.correct) for v in verdicts], True, False, {"statuses": [v.status for v in verdicts]}


class InstantEnv(EnvironmentService):
    async def step(self, action):
        return None, [0.0], True, False, {}


def as_it_was(method, label):
    return method


SIDES = {"as it was": (MathCodeSingleStepEnv, as_it_was), "now": (MathCodeSingleStepEnv, None),
         "now, again": (MathCodeSingleStepEnv, None), "def step on a thread": (SyncStepEnv, None)}


async def episode(env_class) -> float:
    env = episode_failure.guard_env(env_class(), ENV_TIMEOUT)
    await env.reset(options={"answer": "46"})
    _, rewards, _, _, _ = await env.step(("q", ANSWERS))
    await env.close()
    return sum(rewards)


async def window(env_class, episodes: int, at_once: int) -> float:
    """CPU microseconds of this process per episode."""
    started = time.process_time()
    for first in range(0, episodes, at_once):
        rewards = await asyncio.gather(*(episode(env_class) for _ in range(min(at_once, episodes - first))))
        assert set(rewards) == {4.0}, rewards  # 46 three times, and the two written out
    return 1e6 * (time.process_time() - started) / episodes


async def guard_alone(env_class, calls: int) -> float:
    """CPU microseconds of this process per env that does nothing, guarded (as each episode's is) and stepped once."""
    started = time.process_time()
    for _ in range(calls):
        await episode_failure.guard_env(env_class(), ENV_TIMEOUT).step(("q", []))
    return 1e6 * (time.process_time() - started) / calls


def measure(sides: dict, run, repeats: int) -> dict[str, list[float]]:
    """Each side's figure of each window, `run(env_class)` a window, the order rotated each repeat."""
    real_form = episode_failure.async_form
    names, windows = list(sides), {name: [] for name in sides}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            env_class, form = sides[name]
            episode_failure.async_form = form or real_form
            try:
                windows[name].append(asyncio.run(run(env_class)))
            finally:
                episode_failure.async_form = real_form
    return windows


def table(title: str, windows: dict[str, list[float]], pick) -> dict[str, float]:
    figures = {name: pick(w) for name, w in windows.items()}
    print(title)
    print(f"{'side':<22} {pick.__name__:>9}   windows")
    for name, figure in figures.items():
        print(f"{name:<22} {figure:>9.1f}   " + " ".join(f"{us:.1f}" for us in windows[name]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256, help="episodes a window")
    parser.add_argument("--at-once", type=int, default=64, help="episodes run together (max_concurrent_rollouts)")
    parser.add_argument("--repeats", type=int, default=3, help="windows a side")
    parser.add_argument("--calls", type=int, default=20000, help="envs guarded and stepped a window (guard alone)")
    parser.add_argument("--out", default="bench/results/blocking_calls.json")
    args = parser.parse_args()
    asyncio.run(window(MathCodeSingleStepEnv, args.at_once, args.at_once))  # warm-up: the pool's workers started
    episodes = measure(SIDES, lambda env_class: window(env_class, args.episodes, args.at_once), args.repeats)
    alone = measure({name: (InstantEnv, form) for name, (_, form) in SIDES.items() if name != "def step on a thread"},
                    lambda env_class: guard_alone(env_class, args.calls), args.repeats)
    medians = table(f"{args.episodes} episodes a window, {args.at_once} at once; CPU us of this process per episode",
                    episodes, statistics.median)
    fastest = table(f"the guard alone, {args.calls} envs guarded and stepped a window; CPU us each", alone, min)
    ratio, same = fastest["now"] / fastest["as it was"], fastest["now, again"] / fastest["now"]
    episode_ratio, episode_same = medians["now"] / medians["as it was"], medians["now, again"] / medians["now"]
    thread_us = medians["def step on a thread"] - min(medians["now"], medians["now, again"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "episodes": episodes, "medians": medians,
                                          "guard_alone": alone, "fastest": fastest, "ratio": ratio,
                                          "identical_sides": same, "episode_ratio": episode_ratio,
                                          "episode_identical_sides": episode_same,
                                          "thread_us": thread_us}, indent=2))
    print(f"ratio: {ratio:.3f} (now / as it was, the guard alone, CPU per env guarded and stepped; identical sides "
          f"{same:.3f}; episodes {episode_ratio:.3f}, identical sides {episode_same:.3f}; a def step on a thread "
          f"{thread_us:+.1f} us an episode)")


if __name__ == "__main__":
    main()
