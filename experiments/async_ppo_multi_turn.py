"""Multi-turn experiments: math with retries after feedback, and text games (FrozenLake, Sokoban).

Each picks its rollout strategy with `rollout.mode=chain|tree`, `rollout.tree_branching`, `rollout.tree_depth`
and `rollout.single_turn_samples`, and its advantage estimator with `ppo.adv_estimator=` (starpo, gigpo, ...).
"""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.async_ppo_math import WARM_START_REACH, AsyncPPOMATHConfig
from experiments.common import DatasetConfig, GenerationHyperparameters, InferenceConfig, ModelConfig, \
    PPOHyperparameters, check_at_least, check_fraction
from rlsys.api.experiment import register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction, make_env
from rlsys.data.games import check_seeds, generate_game_dataset, random_walks
from rlsys.impl.agent.math_multi_turn import retry_sequences
from rlsys.impl.agent.multi_turn import RolloutStrategy
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence

WARM_START_PUZZLES = 500  # random walks through this many training puzzles: thousands of moves, in a few seconds


def walk_model(warm_start_accuracy: float) -> ModelConfig:
    """The tiny model of the turn-based experiments: half as wide and half as deep as the math one (0.3M
    parameters, the same head size), so that its warm start on walks of a few hundred tokens takes under
    a minute on 2 cores instead of many (BENCHMARKS.md, "Cold starts")."""
    return ModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                       warm_start_accuracy=warm_start_accuracy)


def multi_turn_agent(config, name: str, **own_args) -> AgentAbstraction:
    """A MultiTurnAgent with the settings every one takes, from the experiment, plus its own."""
    return AgentAbstraction(name, args=dict(
        gconfig=config.gen.generation_config(n=config.group_size), tokenizer_path=config.model.path,
        turn_discount=config.turn_discount, strategy=config.rollout,
        max_context_tokens=config.inference.max_model_len, **own_args))


def refuse_unapplied_turn_discount(config) -> None:
    """turn_discount shapes each episode's reward, sum_k turn_discount**(k-1) r_k (Trajectory.reward), which grpo and
    reinforce train on. starpo (and gigpo's episode part) sum the turn rewards undiscounted and gae discounts them per
    token by ppo.gamma: on whole episodes a discount other than 1 would change the logged rewards and not the update."""
    estimator = config.ppo.adv_estimator
    if config.turn_discount != 1 and estimator in TURN_REWARD_ESTIMATORS and not config.rollout.single_turn_samples:
        raise ValueError(f"turn_discount={config.turn_discount} is not applied by ppo.adv_estimator={estimator}, "
                         f"which {TURN_REWARD_ESTIMATORS[estimator]}: set turn_discount=1, or "
                         "rollout.single_turn_samples=true (each turn's reward is then its discounted return), or "
                         "ppo.adv_estimator=grpo or reinforce (which train on the discounted episode reward)")


def rollout_inactive_settings(config) -> dict[str, tuple[bool, str, str]]:
    """The rollout strategy, turn_discount and GiGPO's step discount where the episodes make them do nothing (an
    `inactive_settings` table): greedy rollouts never branch nor split an episode into its turns (MultiTurnAgent), an
    episode of one turn (num_turns=1) has no second turn to branch at, train
    apart or discount, a sample of one turn (single_turn_samples) none either, and a tree of depth 0 or of one branch
    per node is a chain."""
    turns, rollout = config.num_turns, config.rollout
    sampled = (config.gen.temperature > 0, "with gen.temperature=0 (greedy rollouts neither branch nor split into "
                                           "turns)", "give gen.temperature above 0")
    several = (turns > 1, "with num_turns=1 (an episode of one turn)", "set num_turns to 2 or more")
    wide = (rollout.tree_branching > 1, "with rollout.tree_branching=1 (one response a node: a chain)",
            "set rollout.tree_branching to 2 or more")
    deep = (rollout.tree_depth > 0, "with rollout.tree_depth=0 (no turn branches)",
            "set rollout.tree_depth to 1 or more")
    whole = (not rollout.single_turn_samples, "with rollout.single_turn_samples=true (each sample is one turn, whose "
             "step return is its own reward)", "leave rollout.single_turn_samples false")
    return {"rollout.mode": first_inactive(sampled, several, wide, deep),
            "rollout.single_turn_samples": first_inactive(sampled, several), "turn_discount": several,
            # GiGPO discounts a step's return over the later turns of its trajectory: there are none to discount
            "ppo.gigpo_step_gamma": first_inactive(several, whole)}


def first_inactive(*conditions: tuple[bool, str, str]) -> tuple[bool, str, str]:
    """The first condition that does not hold (its reason and fix), or one that does: a setting needing them all."""
    return next((condition for condition in conditions if not condition[0]), conditions[0])


