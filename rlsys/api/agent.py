"""The agent contract: an episode's logic, talking to the model only through two queues."""

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any

from rlsys.api.env import EnvironmentService
from rlsys.api.registry import Registry
from rlsys.api.trajectory import Prompt, Trajectory


class Agent(abc.ABC):
    """Implement `collect_trajectory`; register the class with `register_agent`.

    The agent puts a `ModelRequest(qid, token_ids, GenerationConfig)` (or that plain tuple) on `obs_queue` and
    gets the matching `GenerationOutput`, under the same qid, from `act_queue`. It must keep exactly the tokens the
    model produced.
    """

    marks_void = False  # whether its trajectories may be void (Trajectory.void), which ppo.mask_void_trajectories reads

    @abc.abstractmethod
    async def collect_trajectory(
        self,
        prompt: Prompt,
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> list[Trajectory]:
        ...


@dataclass
class AgentAbstraction:
    """An agent by registered name plus the keyword args for its constructor."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)


AGENTS: Registry[Agent] = Registry("agent", Agent)


def register_agent(name: str, cls: type[Agent]) -> None:
    AGENTS.register(name, cls)


def make_agent(abstraction: AgentAbstraction) -> Agent:
    return AGENTS.make(abstraction.name, abstraction.args)
