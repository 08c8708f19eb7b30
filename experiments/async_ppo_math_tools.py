"""Asynchronous PPO on math problems the model may solve with a calculator and a Python sandbox.

Picks the `tool-calling` agent and the `math-tools` environment; the call format is documented in
`rlsys/tools/call_format.py`. The tiny default model has 512 positions: the instructions (about 330 of them
with its character tokenizer) leave an episode about 150 tokens; a real model (`model.path`) has room.
"""

import dataclasses
from dataclasses import dataclass, field

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.common import GenerationHyperparameters, check_at_least
from rlsys.api.experiment import register_experiment
from rlsys.api import TOOLS, AgentAbstraction, EnvServiceAbstraction
from rlsys.tools.confinement import SandboxUnavailable, preflight
from rlsys.tools.sandbox import SandboxLimits


@dataclass
class AsyncPPOMATHToolsConfig(AsyncPPOMATHConfig):
    num_turns: int = 4
    """Model turns per episode; each turn may call tools or answer."""
    max_total_tokens: int = 1024
    """Token budget of an episode (prompt, turns and tool responses); capped at inference.max_model_len (if set) and
    at the model's positions."""
    tool_instructions: bool = True
    """Start with a system message describing the call format and the tools."""
    tools: list[str] = field(default_factory=lambda: ["calculator", "python"])
    """Tools offered to the model, by registered name."""
    python_persistent: bool = True
    """python tool: variables persist across the calls of an episode (earlier cells re-run silently)."""
    tool_output_chars: int = 1024
    """Longest tool response the model reads; the rest is cut."""
    tool_timeout: float = 30.0
    """Backstop deadline of any one tool call, in seconds (the sandbox's own limits come first)."""
    max_calls_per_turn: int = 4
    """Tool calls run per turn; further calls get an error response."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=256))

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """The python tool's own settings, which a run without it never reads; the calls' settings, which a run
        without tools never reads."""
        python = ("python" in self.tools, f"without the python tool (tools={list(self.tools)})",
                  "add python to tools")
        calls = (bool(self.tools), "without tools (tools=[])", "name a tool in tools")
        sandbox = [f"sandbox.{f.name}" for f in dataclasses.fields(SandboxLimits)]
        return {**super().inactive_settings(), **{name: python for name in ["python_persistent", *sandbox]},
                **{name: calls for name in ["tool_timeout", "max_calls_per_turn"]}}

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, num_turns=1, max_total_tokens=2, tool_output_chars=1, max_calls_per_turn=1)
        if self.tool_timeout <= 0:
            raise ValueError(f"tool_timeout must be positive, got {self.tool_timeout}")
        for name in self.tools:  # here, not in every episode's environment
            try:
                TOOLS.lookup(name)
            except KeyError as e:
                raise ValueError(f"tools: {e.args[0]}") from None
        if "python" in self.tools:  # the run stops here, saying why, if model code could not be confined
            try:
                preflight(self.sandbox.allow_unconfined)
            except SandboxUnavailable as e:  # a ValueError is what the command line reports as `error: ...`
                raise ValueError(str(e)) from None

    @property
    def tiny_model_caveat(self) -> str:
        # Its warm start is the arithmetic one (bare answers after bare prompts): the call format is never taught.
        return ("the tiny default model was warm-started on bare answers, never on the tool-call format: it emits "
                "neither <tool_call> nor <answer>, so every turn is void, every reward 0 and nothing trains "
                "(docs/tools.md). Give a chat model (model.path=...) to train tool use")

    @property
    def agent(self) -> AgentAbstraction:
        return AgentAbstraction("tool-calling", args=dict(
            gconfig=self.gen.generation_config(n=self.group_size), tokenizer_path=self.model.path,
            num_turns=self.num_turns,
            max_total_tokens=min(self.max_total_tokens, self.inference.max_model_len or self.max_total_tokens),
            use_instructions=self.tool_instructions))

    @property
    def env(self) -> EnvServiceAbstraction:
        python = dict(limits=dataclasses.asdict(self.sandbox), persistent=self.python_persistent,
                      max_output_chars=self.tool_output_chars)
        return EnvServiceAbstraction("math-tools", args=dict(
            tools={name: python if name == "python" else {} for name in self.tools},
            tool_timeout=self.tool_timeout, max_calls_per_turn=self.max_calls_per_turn,
            max_response_chars=self.tool_output_chars))


register_experiment("async-ppo-math-tools", AsyncPPOMATHToolsConfig)
