"""A shopping agent (WebShop): the `text-game` agent searches a generated catalog, opens items, picks options and buys.

The environment, its pages, actions and reward are described in `rlsys/impl/env/webshop.py`.
"""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.async_ppo_multi_turn import AsyncPPOTurnBasedConfig, walk_model
from experiments.common import GenerationHyperparameters, ModelConfig
from rlsys.api.experiment import register_experiment
from rlsys.api import EnvServiceAbstraction, make_env
from rlsys.data.webshop import generate_webshop_dataset, shop_walks

WARM_START_TASKS = 600  # walks through this many training tasks: a few thousand actions


@dataclass
class AsyncPPOWebShopConfig(AsyncPPOTurnBasedConfig):
    num_products: int = 100
    """Products in the generated catalog (its seed is the experiment's seed)."""
    results_per_page: int = 3
    """Products a search lists."""
    invalid_action_penalty: float = 0.0
    """Reward added (negated) for an action the page does not offer; WebShop has none."""
    warm_start_hint: float = 1.0
    # The warm start follows the expert: a WebShop episode succeeds only if four or five actions in a row are
    # right, so the tiny model must copy them well before RL has any reward to follow. With hint 0.5 it was at
    # 20% of held-out states after 150 steps and RL never reached a purchase; with 1.0 it passes 70% after
    # about 300 steps, sampled episodes buy the asked product ~12% of the time (reward ~0.22), and RL raises that
    # (BENCHMARKS.md, "WebShop on the tiny model"). Its checks accept only the expert's action.
    model: ModelConfig = field(default_factory=lambda: walk_model(warm_start_accuracy=0.7))
    gen: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(max_new_tokens=40))

    warm_start_tasks = WARM_START_TASKS
    walks = staticmethod(shop_walks)
    warm_start_eval_every = 25
    warm_start_max_steps = 600

    def __post_init__(self):
        super().__post_init__()
        if self.results_per_page < 1 or self.num_products < 1:
            raise ValueError(f"results_per_page and num_products must be at least 1, got {self.results_per_page} "
                             f"and {self.num_products}")

    @property
    def env(self) -> EnvServiceAbstraction:
        return EnvServiceAbstraction("webshop", args=dict(
            num_products=self.num_products, catalog_seed=self.seed, results_per_page=self.results_per_page,
            max_steps=self.num_turns, invalid_action_penalty=self.invalid_action_penalty))

    def generate_dataset(self, data_dir: Path) -> tuple[Path, Path]:
        d = self.dataset
        directory = data_dir / (f"webshop-products{self.num_products}-page{self.results_per_page}-seed{self.seed}-"
                                f"{d.num_train}-{d.num_eval}")
        return generate_webshop_dataset(directory, make_env(self.env), self.seed, d.num_train, d.num_eval)


register_experiment("async-ppo-webshop", AsyncPPOWebShopConfig)
