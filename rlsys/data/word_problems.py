"""Seeded word problems in GSM8K's format, for recipes and tests that cannot download GSM8K.

Each row is what GSM8K's files hold: `question`, and `answer`, a worked solution with calculator
annotations that ends in `#### <number>`. One or two steps of addition and subtraction with small numbers,
so a 135M-parameter chat model gets some right and RL has something to find.

    python3 -m rlsys.data.word_problems OUT_DIR [--num-train 2000] [--num-test 200] [--seed 1]

writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl; turn them into training rows with
scripts/preprocess_gsm8k.py.
"""

import argparse
import random
from pathlib import Path

from rlsys.data.dataset import write_jsonl

NAMES = ["Ann", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kofi", "Lena"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards"]


def word_problem(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(1, 15)
    if rng.random() < 0.5:
        question = f"{name} has {a} {thing}. {name} gets {b} more {thing}. How many {thing} does {name} have now?"
        steps, total = [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}."], a + b
    else:
        a = a + b
        question = f"{name} has {a} {thing} and gives away {b} of them. How many {thing} does {name} have left?"
        steps, total = [f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {thing} left."], a - b
    if rng.random() < 0.3:
        c = rng.randint(1, 10)
        question = question.replace("How many", f"Then {name} finds {c} more. How many")
        steps.append(f"After finding {c} more, {name} has {total} + {c} = <<{total}+{c}={total + c}>>{total + c}.")
        total += c
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {total}"}


def generate(directory: Path, num_train: int, num_test: int, seed: int) -> tuple[Path, Path]:
    """Writes train.jsonl and test.jsonl with disjoint questions; returns their paths."""
    rng, rows, seen = random.Random(seed), [], set()
    for _ in range(50 * (num_train + num_test)):
        row = word_problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
        if len(rows) == num_train + num_test:
            break
    else:
        raise ValueError(f"only {len(rows)} distinct problems; asked for {num_train} train + {num_test} test")
    return (write_jsonl(rows[num_test:], directory / "train.jsonl"),
            write_jsonl(rows[:num_test], directory / "test.jsonl"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m rlsys.data.word_problems", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for path in generate(Path(args.out_dir), args.num_train, args.num_test, args.seed):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
