"""WebShop tasks (one instruction per row, by seed) and warm-start walks through the shop, all seeded."""

import random
from pathlib import Path

from rlsys.data.dataset import DatasetError, write_jsonl
from rlsys.data.games import Walk
from rlsys.impl.env.webshop import BUY, RESULTS, SEARCH, WebShopEnv
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence

MAX_DRAWS_PER_ROW = 50
MAX_WALK_TOKENS = 360  # a walk stops here, as an episode stops before outgrowing the tiny model's 512 positions


def generate_webshop_dataset(directory: Path, env: WebShopEnv, seed: int, num_train: int,
                             num_eval: int) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of distinct instructions (none in both); rows {"prompt", "answer", "seed"}.

    "prompt" is the first page, "answer" the expert's actions (for reference; rewards come from the env).
    """
    train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
    if train.exists() and held_out.exists():
        return train, held_out
    rng, rows, seen = random.Random(seed), [], set()
    for _ in range(MAX_DRAWS_PER_ROW * (num_train + num_eval)):
        if len(rows) == num_train + num_eval:
            break
        task_seed = rng.randrange(2**31)
        page = env.first_observation(task_seed)
        if page in seen:
            continue
        seen.add(page)
        rows.append({"prompt": page, "answer": " ".join(env.expert_actions(env.goal)), "seed": task_seed})
    if len(rows) < num_train + num_eval:
        raise DatasetError(f"only {len(rows)} distinct instructions from a catalog of {env.num_products} products; "
                           f"asked for {num_train} train + {num_eval} eval: lower dataset.num_train and "
                           "dataset.num_eval, or raise num_products")
    write_jsonl(rows[:num_eval], held_out)
    write_jsonl(rows[num_eval:], train)
    return train, held_out


def random_action(rng: random.Random, env: WebShopEnv) -> str:
    """A valid action that moves on: a partial search, a listed product, an option (none chosen yet) or buy.
    Never back to search, so walks stay short: the tiny model's context is 512 positions."""
    state = env.state
    if state.page == SEARCH:
        words = [*env.goal.attributes, env.goal.type]
        return f"search[{' '.join(rng.sample(words, rng.randint(1, len(words))))}]"
    if state.page == RESULTS:
        return rng.choice(env.valid_actions()[:-1])
    return f"click[{BUY}]" if state.selected else f"click[{rng.choice(state.item.option_values)}]"


def shop_walks(tokenizer, env: WebShopEnv, rows: list[dict], num_turns: int, seed: int,
               hint: float) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
    """A walk through the shop per row: each action is the expert's with probability `hint`, otherwise a random
    one that moves on (`random_action`). The walks teach the action format and the pages, and
    leave buying the right thing to RL. Each state is also a check that accepts the expert's action there."""
    rng = random.Random(seed)
    walks, checks = [], []
    for row in rows:
        page, _ = env.reset_sync(row["seed"])
        walk = Walk(tokenizer, row)
        for turn in range(1, min(num_turns, env.max_steps) + 1):
            expert = env.expert_action()
            checks.append(walk.check((expert,)))
            if rng.random() < hint:
                action = expert
            else:
                action = random_action(rng, env)
            walk.respond(action)
            _, bought = env.apply(action)
            if bought is not None or turn == min(num_turns, env.max_steps) or \
                    len(walk.sequence.token_ids) > MAX_WALK_TOKENS:
                break  # as the agent does: no page after the last action
            walk.observe(env.render())
        walks.append(walk.sequence)
    rng.shuffle(checks)
    return walks, checks
