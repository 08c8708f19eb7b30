"""The contracts plugins are written against: agents, environments, trajectories, generation."""

from rlsys.api.agent import AGENTS, Agent, AgentAbstraction, make_agent, register_agent
from rlsys.api.env import ENVIRONMENTS, EnvironmentService, EnvServiceAbstraction, make_env, register_environment
from rlsys.api.generation import GenerationConfig, GenerationOutput
from rlsys.api.model import Model
from rlsys.api.tool import TOOLS, Tool, ToolOutput, make_tool, register_tool
from rlsys.api.trajectory import NOT_GENERATED, Prompt, Trajectory

__all__ = [
    "AGENTS", "Agent", "AgentAbstraction", "make_agent", "register_agent",
    "ENVIRONMENTS", "EnvironmentService", "EnvServiceAbstraction", "make_env", "register_environment",
    "GenerationConfig", "GenerationOutput", "Model", "NOT_GENERATED", "Prompt", "Trajectory",
    "TOOLS", "Tool", "ToolOutput", "make_tool", "register_tool",
]
