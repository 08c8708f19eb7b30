"""Asynchronous PPO on any agent written against an OpenAI-compatible API (the `openai` client, LangGraph ...).

Picks the `openai-agent` agent (rlsys/impl/agent/openai_agent.py): each episode's runs of `agent_function`
call the rollout worker's endpoint with keys of their own, and train on exactly the tokens the model produced.
"""

from dataclasses import dataclass

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.common import check_at_least
from rlsys.api.experiment import register_experiment
from rlsys.api import AgentAbstraction
from rlsys.data.dataset import DatasetError


@dataclass
class AsyncPPOOpenAIAgentConfig(AsyncPPOMATHConfig):
    agent_function: str = "rlsys.impl.agent.langgraph_example:run"
    """The agent: `module:function` or `file.py:function`, an `async def run(base_url, api_key, prompt)` that
    returns the reward, or None to have the environment score its last answer."""
    agent_timeout: float = 300.0
    """Seconds one run of agent_function may take; past it the episode fails with agent_timeout."""
    max_total_tokens: int = 256
    """Token budget of one sample (prompt, turns, tool results); capped at inference.max_model_len when that is set
    (the tiny default model has 512 positions)."""
    endpoint_host: str = "127.0.0.1"
    """Where the rollout worker's endpoint listens (each episode's API key is a random secret)."""

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """dataset.system_prompt, which never reaches the model here: agent_function gets the prompt's text alone."""
        return {**super().inactive_settings(), "dataset.system_prompt": (
            False, "with the openai-agent (agent_function gets the prompt's text alone and writes its own messages)",
            "put the system message in agent_function's messages")}

    def check_rows(self, rows: list[dict], path: str) -> None:
        """A row of several chat messages would reach agent_function as its last user message alone."""
        agents = {None: self.agent, **self.agents}
        for number, row in enumerate(rows, 1):
            if "messages" in row and agents[row.get("agent_name")].name == "openai-agent":
                raise DatasetError(f"{path}: row {number}: field {self.dataset.prompt_key!r} is a chat of "
                                   f"{len(row['messages'])} messages, and agent_function is given the text of its "
                                   "last user message alone: give the prompt as text, or send the rest from "
                                   "agent_function")

    def __post_init__(self):
        super().__post_init__()
        # Here, not only where the agent is built: that is after the dataset and tiny model are ready, minutes later
        if self.agent_timeout <= 0:
            raise ValueError(f"agent_timeout must be positive, got {self.agent_timeout}")
        check_at_least("", self, max_total_tokens=2)  # a prompt and a reply: less refuses every call of every run

    @property
    def agent(self) -> AgentAbstraction:
        return AgentAbstraction("openai-agent", args=dict(
            gconfig=self.gen.generation_config(n=self.group_size), tokenizer_path=self.model.path,
            run=self.agent_function,
            max_total_tokens=min(self.max_total_tokens, self.inference.max_model_len or self.max_total_tokens),
            timeout=self.agent_timeout, host=self.endpoint_host))


register_experiment("async-ppo-openai-agent", AsyncPPOOpenAIAgentConfig)
