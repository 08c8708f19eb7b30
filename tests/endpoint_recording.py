"""A plugin for the endpoint's full-loop tests: the `openai-agent` experiment, with an agent that also writes,
per episode, what the engine sent back for every call and the trajectories built from them (JSONL)."""

import json
from dataclasses import dataclass

from experiments import AsyncPPOOpenAIAgentConfig, register_experiment
from rlsys.api import AgentAbstraction, register_agent
from rlsys.impl.agent.openai_agent import OpenAIAgent


class RecordingOpenAIAgent(OpenAIAgent):
    def __init__(self, record_path: str, **kwargs):
        super().__init__(**kwargs)
        self.record_path = record_path

    async def trajectories(self, prompt, env, sessions, rewards):
        trajectories = await super().trajectories(prompt, env, sessions, rewards)
        with open(self.record_path, "a") as f:
            f.write(json.dumps({"qid": prompt.qid, "calls": [[o.to_dict() for o in s.outputs] for s in sessions],
                                "trajectories": [t.to_dict() for t in trajectories]}) + "\n")
        return trajectories


register_agent("recording-openai-agent", RecordingOpenAIAgent)


@dataclass
class RecordingOpenAIAgentConfig(AsyncPPOOpenAIAgentConfig):
    record_path: str = ""
    """Where the recording agent appends each episode's engine replies and trajectories."""

    @property
    def agent(self) -> AgentAbstraction:
        agent = super().agent
        return AgentAbstraction("recording-openai-agent", {**agent.args, "record_path": self.record_path})


register_experiment("recording-openai-agent", RecordingOpenAIAgentConfig)
