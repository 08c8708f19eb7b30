"""Asynchronous PPO on long sums with the working written out: answers of about ninety tokens, as in reasoning RL.

The default task's answers are a few tokens, so its steps are mostly training; in reasoning RL they are
mostly generating. Here every answer works a sum of several numbers out line by line before its total
(`rlsys/data/worked_sums.py`): about ninety tokens from the same tiny model, scored by the same math check. On a GPU
generating bounds rlsys's step of this task; on 2 CPU cores training does, and generating is about 40% of a
synchronous step (BENCHMARKS.md, "The long task on a CPU").
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.common import DatasetConfig, GenerationHyperparameters, ModelConfig
from rlsys.api.experiment import register_experiment
from rlsys.data.dataset import DatasetError
from rlsys.data.worked_sums import FINAL, generate_worked_sums_dataset, prompt_width, term_range, worked_sum
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence, arithmetic_warm_start


@dataclass
class AsyncPPOMathLongConfig(AsyncPPOMATHConfig):
    min_terms: int = 6
    """Generated set: fewest numbers in a sum (6 or more keeps every working 64 characters or longer)."""
    max_terms: int = 8
    """Generated set: most numbers in a sum (its working must fit in gen.max_new_tokens)."""
    term_digits: int = 1
    """Generated set: digits of each number in a sum (2 makes every line a three-digit addition: hours of warm start
    on a CPU)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(warm_start_accuracy=0.35))
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=128))
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_train=20000, num_eval=500))

    # Each working teaches several additions and a hundred copied characters where a default answer teaches one
    # addition, so fewer sequences a step.
    warm_start_batch_size = 32
    warm_start_eval_every = 100
    warm_start_max_steps = 3000

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        generated = (not self.dataset.path, f"with dataset.path set (the sums are read from {self.dataset.path!r})",
                     "leave dataset.path empty for the generated set")
        return {**super().inactive_settings(),
                **{name: generated for name in ("min_terms", "max_terms", "term_digits")}}

    def __post_init__(self):
        super().__post_init__()
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"min_terms must be at least 2 and at most max_terms, got {self.min_terms} and "
                             f"{self.max_terms}")
        if self.term_digits < 1:
            raise ValueError(f"term_digits must be at least 1, got {self.term_digits}")
        largest = [term_range(self.term_digits)[-1]] * self.max_terms
        # the working's tokens and the end-of-sequence token
        longest = len(worked_sum(largest, prompt_width(self.max_terms, self.term_digits))) + 1
        if longest > self.gen.max_new_tokens:
            raise ValueError(f"a working of max_terms={self.max_terms} numbers of term_digits={self.term_digits} "
                             f"takes up to {longest} tokens; "
                             f"gen.max_new_tokens={self.gen.max_new_tokens} would cut it short: set "
                             f"gen.max_new_tokens={longest} or more, or fewer max_terms")

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        """Seeded sums of min_terms to max_terms numbers of term_digits digits, each row with its working."""
        d = self.dataset
        name = (f"worked-sums-{self.min_terms}to{self.max_terms}x{self.term_digits}-seed{self.seed}-{d.num_train}-"
                f"{d.num_eval}")
        return generate_worked_sums_dataset(data_dir / name, self.seed, d.num_train, d.num_eval, self.min_terms,
                                            self.max_terms, self.term_digits)

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """The working is taught; a held-out answer counts when its final number is right, as the reward reads it.

        Not the whole working to the letter: RL rewards the final number alone, and a working with a slip in a middle
        line and the right total earns it (BENCHMARKS.md, "The long task's warm start")."""
        for rows, path in ((train_rows, self.dataset.path), (eval_rows, self.dataset.eval_path)):
            if (lacking := next((n for n, row in enumerate(rows, 1) if not isinstance(row.get("solution"), str)),
                                None)) is not None:
                raise DatasetError(f"{path}: row {lacking}: field 'solution' missing or not a string: the warm start "
                                   "teaches each row's working, its `solution`; give model.path, or leave "
                                   "dataset.path empty for the generated sums")
        worked = [[{**row, "answer": row["solution"]} for row in rows]  # its messages too, as the run sends them
                  for rows in (train_rows, eval_rows)]
        taught, checks = arithmetic_warm_start(tokenizer, *worked)
        return taught, [replace(check, final_mark=FINAL) for check in checks]

    @property
    def warm_start_settings(self) -> dict:
        return {**super().warm_start_settings, "checked": "final number"}


register_experiment("async-ppo-math-long", AsyncPPOMathLongConfig)