TURN_REWARD_ESTIMATORS = {  # those that read the turn rewards, not the episode's discounted reward
    "starpo": "sums each episode's turn rewards undiscounted",
    "gigpo": "sums each episode's turn rewards undiscounted for its episode advantage (ppo.gigpo_step_gamma "
             "discounts its step returns)",
    "gae": "puts each turn's reward on its last token and discounts per token by ppo.gamma",
}


@dataclass
class AsyncPPOMathMultiTurnConfig(AsyncPPOMATHConfig):
    # A step trains about 12k tokens where the math experiment's trains 1.6k (each retry's prompt carries the
    # feedback turn), so fewer steps at a higher rate. The warm start stops on the math experiment's reach rule (3
    # first attempts in 4 with a right answer among the group's samples): a model stopped on greedy accuracy alone
    # could score 31% on its checks and 21% on all held-out problems, and RL gained 2-3 points from it. Each chain
    # weighs the same in the loss: weighed per token, a chain that failed three attempts counts three times one
    # right at once, and the update pushed sampled answers down more than up (BENCHMARKS.md, "Multi-turn math with
    # its defaults").
    max_steps: int = 60
    eval_steps: int = 30
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(warm_start_accuracy=0.25, warm_start_reach=WARM_START_REACH))
    ppo: PPOHyperparameters = field(
        default_factory=lambda: PPOHyperparameters(lr=1e-4, loss_agg_mode="seq-mean-token-mean"))
    num_turns: int = 3
    """Attempts per problem: after a wrong answer the model is told so and tries again."""
    turn_discount: float = 0.5
    """A success at attempt k earns turn_discount**(k-1), so a first-try answer is worth the most."""
    rollout: RolloutStrategy = field(default_factory=RolloutStrategy)

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        return {**super().inactive_settings(), **rollout_inactive_settings(self)}

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, num_turns=1)
        check_fraction("", self, "turn_discount")
        refuse_unapplied_turn_discount(self)

    @property
    def agent(self) -> AgentAbstraction:
        return multi_turn_agent(self, "math-multi-turn", num_turns=self.num_turns)

    def held_out_score(self, trajectory) -> float:
        """First-attempt accuracy, as the single-turn experiment counts it; what retries add shows in the
        held-out reward (`eval/reward_of_ended`), a success at attempt k worth turn_discount**(k-1)."""
        if "first_turn_success" not in trajectory.metrics:
            raise ValueError(f"{type(self).__name__} scores held-out episodes by first-attempt success, which a "
                             "MultiTurnAgent records (metrics['first_turn_success']); this agent's trajectories lack "
                             "it: record it, or override held_out_score")
        return trajectory.metrics["first_turn_success"]

    # One problem in this many is also taught as a retry after a wrong answer. Every other one (a third of the
    # warm start's sequences, each three times as long) held back the first answers the warm start is checked
    # on: 16 minutes from an empty cache where the math experiment takes a few.
    warm_start_retry_every = 8

    @property
    def warm_start_settings(self) -> dict:
        return {**super().warm_start_settings, "retry_every": self.warm_start_retry_every}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """Arithmetic, plus some problems as a retry after a wrong answer; checked on first answers."""
        taught, checks = super().warm_start_examples(tokenizer, train_rows, eval_rows)
        return taught + retry_sequences(tokenizer, train_rows[::self.warm_start_retry_every], self.seed), checks


