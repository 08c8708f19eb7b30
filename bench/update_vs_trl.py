"""One update of the default task's batch: TRL's GRPO update against rlsys's learner, on the very same sequences.

    pip install -e .[dev]      # TRL is a dev extra
    python3 bench/update_vs_trl.py [--threads 2] [--repeats 5] [--out bench/results/update_vs_trl.json] [key=value ...]

`bench/vs_trl.py` compares whole runs; this isolates the update, the phase that dominates both. TRL 1.16's
`GRPOTrainer` (set up as `bench/vs_trl.py` sets it up: rlsys's hyper-parameters, gradient checkpointing off) trains
two batches of the default task; the inputs of its last `compute_loss` call (128 sequences: its own generations,
prompts left-padded, completions right-padded) are kept. Then, in the same process and with the same torch threads:

- "trl": what `GRPOTrainer` does for one batch with `num_iterations=2`: twice `compute_loss` (its logits only at
  the completion positions, the dapo token-mean loss), `backward`, gradient-norm clip and its fused AdamW step.
- "learner": rlsys's `PolicyTrainer.train_step` (2 epochs of 1 mini-batch, packed micro-batches, statistics) on
  the same token ids, unpadded, with TRL's old logprobs as the behaviour logprobs and seeded rewards.

Repeats alternate the two; the median is reported. The last line is `ratio: learner / trl updates per second`.
"""

import argparse
import copy
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_vs_plain import one_turn_trajectory  # noqa: E402
from bench.vs_trl import prepared_config, run_trl  # noqa: E402
from rlsys.api import Trajectory  # noqa: E402
from rlsys.data.dataset import load_rows  # noqa: E402
from rlsys.distributed import Ranks  # noqa: E402
from rlsys.training_step import PolicyTrainer  # noqa: E402


def captured_trl_batch(config, threads: int, out_dir: Path):
    """Train TRL for 2 batches; (its trainer, the inputs of its last compute_loss call)."""
    from trl import GRPOTrainer

    kept = {}
    compute_loss = GRPOTrainer.compute_loss

    def keep_inputs(self, model, inputs, *args, **kwargs):
        kept["trainer"] = self
        kept["inputs"] = {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in inputs.items()}
        return compute_loss(self, model, inputs, *args, **kwargs)

    GRPOTrainer.compute_loss = keep_inputs
    try:
        run_trl(config, load_rows(config.dataset.path, config.dataset.row_format()), 2, 0, out_dir, threads, "cpu")
    finally:
        GRPOTrainer.compute_loss = compute_loss
    return kept["trainer"], kept["inputs"]


def same_sequences(inputs: dict, group_size: int, seed: int) -> list[Trajectory]:
    """TRL's padded batch as rlsys trajectories: the real tokens only, TRL's old logprobs, seeded rewards."""
    rng = random.Random(seed)
    old = inputs.get("old_per_token_logps")
    out = []
    for i in range(inputs["prompt_ids"].shape[0]):
        prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i] == 1].tolist()
        keep = inputs["completion_mask"][i] == 1
        answer = inputs["completion_ids"][i][keep].tolist()
        logprobs = old[i][keep].tolist() if old is not None else [-0.5] * len(answer)
        out.append(one_turn_trajectory(prompt, answer, logprobs, float(rng.random() < 0.4), f"g{i // group_size}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both sides")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/update_vs_trl.json")
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value")
    args = parser.parse_args()

    config = prepared_config(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, inputs = captured_trl_batch(config, args.threads, Path(tmp))
    torch.set_num_threads(args.threads)
    trajectories = same_sequences(inputs, config.group_size, config.seed)
    model, optimizer = trainer.model, trainer.optimizer

    def trl_batch() -> None:
        for _ in range(config.ppo.ppo_epochs):  # num_iterations: one optimizer step per pass over the batch
            trainer.compute_loss(model, inputs).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.ppo.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()

    learner = PolicyTrainer(config, Ranks(), config.model.path)
    sides = {"trl": trl_batch, "learner": lambda: learner.train_step(trajectories)}
    for run in sides.values():  # warm-up
        run()
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)

    tokens = sum(len(t.token_ids) for t in trajectories)
    padded = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
    rows = {name: {"seconds_per_batch": statistics.median(t), "seconds": t} for name, t in times.items()}
    ratio = rows["trl"]["seconds_per_batch"] / rows["learner"]["seconds_per_batch"]
    print(f"{len(trajectories)} sequences, {tokens} tokens ({padded} padded, TRL's), {config.ppo.ppo_epochs} optimizer "
          f"steps a batch, {args.threads} CPU thread(s), median of {args.repeats}")
    print(f"{'side':<8} {'s/batch':>8}")
    for name, row in rows.items():
        print(f"{name:<8} {row['seconds_per_batch']:>8.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "tokens": tokens, "padded_tokens": padded,
                                          "machine": platform.node(), "results": rows, "ratio": ratio}, indent=2))
    print(f"ratio: learner / trl updates per second = {ratio:.2f}")


if __name__ == "__main__":
    main()
