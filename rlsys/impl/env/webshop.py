"""`webshop`: find and buy the product an instruction asks for, on text pages (ROLL's WebShop, after Yao et al. 2022).

The shop is a seeded, generated catalog: each product has a type (backpack, mug, ...), attributes (waterproof,
ceramic, ...), one option dimension (color or size) with the values it comes in, and a price. An instruction asks
for a type with some attributes and option values under a price; a goal is drawn from a catalog product and kept
only if the scripted expert (`expert_actions`) reaches reward 1 on it, so every task is solvable.

Pages and the actions valid on them, WebShop's:

- search page: `search[query]`; the results page lists the `results_per_page` products whose type, attributes
  and id share the most words with the query (ties by catalog order);
- results page: `click[<product id>]`, `click[back to search]`;
- item page: `click[<option value>]` (selects it), `click[buy now]` (ends the episode), `click[back to search]`.

`click[back to search]` is valid on every page but the search page without being printed on each (the tiny
default model reads characters and has 512 positions); the selected option value is shown in brackets.

Anything else is an invalid action: it costs `invalid_action_penalty`, the page stays, the episode goes on. The
reward comes at `buy now`, WebShop's:

    r = r_type * (|U_att & Y_att| + |U_opt & Y_opt| + 1[price <= budget]) / (|U_att| + |U_opt| + 1)

U the instruction's attributes and options, Y the bought product's attributes and selected options, r_type 1 if
the bought product is of the asked type, else 0 (WebShop grades type by title similarity; our types are exact).
Pages are terse because the tiny default model reads characters and has 512 positions.
"""

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from rlsys.api import EnvironmentService, register_environment

# type -> (attribute pool, option dimension, option values)
PRODUCT_TYPES = {
    "backpack": (("waterproof", "leather", "nylon", "canvas", "light"), "color", ("black", "red", "blue", "grey")),
    "mug": (("ceramic", "glass", "large", "insulated", "small"), "color", ("white", "black", "green", "blue")),
    "shirt": (("cotton", "slim", "linen", "organic", "long"), "size", ("s", "m", "l", "xl")),
    "lamp": (("led", "desk", "dimmable", "metal", "small"), "color", ("white", "black", "gold", "grey")),
    "shoes": (("running", "leather", "light", "waterproof", "wide"), "size", ("7", "8", "9", "10")),
    "headphones": (("wireless", "foldable", "bass", "light", "sport"), "color", ("black", "white", "red", "blue")),
}
SEARCH, RESULTS, ITEM = "search", "results", "item"
BACK, BUY = "back to search", "buy now"
ACTION = re.compile(r"^\s*(search|click)\[(.*)\]\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Product:
    id: str
    type: str
    attributes: tuple[str, ...]
    option_name: str
    option_values: tuple[str, ...]
    price: int

    @property
    def title(self) -> str:
        return " ".join(self.attributes + (self.type,))

    @property
    def words(self) -> set[str]:
        return {self.id, self.type, *self.attributes}


@dataclass(frozen=True)
class Goal:
    type: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]  # one value per option dimension of the type
    budget: int  # the most the buyer pays, in dollars

    @property
    def instruction(self) -> str:
        return f"buy {' '.join(self.attributes)} {self.type}, {' '.join(self.options)}, under ${self.budget}"


@lru_cache(maxsize=8)
def build_catalog(seed: int, num_products: int) -> tuple[Product, ...]:
    """`num_products` products, ids p00, p01, ...: each of a random type, 2 of its attributes, 2-3 option values."""
    rng = random.Random(seed)
    products = []
    width = len(str(num_products - 1))
    for i in range(num_products):
        kind = rng.choice(sorted(PRODUCT_TYPES))
        pool, option_name, values = PRODUCT_TYPES[kind]
        products.append(Product(f"p{i:0{width}d}", kind, tuple(sorted(rng.sample(pool, 2))), option_name,
                                tuple(sorted(rng.sample(values, rng.randint(2, 3)))), rng.randint(5, 80)))
    return tuple(products)


