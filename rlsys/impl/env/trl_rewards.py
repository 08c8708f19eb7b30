"""`trl-reward-funcs`: a group's answers scored by reward functions written for TRL's `GRPOTrainer`, unchanged.

Each function is called as TRL calls it:

    function(prompts=[...], completions=[...], completion_ids=None, **columns) -> list[float | None]

one entry per answer of the group: `prompts` is the row's prompt as the dataset file holds it (a string, or a list
of chat messages; without `dataset.system_prompt` and `prompt_template`, which are rlsys's), `completions` the
answers (strings, or `[{"role": "assistant", "content": ...}]` where the prompt is a conversation), and every other
column of the row is a keyword argument holding one value per answer. The reward is the sum of the functions'
rewards times `weights` (1 each by default); a None (a function that does not apply to that answer) adds nothing, as
TRL's nansum. Functions run on a thread, off the rollout worker's event loop. One that raises or returns the wrong
number of rewards fails the episode (`env_error`) with its name; one that hangs is ended by `env_timeout`; the run
goes on either way. Each step's functions run on a daemon thread of their own (rlsys/blocking_calls.py): a hung one
holds that thread, not one of the event loop's default executor, and is counted as left running.
"""

import functools
import math
from typing import Any

from rlsys.api import EnvironmentService, register_environment
from rlsys.blocking_calls import on_own_thread
from rlsys.data.dataset import GIVEN_PROMPT
from rlsys.plugins import load_function

NOT_COLUMNS = ("prompt", "completion", "completions", "prompts", GIVEN_PROMPT)  # passed by name already


class TRLRewardFunctionsEnv(EnvironmentService):
    """One instance per episode: `reset` takes the dataset row, one `step` scores all answers and ends."""

    def __init__(self, functions: list[str], weights: list[float] | None = None):
        if not functions:
            raise ValueError("trl-reward-funcs needs at least one reward function (module:function)")
        weights = [1.0] * len(functions) if not weights else list(weights)
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} reward_weights for {len(functions)} reward_funcs: give one per function")
        self.functions = [(entry, load_function(entry, "reward function", coroutine=False)) for entry in functions]
        self.weights = weights
        self.row: dict | None = None

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if not options or "prompt" not in options:
            raise KeyError(f"trl-reward-funcs needs the dataset row, with its prompt; got {options!r}")
        self.row = dict(options)
        return None, {}

    async def step(self, action: tuple[Any, list[str]]) -> tuple[Any, list[float], bool, bool, dict]:
        """`action` is (qid, answers); each reward is the weighted sum of the functions' rewards for that answer."""
        if self.row is None:
            raise RuntimeError("step() before reset(): no dataset row to score against")
        _qid, answers = action
        rewards = await on_own_thread(functools.partial(self.score, answers), "trl-reward")
        return None, rewards, True, False, {"statuses": ["ok"] * len(answers)}

    def score(self, answers: list[str]) -> list[float]:
        prompt, n = self.row.get(GIVEN_PROMPT, self.row["prompt"]), len(answers)
        conversational = isinstance(prompt, list)
        completions = [[{"role": "assistant", "content": a}] for a in answers] if conversational else list(answers)
        columns = {k: [v] * n for k, v in self.row.items() if k not in NOT_COLUMNS}
        total = [0.0] * n
        for (entry, function), weight in zip(self.functions, self.weights):
            try:
                rewards = function(prompts=[prompt] * n, completions=completions, completion_ids=None, **columns)
            except Exception as e:
                raise RuntimeError(f"reward function {entry} raised {type(e).__name__}: {e}") from e
            if not isinstance(rewards, (list, tuple)) or len(rewards) != n:
                raise RuntimeError(f"reward function {entry} returned {rewards!r:.200}; expected a list of {n} rewards "
                                   "(float or None), one per completion")
            for i, r in enumerate(rewards):
                if r is not None and not (isinstance(r, (int, float)) and math.isfinite(r)):
                    raise RuntimeError(f"reward function {entry} returned {r!r:.80} for completion {i}: "
                                       "a reward is a finite number or None")
                total[i] += 0.0 if r is None else weight * float(r)
        return total


register_environment("trl-reward-funcs", TRLRewardFunctionsEnv)
