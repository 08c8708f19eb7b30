"""Asynchronous PPO on math problems: the default experiment, and the class users subclass."""

from dataclasses import dataclass

from experiments.common import AsyncRLExperimentConfig, PPOMATHConfig
from experiments.registry import register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction


@dataclass
class AsyncPPOMATHConfig(AsyncRLExperimentConfig, PPOMATHConfig):
    @property
    def agent(self) -> AgentAbstraction:
        return AgentAbstraction(
            "math-single-step",
            args=dict(gconfig=self.gen.generation_config(n=self.group_size), tokenizer_path=self.model.path),
        )

    @property
    def agents(self) -> dict[str, AgentAbstraction]:
        """Agents a dataset row may name in its `agent_name` field; rows without one use `agent`."""
        return {self.agent.name: self.agent}

    @property
    def env(self) -> EnvServiceAbstraction:
        return EnvServiceAbstraction("math-code-single-step")


register_experiment("async-ppo-math", AsyncPPOMATHConfig)