def search(catalog: tuple[Product, ...], query: str, k: int) -> list[Product]:
    """The k products sharing the most words with the query (at least one), ties in catalog order."""
    words = set(query.lower().split())
    scored = [(-len(words & p.words), i) for i, p in enumerate(catalog) if words & p.words]
    return [catalog[i] for _, i in sorted(scored)[:k]]


def reward(goal: Goal, product: Product, selected: tuple[str, ...]) -> float:
    """WebShop's reward for buying `product` with the option values `selected` (see the module docstring)."""
    if product.type != goal.type:
        return 0.0
    matched = len(set(goal.attributes) & set(product.attributes)) + len(set(goal.options) & set(selected))
    matched += product.price <= goal.budget
    return matched / (len(goal.attributes) + len(goal.options) + 1)


@dataclass
class ShopState:
    page: str = SEARCH
    results: list[Product] = field(default_factory=list)
    item: Product | None = None
    selected: str | None = None


class WebShopEnv(EnvironmentService):
    def __init__(self, num_products: int = 100, catalog_seed: int = 0, results_per_page: int = 3,
                 max_steps: int = 8, invalid_action_penalty: float = 0.0):
        if num_products < 1 or results_per_page < 1 or max_steps < 1:
            raise ValueError(f"num_products, results_per_page and max_steps must be at least 1, got "
                             f"{num_products}, {results_per_page} and {max_steps}")
        self.num_products, self.catalog_seed = num_products, catalog_seed
        self.results_per_page, self.max_steps, self.invalid_action_penalty = results_per_page, max_steps, \
            invalid_action_penalty
        self.goal: Goal | None = None
        self.state, self.steps, self.terminated = ShopState(), 0, False

    @property
    def catalog(self) -> tuple[Product, ...]:
        return build_catalog(self.catalog_seed, self.num_products)  # cached: forks share it instead of copying

    def __deepcopy__(self, memo):
        twin = WebShopEnv(self.num_products, self.catalog_seed, self.results_per_page, self.max_steps,
                          self.invalid_action_penalty)
        twin.goal, twin.steps, twin.terminated = self.goal, self.steps, self.terminated
        twin.state = ShopState(self.state.page, list(self.state.results), self.state.item, self.state.selected)
        return twin

    def new_goal(self, seed: int) -> Goal:
        """The task of `seed`: drawn from a catalog product, redrawn until the expert can earn reward 1."""
        rng = random.Random(seed)
        while True:
            product = rng.choice(self.catalog)
            goal = Goal(product.type, tuple(sorted(rng.sample(product.attributes, rng.randint(1, 2)))),
                        (rng.choice(product.option_values),), product.price + rng.randint(0, 20))
            if self.expert_actions(goal) is not None:
                return goal

    def expert_actions(self, goal: Goal) -> list[str] | None:
        """Search for the asked words, click the first listed product that fully matches, pick options, buy."""
        query = " ".join(goal.attributes + (goal.type,))
        for product in search(self.catalog, query, self.results_per_page):
            if set(goal.options) <= set(product.option_values) and reward(goal, product, goal.options) == 1.0:
                return [f"search[{query}]", f"click[{product.id}]", *(f"click[{o}]" for o in goal.options),
                        f"click[{BUY}]"]
        return None

    def expert_action(self) -> str:
        """The expert's next action from the current page (it goes back to search when it strayed)."""
        plan, s = self.expert_actions(self.goal), self.state
        target = plan[1][len("click["):-1]
        if s.page == SEARCH:
            return plan[0]
        if s.page == RESULTS:
            return plan[1] if any(p.id == target for p in s.results) else f"click[{BACK}]"
        if s.item.id != target:
            return f"click[{BACK}]"
        return f"click[{BUY}]" if s.selected == self.goal.options[0] else f"click[{self.goal.options[0]}]"

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = options or {}
        seed = options.get("seed") if seed is None else seed
        if seed is None:
            raise ValueError("WebShopEnv.reset needs a seed (argument or options['seed'])")
        observation, info = self.reset_sync(int(seed))
        # A row holds only its task's seed; the task is drawn from this env's catalog. Rows made with another catalog
        # (seed, num_products) would be scored against a goal their prompt does not show, the run learning nothing.
        prompt = options.get("prompt")
        if isinstance(prompt, str) and self.goal.instruction not in prompt:
            raise ValueError(f"the row of seed {seed} asks for something else than its task in this shop "
                             f"({self.goal.instruction!r}): rows made with another catalog (its seed, num_products)?")
        return observation, info

    def reset_sync(self, seed: int) -> tuple[str, dict]:
        """`reset` for callers outside an event loop (dataset generation, warm-start walks)."""
        self.goal, self.state, self.steps, self.terminated = self.new_goal(seed), ShopState(), 0, False
        return self.render(), {}

    def first_observation(self, seed: int) -> str:
        """The dataset prompt of a seed: the instruction and the search page (what `reset` rebuilds)."""
        return self.reset_sync(seed)[0]

    def render(self) -> str:
        s = self.state
        if s.page == SEARCH:
            return f"{self.goal.instruction}\n[search]"
        if s.page == RESULTS:
            return "\n".join(f"[{p.id}] {p.title} ${p.price}" for p in s.results) or "no results"
        p = s.item
        values = " ".join(f"[{v}]" if v == s.selected else v for v in p.option_values)
        return f"{p.id} {p.title} ${p.price}\n{p.option_name}: {values}\n[{BUY}]"

    def valid_actions(self) -> list[str]:
        """The clicks of the current page (any search[query] is valid on the search page: not listed)."""
        s = self.state
        if s.page == RESULTS:
            return [f"click[{p.id}]" for p in s.results] + [f"click[{BACK}]"]
        if s.page == ITEM:
            return [f"click[{v}]" for v in s.item.option_values] + [f"click[{BUY}]", f"click[{BACK}]"]
        return []

    def apply(self, action: str) -> tuple[bool, float | None]:
        """(valid, reward if the episode ended by buying)."""
        match, s = ACTION.match(action), self.state
        if match is None:
            return False, None
        verb, argument = match.group(1).lower(), match.group(2).strip().lower()
        if verb == "search":
            if s.page != SEARCH or not argument:
                return False, None
            s.page, s.results = RESULTS, search(self.catalog, argument, self.results_per_page)
            return True, None
        if s.page != SEARCH and argument == BACK:
            self.state = ShopState()
            return True, None
        if s.page == RESULTS:
            product = next((p for p in s.results if p.id == argument), None)
            if product is None:
                return False, None
            s.page, s.item, s.selected = ITEM, product, None
            return True, None
        if s.page == ITEM:
            if argument == BUY:
                return True, reward(self.goal, s.item, (s.selected,) if s.selected else ())
            if argument in s.item.option_values:
                s.selected = argument
                return True, None
        return False, None

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.goal is None:
            raise RuntimeError("step() before reset()")
        if self.terminated or self.steps >= self.max_steps:  # a second buy would be paid again
            raise RuntimeError(f"step() after the episode ended ({'bought' if self.terminated else 'truncated'} "
                               f"at step {self.steps})")
        self.steps += 1
        valid, bought = self.apply(action)
        terminated = self.terminated = bought is not None
        score = bought if terminated else (0.0 if valid else 0.0 - self.invalid_action_penalty)
        info = {"action_is_valid": valid, "action_is_effective": valid, "success": bought == 1.0,
                "bought": float(terminated)}
        truncated = not terminated and self.steps >= self.max_steps
        return self.render(), score, terminated, truncated, info


register_environment("webshop", WebShopEnv)
