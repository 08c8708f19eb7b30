"""Checking a trajectory message: the one-pass list checks against checking every token on its own.

    python3 bench/message_checks.py [--tokens 180] [--repeats 300] [--out bench/results/message_checks.json]

Every group message a rollout worker sends is checked twice, by the worker before it sends and by the learner
when it reads (`rlsys/delivery.py`): each token id, mask bit, version and log-probability in range. The message
here is a group of 8 trajectories of `--tokens` tokens each (a fifth of them prompt), as the long-answer task
sends. "per item" checks each list with `items` and one call per element (how the checks ran before); "one pass"
with `integers` and `logprobs`, which check a whole list at once and fall back to the per-item check only to name a
bad element. Runs alternate, each the median of 5. The last line is the headline.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.api import Trajectory  # noqa: E402
from rlsys.api.messages import integer, integers, items, logprob, logprobs, versions  # noqa: E402

VOCAB = 100


def group(tokens: int, seed: int = 0) -> list[Trajectory]:
    rng, prompt = random.Random(seed), tokens // 5
    return [Trajectory(token_ids=[rng.randrange(VOCAB) for _ in range(tokens)],
                       loss_mask=[0] * prompt + [1] * (tokens - prompt),
                       logprobs=[0.0] * prompt + [-rng.random() for _ in range(tokens - prompt)],
                       versions=[-1] * prompt + [3] * (tokens - prompt), turn_ends=[tokens], turn_rewards=[1.0],
                       group_id="g", stop_reason="stop", reward=1.0) for _ in range(8)]


def per_item(trajectories: list[Trajectory]) -> None:
    for t in trajectories:
        items(t.token_ids, "token_ids", lambda x, at: integer(x, at, high=VOCAB - 1))
        items(t.loss_mask, "loss_mask", lambda x, at: integer(x, at, high=1))
        items(t.logprobs, "logprobs", logprob)
        items(t.versions, "versions", lambda x, at: integer(x, at, low=-1))


def one_pass(trajectories: list[Trajectory]) -> None:
    for t in trajectories:
        integers(t.token_ids, "token_ids", high=VOCAB - 1)
        integers(t.loss_mask, "loss_mask", high=1)
        logprobs(t.logprobs, "logprobs")
        versions(t.versions, "versions")


def seconds(check, trajectories: list[Trajectory], repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        check(trajectories)
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=180, help="tokens a trajectory")
    parser.add_argument("--repeats", type=int, default=300, help="checks of the message a measurement")
    parser.add_argument("--out", default="bench/results/message_checks.json")
    args = parser.parse_args()
    trajectories = group(args.tokens)
    runs = {"per item": [], "one pass": []}
    for _ in range(5):
        runs["per item"].append(seconds(per_item, trajectories, args.repeats))
        runs["one pass"].append(seconds(one_pass, trajectories, args.repeats))
    ms = {name: 1000 * statistics.median(times) for name, times in runs.items()}
    print(f"a group of 8 trajectories of {args.tokens} tokens, median of 5 runs of {args.repeats} checks")
    print(f"{'check':<10} {'ms a message':>12}")
    for name, value in ms.items():
        print(f"{name:<10} {value:>12.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "ms_per_message": ms}, indent=2))
    print(f"ratio: {ms['per item'] / ms['one pass']:.2f} (per-item time / one-pass time)")


if __name__ == "__main__":
    main()
