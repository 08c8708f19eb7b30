"""The contracts plugins are written against: agents, environments, tools, trajectories, generation, and the
registries (experiments among them) that plugins join by name."""

from rlsys.api.agent import AGENTS, Agent, AgentAbstraction, make_agent, register_agent
from rlsys.api.env import ENVIRONMENTS, EnvironmentService, EnvServiceAbstraction, make_env, register_environment
from rlsys.api.experiment import EXPERIMENTS, register_experiment
from rlsys.api.generation import GenerationConfig, GenerationOutput, ModelRequest
from rlsys.api.model import Model
from rlsys.api.tool import TOOLS, Tool, ToolOutput, make_tool, register_tool
from rlsys.api.trajectory import NOT_GENERATED, Prompt, Trajectory

__all__ = [
    "AGENTS", "Agent", "AgentAbstraction", "make_agent", "register_agent",
    "ENVIRONMENTS", "EnvironmentService", "EnvServiceAbstraction", "make_env", "register_environment",
    "EXPERIMENTS", "register_experiment",
    "GenerationConfig", "GenerationOutput", "Model", "ModelRequest", "NOT_GENERATED", "Prompt", "Trajectory",
    "TOOLS", "Tool", "ToolOutput", "make_tool", "register_tool",
]
