"""Sharded learner throughput: trained tokens per second at 1 and 2 learner ranks, side by side in one run.

    python3 bench/learner_ranks.py [--ranks 1 2] [--sequences 32] [--repeats 3] [--out bench/results/learner_ranks.json]

Every rank count runs the learner's own `train_step` (GRPO, PPO loss, 1 epoch, packed micro-batches) in
its own processes, one CPU thread per rank (gloo and FSDP2 for more than one rank), on the same batch of
trajectories 10..500 tokens long. After a warm-up step, `repeats` steps are timed between barriers; tokens
per second counts the whole batch's tokens (all ranks together). `learner_tokens_per_second` is what
bench/scale.py calls. The last line is the headline: the 2-rank / 1-rank ratio.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_throughput import mixed_length_trajectories, save_model  # noqa: E402


def learner_tokens_per_second(n_ranks: int, model_path: str, sequences: int = 32, repeats: int = 3,
                              budget: int = 2048) -> float:
    """Trained tokens per second of `n_ranks` learner ranks (each its own process, one thread) on a seeded batch."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_timed_rank, args=(n_ranks, port, model_path, sequences, repeats, budget, tmp),
                           nprocs=n_ranks, start_method="spawn")
        return json.loads((Path(tmp) / "result.json").read_text())["tokens_per_second"]


def _timed_rank(rank: int, world: int, port: int, model_path: str, sequences: int, repeats: int, budget: int,
                tmp: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments import AsyncPPOMATHConfig
    from rlsys.bus import InProcessBus
    from rlsys.distributed import join_ranks, leave_ranks
    from rlsys.run_files import logs_dir
    from rlsys.workers.learner import Learner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = join_ranks(rank, world)
    config = AsyncPPOMATHConfig()
    config.model.path, config.logging_dir = model_path, str(logs_dir(Path(tmp)))
    config.ppo.max_tokens_per_micro_batch, config.ppo.ppo_epochs, config.ppo.lr = budget, 1, 1e-6
    config.cluster.n_learner_ranks = world
    learner = Learner(config, InProcessBus(), Path(tmp) / "run", ranks)
    batch = mixed_length_trajectories(sequences, seed=0)
    learner.train_step(batch)  # warm-up
    ranks.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        learner.train_step(batch)
    ranks.barrier()
    elapsed = time.perf_counter() - started
    if ranks.main:
        tokens = sum(len(t.token_ids) for t in batch) * repeats
        (Path(tmp) / "result.json").write_text(json.dumps({"tokens_per_second": tokens / elapsed}))
    leave_ranks(ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="bench/results/learner_ranks.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_model(Path(tmp) / "model", args.hidden, args.layers)
        results = {n: learner_tokens_per_second(n, model_path, args.sequences, args.repeats) for n in args.ranks}
    print(f"{'ranks':>6} {'tokens/s':>10}")
    for n, rate in results.items():
        print(f"{n:>6} {rate:>10.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "tokens_per_second": results}, indent=2))
    first, last = args.ranks[0], args.ranks[-1]
    print(f"ratio: {results[last] / results[first]:.2f} ({last} ranks / {first} rank{'s' if first > 1 else ''}, "
          f"trained tokens per second)")


if __name__ == "__main__":
    main()
