"""What a tiny model's warm start teaches and how it checks it: supervised sequences, held-out answers, and the
arithmetic tasks' pairs of them. Experiments and environments name these to describe their warm start; the torch
code that runs it is rlsys/model/tiny.py, imported only by whoever builds a model.
"""

from dataclasses import dataclass

from rlsys.model.tokenizer import row_prompt_ids


@dataclass
class TaughtSequence:
    """A supervised sequence: its token ids, and 1 for each token the model is taught to produce (0: context)."""

    token_ids: list[int]
    taught: list[int]


@dataclass
class AnswerCheck:
    """A held-out check: a context, and every answer counted right for it (greedy, exact after stripping)."""

    prompt_ids: list[int]
    accepted: tuple[str, ...]
    final_mark: str = ""
    """Non-empty: only what follows the last such mark counts, in the model's answer and in the accepted ones (the
    final number of a worked answer, all its reward reads); the model still has room for the longest accepted one."""

    def right(self, text: str) -> bool:
        return self.final(text) in {self.final(answer) for answer in self.accepted}

    def final(self, text: str) -> str:
        # Both sides stripped: a working whose first line is right-aligned starts with spaces.
        return (text.rsplit(self.final_mark, 1)[-1] if self.final_mark else text).strip()


def answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def arithmetic_warm_start(tokenizer, train_rows: list[dict],
                          eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
    """Each training prompt, as the rollout worker renders it, followed by its answer; held-out prompts to check."""
    taught = []
    for row in train_rows:
        prompt, answer = row_prompt_ids(tokenizer, row), answer_ids(tokenizer, row["answer"])
        taught.append(TaughtSequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return taught, [AnswerCheck(row_prompt_ids(tokenizer, row), (row["answer"],)) for row in eval_rows]
