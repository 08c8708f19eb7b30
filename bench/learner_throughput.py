"""Learner throughput: trained tokens per second with sequence packing vs padding, side by side in one run.

    python3 bench/learner_throughput.py [--sequences 64] [--repeats 3] [--out bench/results/learner_throughput.json]

Both sides run the learner's own `train_step` (GRPO, PPO loss, 1 epoch) on the same batch of trajectories
whose lengths are uniform in 10..500 tokens, with the same token budget per micro-batch. "Padded" pads each
micro-batch's rows to its longest (transformers' sdpa with a mask); "packed" puts sequences end to end with
per-sequence attention. Runs alternate so that machine noise hits both alike. The last line is the headline.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import AsyncPPOMATHConfig  # noqa: E402
from rlsys.api import Trajectory  # noqa: E402
from rlsys.bus import InProcessBus  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer  # noqa: E402
from rlsys.run_files import logs_dir  # noqa: E402
from rlsys.workers.learner import Learner  # noqa: E402

PROMPT_TOKENS = 8


def save_model(directory: Path, hidden: int, layers: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def mixed_length_trajectories(n: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    batch = []
    for i in range(n):
        length = rng.randint(10, 500)
        generated = length - PROMPT_TOKENS
        reward = float(rng.random() > 0.5)
        batch.append(Trajectory(
            token_ids=[rng.randint(7, 100) for _ in range(length)],
            loss_mask=[0] * PROMPT_TOKENS + [1] * generated,
            logprobs=[0.0] * PROMPT_TOKENS + [-4.6] * generated,
            versions=[-1] * PROMPT_TOKENS + [0] * generated,
            turn_ends=[length], turn_rewards=[reward], reward=reward, group_id=f"g{i // 8}", stop_reason="length"))
    return batch


def make_learner(model_path: str, packing: bool, budget: int, run_dir: Path) -> Learner:
    config = AsyncPPOMATHConfig()
    config.model.path, config.logging_dir = model_path, str(logs_dir(run_dir))
    config.ppo.sequence_packing, config.ppo.max_tokens_per_micro_batch = packing, budget
    config.ppo.ppo_epochs, config.ppo.lr = 1, 1e-6
    return Learner(config, InProcessBus(), run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048,
                        help="tokens per micro-batch (ppo.max_tokens_per_micro_batch)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="bench/results/learner_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_model(Path(tmp) / "model", args.hidden, args.layers)
        learners = {name: make_learner(model_path, name == "packed", args.budget, Path(tmp) / name)
                    for name in ("packed", "padded")}
        trajectories = mixed_length_trajectories(args.sequences, seed=0)
        tokens = sum(len(t.token_ids) for t in trajectories)
        learners["packed"].train_step(trajectories)  # warm-up: allocator, kernels
        learners["padded"].train_step(trajectories)
        times = {name: [] for name in learners}
        for _ in range(args.repeats):
            for name, learner in learners.items():
                started = time.perf_counter()
                learner.train_step(trajectories)
                times[name].append(time.perf_counter() - started)

    computed = {"packed": tokens,
                "padded": sum(mb.num_tokens for mb in _padded_layout(learners["padded"], trajectories))}
    rows = {name: {"tokens_per_second": tokens / statistics.median(t), "seconds": t, "computed_tokens": computed[name]}
            for name, t in times.items()}
    ratio = rows["packed"]["tokens_per_second"] / rows["padded"]["tokens_per_second"]
    print(f"{args.sequences} trajectories, {tokens} tokens (lengths 10..500), budget {args.budget} tokens/micro-batch, "
          f"model hidden {args.hidden} x {args.layers} layers, median of {args.repeats}")
    print(f"{'layout':<8} {'trained tok/s':>14} {'tokens computed':>16}")
    for name, row in rows.items():
        print(f"{name:<8} {row['tokens_per_second']:>14.0f} {row['computed_tokens']:>16}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "tokens": tokens, "results": rows, "ratio": ratio},
                                         indent=2))
    print(f"ratio: {ratio:.2f}")


def _padded_layout(learner: Learner, trajectories: list[Trajectory]):
    from rlsys.algorithms.batch import sequence_batch

    return learner.micro_batches(sequence_batch(trajectories))


if __name__ == "__main__":
    main()
