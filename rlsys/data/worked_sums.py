"""Long sums with the working written out: a task whose answers are long, as reasoning RL's are.

In reasoning RL most of a synchronous step goes to generating answers of hundreds of tokens; the default
task's answers are three characters, so its runs say little about a system that has to overlap generation
with training. Here the prompt is a sum of several two-digit numbers and the reference completion
works it out line by line, adding the first two numbers and copying the rest:

    12+34+56+78=       (the prompt)
       46+56+78        (the completion, one line a step)
          102+78
    #### 180

Every line is right-aligned to one width, that of the longest prompt the set has, so each number a line
copies stands one line above it (the first line's, in the prompt), at the same distance in every line of every
problem: a tiny character-level model learns that copy quickly. Written the other way, running totals beside
the next number (`12+34=46;46+56=102`), the model must find that next number in the prompt, where its warm
start got the tens digit right and kept missing the units one; with lines aligned to their own prompt's width,
the distance changed with the number of terms and it learned the copy far more slowly. The reward reads only
the final number: the math environment's check takes the last number of an answer, and a reference in GSM8K's
`#### N` form resolves to N, so the working itself checks as right (`math_answers.reference_answer`).

The experiment's sums are of one-digit numbers: with two-digit ones each line adds a two-digit number to a
three-digit total, and on 2 CPU cores the tiny model's warm start got 1.5% of final numbers right after 700 steps
(about 30 minutes), where with one-digit ones it gets 46% after 1,200 (10 minutes; BENCHMARKS.md, "The long task on
a CPU").
"""

import random
from pathlib import Path

from rlsys.data.dataset import write_jsonl

FINAL = "#### "  # GSM8K's mark before the final answer


def prompt_width(count: int, digits: int) -> int:
    """Characters of a sum of `count` numbers of `digits` digits, `12+34+...`: the width every line is aligned to."""
    return (digits + 1) * count - 1


def term_range(digits: int) -> range:
    """The numbers of `digits` digits a sum is made of (one digit: 1 to 9; a 0 would only be copied)."""
    return range(10 ** (digits - 1) if digits > 1 else 1, 10 ** digits)


def worked_sum(terms: list[int], width: int) -> str:
    """The working of `terms`'s sum: a line after each addition while two numbers are left, right-aligned to
    `width` characters, then the total."""
    lines = []
    while len(terms) > 2:
        terms = [terms[0] + terms[1], *terms[2:]]
        lines.append("+".join(map(str, terms)).rjust(width))
    return "\n".join([*lines, f"{FINAL}{sum(terms)}"])


def sum_problem(rng: random.Random, min_terms: int, max_terms: int, digits: int) -> dict:
    """A row: the prompt, the final answer the reward checks, and the working the warm start teaches."""
    terms = rng.choices(term_range(digits), k=rng.randint(min_terms, max_terms))
    return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)),
            "solution": worked_sum(terms, prompt_width(max_terms, digits))}


def generate_worked_sums_dataset(directory: Path, seed: int, num_train: int, num_eval: int, min_terms: int,
                                 max_terms: int, digits: int) -> tuple[Path, Path]:
    """Writes train.jsonl and eval.jsonl (distinct prompts, disjoint) unless they already exist; returns their paths."""
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"a sum takes at least 2 terms, and min_terms <= max_terms; got {min_terms} to {max_terms}")
    if digits < 1:
        raise ValueError(f"a number has at least 1 digit, got {digits}")
    train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
    if not (train.exists() and held_out.exists()):
        rng, rows, seen = random.Random(seed), [], set()
        for _ in range(10 * (num_train + num_eval)):
            row = sum_problem(rng, min_terms, max_terms, digits)
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
            if len(rows) == num_train + num_eval:
                break
        else:
            raise ValueError(f"only {len(rows)} distinct sums; asked for {num_train} train + {num_eval} eval")
        write_jsonl(rows[:num_eval], held_out)
        write_jsonl(rows[num_eval:], train)
    return train, held_out
