"""The task bench/env_latency.py runs (a plugin: `plugins=[bench/env_latency_task.py]`): three sums in one
conversation, each answer checked by an environment that takes `env_latency` seconds to reply.

The dataset row's problem ("71+73=") is turn 1; after each answer the environment waits, scores it (1 if
exact), and asks the next sum (two more, drawn from the row's problem, so every run asks the same ones) as
the next user message. Every episode has exactly three turns, so three waits. The `text-game` agent plays
it (one chain per sample, turns concurrent across chains); the model, data and warm start are the default
run's, so the learner trains the default task's model on short three-turn conversations.
"""

import asyncio
import random
from dataclasses import dataclass, field

from experiments import AsyncPPOMATHConfig, register_experiment
from experiments.async_ppo_multi_turn import multi_turn_agent
from rlsys.api import AgentAbstraction, EnvironmentService, EnvServiceAbstraction, register_environment
from rlsys.impl.agent.multi_turn import RolloutStrategy


class SlowSumsEnv(EnvironmentService):
    """`turns` sums in a row; step(answer) replies after `latency` seconds (asyncio.sleep: a remote service)."""

    def __init__(self, turns: int = 3, latency: float = 0.5):
        self.turns, self.latency = turns, latency
        self.problems: list[tuple[str, int]] = []
        self.turn = 0

    async def reset(self, seed=None, options=None):
        first = options["prompt"]
        rng = random.Random(first)  # a str seed is hashed the same in every process
        self.problems = [(first, int(options["answer"]))]
        for _ in range(self.turns - 1):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            self.problems.append((f"{a}+{b}=", a + b))
        self.turn = 0
        return first, {}

    async def step(self, action: str):
        await asyncio.sleep(self.latency)
        answer = action.strip()
        reward = float(answer == str(self.problems[self.turn][1]))
        self.turn += 1
        done = self.turn == self.turns
        valid = answer.isdigit()
        info = {"success": done, "action_is_valid": valid, "action_is_effective": valid}
        return None if done else self.problems[self.turn][0], reward, done, False, info


@dataclass
class EnvLatencyConfig(AsyncPPOMATHConfig):
    env_latency: float = 0.5
    """Seconds the environment takes to reply to each answer."""
    num_turns: int = 3
    """Sums per conversation (every episode has exactly this many turns)."""
    turn_discount: float = 1.0
    """The episode reward is sum_k turn_discount**(k-1) * (1 if sum k was right)."""
    rollout: RolloutStrategy = field(default_factory=RolloutStrategy)

    @property
    def agent(self) -> AgentAbstraction:
        return multi_turn_agent(self, "text-game", num_turns=self.num_turns)

    @property
    def env(self) -> EnvServiceAbstraction:
        return EnvServiceAbstraction("slow-sums", args=dict(turns=self.num_turns, latency=self.env_latency))


register_environment("slow-sums", SlowSumsEnv)
register_experiment("env-latency-sums", EnvLatencyConfig)
