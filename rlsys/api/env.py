"""The environment contract: a gym-like async service that turns actions into observations and rewards."""

import abc
import copy
from dataclasses import dataclass, field
from typing import Any

from rlsys.api.registry import Registry


class EnvironmentService(abc.ABC):
    """Gym-like and async, so one slow episode never blocks the others.

    CPU-heavy work (answer checking, code execution) belongs off the event loop with a hard timeout. A method that
    may block (a synchronous reward function or client) may be written as a plain `def`: the rollout worker runs it
    on a thread of its own under `env_timeout`; an `async def` that blocks stops every episode of its worker.
    """

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        return None, {}

    @abc.abstractmethod
    async def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        """Returns (observation, reward, terminated, truncated, info)."""

    async def close(self) -> None:
        """Release what reset acquired. Called once at the end of every episode."""

    async def warm_up(self) -> None:
        """Start what every episode of this environment shares (a verifier pool, a reward model) and wait until
        it is ready. Called once per rollout worker, on one instance built for the purpose, before the first
        episode: otherwise the first episodes pay the start-up, and on a busy machine those seconds let them fall
        versions behind the episodes admitted after them."""

    @classmethod
    def check_args(cls, **args) -> None:
        """Raise ValueError for arguments no instance could run with (a missing model path), without building one:
        the launcher calls it before any role starts, where building would load what the environment loads. By
        default nothing is checked beyond the constructor's signature."""

    async def fork(self) -> "EnvironmentService":
        """An independent copy in the same state, for rollouts that branch: one per chain, one per tree branch.

        Chains fork before `reset`; a tree forks mid-episode. The copy is closed like any env. An env that
        holds something a copy cannot share (a process, a sandbox) overrides this or raises.
        """
        return copy.deepcopy(self)


@dataclass
class EnvServiceAbstraction:
    """An environment by registered name plus the keyword args for its constructor."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)


ENVIRONMENTS: Registry[EnvironmentService] = Registry("environment", EnvironmentService)


def register_environment(name: str, cls: type[EnvironmentService]) -> None:
    ENVIRONMENTS.register(name, cls)


def make_env(abstraction: EnvServiceAbstraction) -> EnvironmentService:
    return ENVIRONMENTS.make(abstraction.name, abstraction.args)
