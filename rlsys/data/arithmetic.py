"""The default task: two-digit addition, generated and seeded, with a disjoint held-out split."""

import random
from pathlib import Path

from rlsys.data.dataset import write_jsonl


def addition_problems(seed: int) -> list[dict]:
    """Every a+b with a, b in 10..99, shuffled by `seed`."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    return rows


def generate_addition_dataset(directory: Path, seed: int, num_train: int, num_eval: int) -> tuple[Path, Path]:
    """Writes train.jsonl and eval.jsonl (disjoint) unless they already exist; returns their paths."""
    train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
    if not (train.exists() and held_out.exists()):
        rows = addition_problems(seed)
        if num_train + num_eval > len(rows):
            raise ValueError(f"only {len(rows)} distinct problems; asked for {num_train} train + {num_eval} eval")
        write_jsonl(rows[:num_eval], held_out)
        write_jsonl(rows[num_eval:num_eval + num_train], train)
    return train, held_out