@dataclass
class AsyncPPOTurnBasedConfig(AsyncPPOMATHConfig):
    """An environment played turn by turn by the `text-game` agent; subclasses name the env and how to walk it."""

    max_steps: int = 200
    num_turns: int = 8
    """Actions per episode; the env truncates the episode after this many."""
    invalid_action_penalty: float = 0.1
    """Reward added (negated) for a response that is not a valid action; the state stays as it was."""
    turn_discount: float = 1.0
    """The episode reward is sum_k turn_discount**(k-1) * (reward of action k)."""
    warm_start_hint: float = 0.25
    """Tiny model: share of warm-start actions that are the expert's (the rest are random valid actions)."""
    rollout: RolloutStrategy = field(default_factory=RolloutStrategy)
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_train=2000, num_eval=200))

    warm_start_tasks = WARM_START_PUZZLES  # training tasks walked for the warm start (class attributes,
    walks = staticmethod(random_walks)     # not settings): walks(tokenizer, env, rows, turns, seed, hint)
    warm_start_batch_size = 16  # a walk teaches every move it makes: 16 of them a step are a hundred moves
    warm_start_eval_every = 5
    warm_start_max_steps = 40  # about one pass over the walks: a minute or two on 2 cores, threshold reached or not

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        return {**super().inactive_settings(), "warm_start_hint": self.model.tiny_only(),
                **rollout_inactive_settings(self)}

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, num_turns=1, invalid_action_penalty=0)
        check_fraction("", self, "turn_discount", "warm_start_hint")
        refuse_unapplied_turn_discount(self)

    @property
    def agent(self) -> AgentAbstraction:
        return multi_turn_agent(self, "text-game", num_turns=self.num_turns)

    def check_rows(self, rows: list[dict], path: str) -> None:
        check_seeds(rows, path)

    @property
    def warm_start_settings(self) -> dict:
        # "max_turns": the cache's key for num_turns, kept under its earlier name so that cached warm starts still count
        return {**super().warm_start_settings, "hint": self.warm_start_hint, "max_turns": self.num_turns}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """Walks of valid actions, a share of them the expert's: the format and the rules; RL finds the goal."""
        env, turns, hint, n = make_env(self.env), self.num_turns, self.warm_start_hint, self.warm_start_tasks
        taught, _ = self.walks(tokenizer, env, train_rows[:n], turns, self.seed, hint)
        _, checks = self.walks(tokenizer, env, eval_rows[:n // 10], turns, self.seed + 1, hint)
        return taught, checks


@dataclass
class AsyncPPOTextGameConfig(AsyncPPOTurnBasedConfig):
    """A text game (a board puzzle); subclasses name the env and its board options."""

    game_size: int = 4
    """Board side, in cells."""
    model: ModelConfig = field(default_factory=lambda: walk_model(warm_start_accuracy=0.8))
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=4))

    env_name = ""  # the registered environment (a class attribute, not a setting)

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, game_size=2)

    @property
    def board_options(self) -> dict:
        """What a dataset row says about its board besides the seed (the env rebuilds the puzzle from both)."""
        return {"size": self.game_size}

    @property
    def env_args(self) -> dict:
        return dict(max_steps=self.num_turns, invalid_action_penalty=self.invalid_action_penalty,
                    **self.board_options)

    @property
    def env(self) -> EnvServiceAbstraction:
        return EnvServiceAbstraction(self.env_name, args=self.env_args)

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        """Distinct seeded puzzles, train and held-out disjoint; each row is one puzzle (its seed and options)."""
        d, options = self.dataset, self.board_options
        name = "-".join(f"{k}{v}" for k, v in options.items())
        directory = data_dir / f"{self.env_name}-{name}-seed{self.seed}-{d.num_train}-{d.num_eval}"
        return generate_game_dataset(directory, make_env(self.env), options, self.seed, d.num_train, d.num_eval)


@dataclass
class AsyncPPOFrozenLakeConfig(AsyncPPOTextGameConfig):
    frozen_prob: float = 0.8
    """Chance that a cell is ice rather than a hole (maps are redrawn until the goal is reachable)."""

    # Answering R to every board is a valid move at 78-83% of the held-out checks (seeds 1-3), so the text games'
    # 80% let a warm start stop before the model's moves depended on the board, and its greedy policy answered one
    # move to most boards (BENCHMARKS.md, "FrozenLake's warm start stops above what one move scores").
    model: ModelConfig = field(default_factory=lambda: walk_model(warm_start_accuracy=0.9))

    env_name = "frozen-lake"
    warm_start_eval_every = 25
    warm_start_max_steps = 400  # seeds 1-3 reached 90% in 12-23 s on 2 cores, seed 1 at step 225

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.frozen_prob <= 1:  # at 0 every map is holes: drawn again and again, forever
            raise ValueError(f"frozen_prob must be in (0, 1], got {self.frozen_prob}")

    @property
    def board_options(self) -> dict:
        return {"size": self.game_size, "frozen_prob": self.frozen_prob}


@dataclass
class AsyncPPOSokobanConfig(AsyncPPOTextGameConfig):
    game_size: int = 6
    """Room side, in cells, walls included."""
    num_boxes: int = 1
    """Boxes (and targets) per room."""
    inference: InferenceConfig = field(default_factory=lambda: InferenceConfig(max_model_len=512))
    # One box in a 6x6 room: about 1,300 distinct puzzles turn up among 110,000 draws.
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_train=1000, num_eval=100))

    env_name = "sokoban"

    def __post_init__(self):
        super().__post_init__()
        room = (self.game_size - 2) ** 2  # cells inside the walls: each box and the player need one, and room to move
        if self.game_size < 4 or not 1 <= self.num_boxes <= room - 2:
            raise ValueError(f"a {self.game_size}x{self.game_size} room holds 1 to {max(room - 2, 0)} boxes with "
                             f"game_size at least 4; got game_size={self.game_size}, num_boxes={self.num_boxes}")

    @property
    def board_options(self) -> dict:
        return {"size": self.game_size, "num_boxes": self.num_boxes}


register_experiment("async-ppo-math-multi-turn", AsyncPPOMathMultiTurnConfig)
register_experiment("async-ppo-frozen-lake", AsyncPPOFrozenLakeConfig)
register_experiment("async-ppo-sokoban", AsyncPPOSokobanConfig)
