"""Asynchronous PPO on math problems: the default experiment, and the class users subclass."""

from dataclasses import dataclass
from pathlib import Path

from experiments.common import AsyncRLExperimentConfig, PPOMATHConfig
from rlsys.api.experiment import register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction
from rlsys.data.arithmetic import generate_addition_dataset
from rlsys.model.tiny import AnswerCheck, TaughtSequence, arithmetic_warm_start


@dataclass
class AsyncPPOMATHConfig(AsyncRLExperimentConfig, PPOMATHConfig):
    warm_start_batch_size = 64  # tiny model's warm start: sequences a step, steps between held-out checks, and
    warm_start_eval_every = 25  # most steps before it stops short of model.warm_start_accuracy (class
    warm_start_max_steps = 3000  # attributes, not settings; experiments of long sequences take fewer)

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

    @property
    def envs(self) -> dict[str, EnvServiceAbstraction]:
        """Environments a dataset row may name in its `env_name` field; rows without one use `env`."""
        return {self.env.name: self.env}

    @property
    def eval_envs(self) -> dict[str, EnvServiceAbstraction]:
        """The same names set up for evaluation (ROLL's val_env_manager); by default as in training."""
        return self.envs

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        """(train, held-out) JSONL written under `data_dir` when dataset.path is empty: seeded two-digit sums."""
        d = self.dataset
        directory = data_dir / f"addition-seed{self.seed}-{d.num_train}-{d.num_eval}"
        return generate_addition_dataset(directory, self.seed, d.num_train, d.num_eval)

    @property
    def warm_start_settings(self) -> dict:
        """Settings besides model.* and the dataset that change the warm start (part of the model's cache key)."""
        return {}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """What the tiny default model is taught before RL, and the held-out checks that stop the teaching."""
        return arithmetic_warm_start(tokenizer, train_rows, eval_rows)


register_experiment("async-ppo-math", AsyncPPOMATHConfig)
