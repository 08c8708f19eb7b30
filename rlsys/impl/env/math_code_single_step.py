"""`math-code-single-step`: one episode scores a group of answers to one problem against its reference.

Only math answers are checked here (by math-verify, in the shared worker pool with a hard timeout), so a
pathological answer costs at most `verify_timeout` seconds and never stalls the event loop.
"""

import asyncio
from typing import Any

from rlsys.api import EnvironmentService, register_environment
from rlsys.impl.env.math_verifier import shared_pool


class MathCodeSingleStepEnv(EnvironmentService):
    """One instance per episode: `reset` takes the reference answer, one `step` scores all answers and ends."""

    def __init__(self, verify_timeout: float = 5.0, verifier_workers: int | None = None):
        self.verify_timeout = verify_timeout
        self.verifier_workers = verifier_workers  # None: the shared pool's default size
        self.reference: str | None = None

    async def warm_up(self) -> None:
        await asyncio.to_thread(shared_pool(self.verifier_workers).wait_ready)

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if not options or "answer" not in options:
            raise KeyError(f"math-code-single-step needs options['answer'] (the reference); got {options!r}")
        self.reference = str(options["answer"])
        return None, {}

    async def step(self, action: tuple[Any, list[str]]) -> tuple[Any, list[float], bool, bool, dict]:
        """`action` is (qid, answers); rewards are 1.0 for a correct answer, else 0.0 (timeouts included)."""
        if self.reference is None:
            raise RuntimeError("step() before reset(): no reference answer to check against")
        _qid, answers = action
        verdicts = await shared_pool(self.verifier_workers).score(answers, self.reference, self.verify_timeout)
        rewards = [1.0 if v.correct else 0.0 for v in verdicts]
        info = {"statuses": [v.status for v in verdicts], "reasons": [v.reason for v in verdicts],
                "success": [v.correct for v in verdicts]}
        return None, rewards, True, False, info


register_environment("math-code-single-step", MathCodeSingleStepEnv)
