"""Asynchronous PPO on math problems: the default experiment, and the class users subclass."""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.common import AsyncRLExperimentConfig, ModelConfig, PPOMATHConfig
from rlsys.api.experiment import register_experiment
from rlsys.api import AGENTS, AgentAbstraction, EnvServiceAbstraction
from rlsys.api.generation import VLLM_MAX_TEMPERATURE
from rlsys.data.arithmetic import generate_addition_dataset
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence, arithmetic_warm_start
from rlsys.plugins import load_function


# The math tasks' warm start goes on past its greedy accuracy until 3 problems in 4 get a right answer in their group
# of samples: how much RL gains follows that share (BENCHMARKS.md, "What a warm start leaves RL").
WARM_START_REACH = 0.75


def marks_void(agent: str) -> bool:
    """Whether the agent registered as `agent` may mark trajectories void; one not registered yet (a plugin's, or a
    misspelling the launcher reports) is given the benefit of the doubt."""
    try:
        return AGENTS.lookup(agent).marks_void
    except KeyError:
        return True


@dataclass
class AsyncPPOMATHConfig(AsyncRLExperimentConfig, PPOMATHConfig):
    # The tiny model's warm start: sequences a step, steps between held-out checks, and most steps before it stops
    # short of model.warm_start_accuracy (class attributes, not settings; experiments of long sequences take fewer).
    # 128 a step, not 64: the models it makes gain far more from RL (BENCHMARKS.md, "The warm start's batch").
    warm_start_batch_size = 128
    warm_start_eval_every = 25
    warm_start_max_steps = 3000
    model: ModelConfig = field(default_factory=lambda: ModelConfig(warm_start_reach=WARM_START_REACH))
    # 100 steps: most of the gain (a first result in minutes, install included); the held-out curve flattens after
    # (BENCHMARKS.md, "A first result in minutes"). The games keep 200: they learn less per step.
    max_steps: int = 100
    reward_funcs: list[str] = field(default_factory=list)
    """TRL GRPOTrainer reward functions (module:function or file.py:function) that score answers instead of
    math-verify, each called as TRL calls it: f(prompts, completions, **dataset columns) -> list[float | None]."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward_funcs entry (TRL's name); empty: 1 each."""

    def __post_init__(self):
        super().__post_init__()
        if self.inference.engine == "vllm" and self.gen.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(f"gen.temperature={self.gen.temperature} is more than vLLM takes "
                             f"({VLLM_MAX_TEMPERATURE} at most: it would refuse every rollout's request): lower it, "
                             "or set inference.engine=transformers")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs: "
                             "give one weight per function, or none")
        if not self.reward_funcs:
            return
        if type(self).env is not AsyncPPOMATHConfig.env or type(self).agent is not AsyncPPOMATHConfig.agent:
            raise ValueError(f"reward_funcs scores the single answer of the math-single-step agent; "
                             f"{type(self).__name__}'s episodes are scored by its own environment")
        for entry in self.reward_funcs:  # a missing module or function stops the run here, not episode by episode
            load_function(entry, "reward function", coroutine=False)

    @property
    def agent(self) -> AgentAbstraction:
        return AgentAbstraction(
            "math-single-step",
            args=dict(gconfig=self.gen.generation_config(n=self.group_size), tokenizer_path=self.model.path),
        )

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        names = sorted({agent.name for agent in [self.agent, *self.agents.values()]})
        return {**super().inactive_settings(), "ppo.mask_void_trajectories": (
            any(marks_void(name) for name in names), f"with agents that never mark a trajectory void ({names})",
            "use an agent that does (the multi-turn, text-game and tool-calling ones)")}

    @property
    def agents(self) -> dict[str, AgentAbstraction]:
        """Agents a dataset row may name in its `agent_name` field; rows without one use `agent`."""
        return {self.agent.name: self.agent}

    @property
    def env(self) -> EnvServiceAbstraction:
        if self.reward_funcs:  # held-out accuracy is then their mean reward, as TRL's eval reward is
            return EnvServiceAbstraction("trl-reward-funcs", args=dict(functions=list(self.reward_funcs),
                                                                       weights=list(self.reward_weights)))
        return EnvServiceAbstraction("math-code-single-step")

    @property
    def envs(self) -> dict[str, EnvServiceAbstraction]:
        """Environments a dataset row may name in its `env_name` field; rows without one use `env`."""
        return {self.env.name: self.env}

    @property
    def eval_envs(self) -> dict[str, EnvServiceAbstraction]:
        """The same names set up for evaluation (ROLL's val_env_manager); by default as in training."""
        return self.envs

    def check_rows(self, rows: list[dict], path: str) -> None:
        """DatasetError naming `path`'s first row this experiment cannot play, checked before any warm start; every
        row load_rows accepts has a prompt and an answer, all a math episode needs."""

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        """(train, held-out) JSONL written under `data_dir` when dataset.path is empty: seeded two-digit sums."""
        d = self.dataset
        directory = data_dir / f"addition-seed{self.seed}-{d.num_train}-{d.num_eval}"
        return generate_addition_dataset(directory, self.seed, d.num_train, d.num_eval)

    @property
    def warm_start_settings(self) -> dict:
        """What besides model.* and the dataset changes the warm start (part of the model's cache key): the schedule
        here; subclasses add what they teach."""
        return {"batch": self.warm_start_batch_size, "eval_every": self.warm_start_eval_every,
                "steps": self.warm_start_max_steps}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """What the tiny default model is taught before RL, and the held-out checks that stop the teaching."""
        return arithmetic_warm_start(tokenizer, train_rows, eval_rows)

    @property
    def tiny_model_caveat(self) -> str:
        """What a run on the tiny default model must expect that its warm start did not teach; empty: nothing. Said
        at start as a warning (rlsys/assets.py)."""
        return ""


register_experiment("async-ppo-math", AsyncPPOMATHConfig)
