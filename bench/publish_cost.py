"""What the learner's publish costs on the default model, part by part: the checks' share of a step.

    python3 bench/publish_cost.py [--threads 1] [--repeats 25] [--out bench/results/publish_cost.json] [key=value ...]

The learner of the default experiment (its model, `inference.dtype`, the stream transport), one process, no
inference worker connected: what `Learner.publish_weights` spends on the learner's side of every step.

- "train step": `train_step` on a default step's batch (`bench/learner_vs_plain.py`'s), the denominator;
- "publish": `publish_weights` whole (gather, the cast-and-copy into the served buffer, the checksum);
- "probe": the time inside the train step that the weight-sync probe takes (rlsys/alarms.py): keeping the first
  update's logprobs at temperature 1 (`PolicyTrainer.score_first_pass`, each pass of that update) and taking the
  probe's sequence and reading its logprobs back (`probe_of`). Its forward passes are the step's own;
- "checksum": the weight checksum of the served tensors (rlsys/weight_checksum.py), which the transfer computes as
  it copies them and the inference worker of what it then holds;
- "logprob check": the time inside the train step's `LogprobCheck.observe` calls (inference's logprobs against the
  learner's on the tokens its version sampled; here every token, the batch's version being the learner's).

On a GPU the times inside the train step are those to launch the operations (and, for `probe_of`, to wait for the
step's last ones before the read).

The last alarm, token continuity (`PrefixCheck`), runs in the rollout workers, not on the learner's step. Repeats
alternate the sides after one warm-up each; medians are reported. The last line is the headline: the checks'
share, (probe + checksum + logprob check) / train step. That is of the learner's compute alone, so above their
share of a run's step, which also waits for data.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_vs_plain import default_step_batch, prepared_config  # noqa: E402
from rlsys.alarms import LogprobCheck  # noqa: E402
from rlsys.bus import InProcessBus  # noqa: E402
from rlsys.weight_checksum import weights_checksum  # noqa: E402
from rlsys.training_step import PolicyTrainer, synchronize  # noqa: E402
from rlsys.workers.learner import Learner  # noqa: E402


def timed(method, seconds: list[float]):
    """`method`, adding the time of each call to the last entry of `seconds`."""
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[-1] += time.perf_counter() - started
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner role's)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--out", default="bench/results/publish_cost.json")
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        config = prepared_config(args.overrides, tmp)
        trajectories = default_step_batch(config, seed=0)
        learner = Learner(config, InProcessBus(), Path(tmp) / "run")
        cast = getattr(torch, config.inference.dtype)
        served = {name: t.detach().to(cast) for name, t in learner.model.state_dict().items()}
        in_step = {"probe": [], "logprob check": []}  # seconds inside the train step, each step
        for part, owner, method in (("probe", PolicyTrainer, "score_first_pass"), ("probe", PolicyTrainer, "probe_of"),
                                    ("logprob check", LogprobCheck, "observe")):
            setattr(owner, method, timed(getattr(owner, method), in_step[part]))

        def train_step():
            for seconds in in_step.values():
                seconds.append(0.0)
            learner.train_step(trajectories)

        sides = {"train step": train_step,
                 "publish": learner.publish_weights,
                 "checksum": lambda: weights_checksum(served)}
        times = {name: [] for name in sides}
        for repeat in range(args.repeats + 1):  # the first of each side warms up
            for name, side in sides.items():
                started = time.perf_counter()
                side()
                synchronize(learner.device)
                if repeat:
                    times[name].append(time.perf_counter() - started)
        times.update({part: seconds[1:] for part, seconds in in_step.items()})
        if learner.weight_server is not None:
            learner.weight_server.close()

    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    share = (ms["probe"] + ms["checksum"] + ms["logprob check"]) / ms["train step"]
    print(f"default model, {len(served)} tensors in {config.inference.dtype}, {args.threads} thread(s), "
          f"{learner.device}, median of {args.repeats}")
    print(f"{'part':<14} {'ms':>8}  {'of the train step':>17}")
    for name, value in ms.items():
        print(f"{name:<14} {value:>8.2f}  {value / ms['train step']:>17.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "milliseconds": ms, "seconds": times,
                                          "checks_share": share}, indent=2))
    print(f"checks (probe + checksum + logprob check): {share:.1%} of the learner's train step")


if __name__ == "__main__":
    main()
