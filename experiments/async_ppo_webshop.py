"""A shopping agent (WebShop): the `text-game` agent searches a generated catalog, opens items, picks options and buys.

The environment, its pages, actions and reward are described in `rlsys/impl/env/webshop.py`.
"""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.async_ppo_multi_turn import multi_turn_agent
from experiments.common import DatasetConfig, GenerationHyperparameters, ModelConfig
from experiments.registry import register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction, make_env
from rlsys.data.webshop import generate_webshop_dataset, shop_walks
from rlsys.impl.agent.multi_turn import RolloutStrategy
from rlsys.model.tiny import AnswerCheck, TaughtSequence

WARM_START_TASKS = 600  # walks through this many training tasks: a few thousand actions


@dataclass
class AsyncPPOWebShopConfig(AsyncPPOMATHConfig):
    num_products: int = 100
    """Products in the generated catalog (its seed is the experiment's seed)."""
    results_per_page: int = 3
    """Products a search lists."""
    max_turns: int = 8
    """Actions per episode; the env truncates the episode after this many."""
    invalid_action_penalty: float = 0.0
    """Reward added (negated) for an action the page does not offer; WebShop has none."""
    turn_discount: float = 1.0
    """The episode reward is sum_k turn_discount**(k-1) * (reward of action k); only buying earns one."""
    warm_start_hint: float = 0.5
    """Tiny model: share of warm-start actions that are the expert's (the rest are random valid actions)."""
    rollout: RolloutStrategy = field(default_factory=RolloutStrategy)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(warm_start_accuracy=0.5))
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_train=2000, num_eval=200))
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=40))

    def __post_init__(self):
        super().__post_init__()
        if self.results_per_page < 1 or self.num_products < 1:
            raise ValueError(f"results_per_page and num_products must be at least 1, got {self.results_per_page} "
                             f"and {self.num_products}")

    @property
    def env(self) -> EnvServiceAbstraction:
        return EnvServiceAbstraction("webshop", args=dict(
            num_products=self.num_products, catalog_seed=self.seed, results_per_page=self.results_per_page,
            max_steps=self.max_turns, invalid_action_penalty=self.invalid_action_penalty))

    @property
    def agent(self) -> AgentAbstraction:
        return multi_turn_agent(self, "text-game", max_turns=self.max_turns)

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        d = self.dataset
        directory = data_dir / (f"webshop-products{self.num_products}-page{self.results_per_page}-seed{self.seed}-"
                                f"{d.num_train}-{d.num_eval}")
        return generate_webshop_dataset(directory, make_env(self.env), self.seed, d.num_train, d.num_eval)

    @property
    def warm_start_settings(self) -> dict:
        return {"hint": self.warm_start_hint, "max_turns": self.max_turns}

    def warm_start_examples(self, tokenizer, train_rows: list[dict],
                            eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
        """Walks through the shop, half the expert's actions: the format and the pages; RL learns to buy well."""
        env, turns, hint = make_env(self.env), self.max_turns, self.warm_start_hint
        taught, _ = shop_walks(tokenizer, env, train_rows[:WARM_START_TASKS], turns, self.seed, hint)
        _, checks = shop_walks(tokenizer, env, eval_rows[:WARM_START_TASKS // 10], turns, self.seed + 1, hint)
        return taught, checks


register_experiment("async-ppo-webshop", AsyncPPOWebShopConfig)
