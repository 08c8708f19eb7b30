"""What the learner's publish costs on the default model, part by part: the checks' share of a step.

    python3 bench/publish_cost.py [--threads 1] [--repeats 25] [--out bench/results/publish_cost.json] [key=value ...]

The learner of the default experiment (its model, `inference.dtype`, the stream transport), one process, no
inference worker connected: what `Learner.publish_weights` spends on the learner's side of every step.

- "train step": `train_step` on a default step's batch (`bench/learner_vs_plain.py`'s), the denominator;
- "publish": `publish_weights` whole (gather, the probe, the cast-and-copy into the served buffer, the checksum);
- "probe": the weight-sync probe's forward pass alone (one sequence, rlsys/alarms.py);
- "checksum": the weight checksum of the served tensors (rlsys/weight_checksum.py), which the transfer computes as
  it copies them and the inference worker of what it then holds;
- "logprob check": the time inside the train step's `LogprobCheck.observe` calls (inference's logprobs against the
  learner's on the tokens its version sampled; here every token, the batch's version being the learner's). On a
  GPU that is the time to launch its operations.

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
from rlsys.workers.learner import PROBE_SEQUENCES, PROBE_TOKENS, Learner  # noqa: E402


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
        probe_ids = [t.token_ids[:PROBE_TOKENS] for t in trajectories[:PROBE_SEQUENCES]]

        in_step = []  # seconds in LogprobCheck.observe, each train step
        observe = LogprobCheck.observe

        def timed_observe(check, *args, **kwargs):
            started = time.perf_counter()
            observe(check, *args, **kwargs)
            in_step[-1] += time.perf_counter() - started

        def train_step():
            in_step.append(0.0)
            learner.train_step(trajectories)

        LogprobCheck.observe = timed_observe
        sides = {"train step": train_step,
                 "publish": lambda: learner.publish_weights(trajectories),
                 "probe": lambda: learner.probe_logprobs(probe_ids),
                 "checksum": lambda: weights_checksum(served)}
        times = {name: [] for name in sides}
        for repeat in range(args.repeats + 1):  # the first of each side warms up
            for name, side in sides.items():
                started = time.perf_counter()
                side()
                if torch.cuda.is_available():  # the learner's device, as Learner places it
                    torch.cuda.synchronize()
                if repeat:
                    times[name].append(time.perf_counter() - started)
        times["logprob check"] = in_step[1:]
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
