"""FrozenLake and Sokoban groups in one batch (ROLL's `tags` and `num_groups_partition`).

Each dataset row names its environment (`env_name`); `frozen_lake_share` of the rows are FrozenLake boards, the
rest Sokoban rooms, shuffled together, so a batch's groups split in that proportion on average. Evaluation sets
the same games up its own way (ROLL's val_env_manager): `eval_invalid_action_penalty`. The learner reports each
game's metrics on its own (`agent/frozen-lake/reward`, `agent/sokoban/success`, ...), evaluation each game's
accuracy (`eval/frozen-lake/accuracy`).
"""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.async_ppo_multi_turn import (AsyncPPOFrozenLakeConfig, AsyncPPOSokobanConfig, multi_turn_agent,
                                              refuse_unapplied_turn_discount, rollout_inactive_settings, walk_model)
from experiments.common import DatasetConfig, GenerationHyperparameters, ModelConfig, check_at_least, check_fraction
from rlsys.api.experiment import register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction
from rlsys.data.dataset import load_rows, write_jsonl
from rlsys.data.games import check_seeds
from rlsys.impl.agent.multi_turn import RolloutStrategy
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence
from rlsys.workers.env_per_row import ENV_NAME


@dataclass
class AsyncPPOMixedGamesConfig(AsyncPPOMATHConfig):
    max_steps: int = 200
    frozen_lake_share: float = 0.5
    """Share of the rows (so of a batch's groups, on average) that are FrozenLake; the rest are Sokoban."""
    num_turns: int = 8
    """Moves per episode in both games."""
    invalid_action_penalty: float = 0.1
    """Training: reward added (negated) for a response that is not a move."""
    eval_invalid_action_penalty: float = 0.0
    """Evaluation's own setting of the same penalty (0: held-out accuracy is the games' own reward alone)."""
    turn_discount: float = 1.0
    """The episode reward is sum_k turn_discount**(k-1) * (reward of move k)."""
    warm_start_hint: float = 0.25
    """Tiny model: share of warm-start moves that follow a shortest solution (the rest are random valid moves)."""
    rollout: RolloutStrategy = field(default_factory=RolloutStrategy)
    model: ModelConfig = field(default_factory=lambda: walk_model(warm_start_accuracy=0.8))
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_train=1000, num_eval=100))
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=4))

    warm_start_batch_size = AsyncPPOFrozenLakeConfig.warm_start_batch_size  # each game's walks, as on its own
    # Sokoban's schedule and 80%: FrozenLake's own (90%, up to 400 steps) stopped here at its limit at 85.5%, and
    # held-out accuracy went from 26% to 18% in 200 steps (BENCHMARKS.md, "FrozenLake's warm start stops above what
    # one move scores").
    warm_start_eval_every = AsyncPPOSokobanConfig.warm_start_eval_every
    warm_start_max_steps = AsyncPPOSokobanConfig.warm_start_max_steps

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.frozen_lake_share < 1:
            raise ValueError("frozen_lake_share must be in (0, 1): both games in the run, "
                             f"got {self.frozen_lake_share}")
        check_at_least("", self, num_turns=1, invalid_action_penalty=0, eval_invalid_action_penalty=0)
        check_fraction("", self, "turn_discount", "warm_start_hint")
        refuse_unapplied_turn_discount(self)

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        return {**super().inactive_settings(), "warm_start_hint": self.model.tiny_only(),
                **rollout_inactive_settings(self),
                "frozen_lake_share": (not self.dataset.path, f"with dataset.path set (the rows, and which game each "
                                      f"is, are read from {self.dataset.path!r})", "leave dataset.path empty for the "
                                      "generated mix")}

    def games(self, penalty: float | None = None) -> dict:
        """The two single-game experiments this one mixes, with their shares of the dataset."""
        share, d = self.frozen_lake_share, self.dataset
        common = dict(seed=self.seed, num_turns=self.num_turns, turn_discount=self.turn_discount,
                      warm_start_hint=self.warm_start_hint,
                      invalid_action_penalty=self.invalid_action_penalty if penalty is None else penalty)
        lake = DatasetConfig(num_train=max(1, round(share * d.num_train)), num_eval=max(1, round(share * d.num_eval)))
        room = DatasetConfig(num_train=max(1, d.num_train - lake.num_train),
                             num_eval=max(1, d.num_eval - lake.num_eval))
        return {"frozen-lake": AsyncPPOFrozenLakeConfig(dataset=lake, **common),
                "sokoban": AsyncPPOSokobanConfig(dataset=room, **common)}

    @property
    def envs(self) -> dict[str, EnvServiceAbstraction]:
        return {name: game.env for name, game in self.games().items()}

    @property
    def eval_envs(self) -> dict[str, EnvServiceAbstraction]:
        return {name: game.env for name, game in self.games(self.eval_invalid_action_penalty).items()}

    @property
    def env(self) -> EnvServiceAbstraction:
        return self.envs["frozen-lake"]

    @property
    def agent(self) -> AgentAbstraction:
        return multi_turn_agent(self, "text-game", num_turns=self.num_turns)

    def check_rows(self, rows: list[dict], path: str) -> None:
        check_seeds(rows, path)

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        """Each game's own generated rows, tagged with `env_name`, in one train and one held-out file."""
        d = self.dataset
        directory = data_dir / (f"mixed-games-{self.frozen_lake_share}-seed{self.seed}-{d.num_train}-{d.num_eval}")
        train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
        if train.exists() and held_out.exists():
            return train, held_out
        parts = {name: game.generate_dataset(data_dir) for name, game in self.games().items()}
        for index, path in ((0, train), (1, held_out)):
            rows = [{**row, ENV_NAME: name} for name, paths in parts.items() for row in load_rows(paths[index])]
            write_jsonl(rows, path)
        return train, held_out

    @property
    def warm_start_settings(self) -> dict:
        # "max_turns": the cache's key for num_turns, kept under its earlier name so that cached warm starts still count
        return {**super().warm_start_settings, "hint": self.warm_start_hint, "max_turns": self.num_turns,
                "share": self.frozen_lake_share}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """Each game's warm start on its own rows, together."""
        taught, checks = [], []
        for name, game in self.games().items():
            own = [[row for row in rows if row.get(ENV_NAME) == name] for rows in (train_rows, eval_rows)]
            game_taught, game_checks = game.warm_start_examples(tokenizer, *own)
            taught, checks = taught + game_taught, checks + game_checks
        return taught, checks


register_experiment("async-ppo-mixed-games", AsyncPPOMixedGamesConfig)
