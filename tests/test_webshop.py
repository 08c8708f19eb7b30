"""The shopping environment's contract: a seeded catalog, solvable instructions, WebShop's actions on text pages
and WebShop's reward; a scripted policy plays it through the text-game agent, the real queues and worker."""

import asyncio
import copy

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from rlsys.api import AgentAbstraction, GenerationConfig, Prompt, make_agent
from rlsys.impl.env.webshop import Goal, Product, WebShopEnv, build_catalog, reward, search
from rlsys.model.tokenizer import chat_prompt_ids
from tests.scripted import ids, run_scripted_episode
from tests.scripted_engine import ScriptedEngine


def play_env(env, actions):
    return [asyncio.run(env.step(a)) for a in actions]


def test_catalog_and_tasks_are_seeded_and_every_task_is_solvable():
    assert build_catalog(3, 50) == build_catalog(3, 50) and build_catalog(3, 50) != build_catalog(4, 50)
    a, b = WebShopEnv(catalog_seed=3), WebShopEnv(catalog_seed=3)
    for seed in range(40):
        assert a.first_observation(seed) == b.first_observation(seed)
        assert a.goal.instruction in a.first_observation(seed)
        *_, (page, r, terminated, truncated, info) = play_env(a, a.expert_actions(a.goal))
        assert r == 1.0 and terminated and not truncated and info["success"]


def test_webshop_reward_counts_type_attributes_options_and_price():
    goal = Goal("mug", ("ceramic", "large"), ("white",), budget=20)
    mug = Product("p1", "mug", ("ceramic", "large"), "color", ("white", "black"), 15)
    assert reward(goal, mug, ("white",)) == 1.0
    assert reward(goal, mug, ("black",)) == 3 / 4  # wrong option
    assert reward(goal, mug, ()) == 3 / 4  # no option chosen
    assert reward(goal, Product("p2", "mug", ("glass", "large"), "color", ("white",), 25), ("white",)) == 2 / 4
    assert reward(goal, Product("p3", "lamp", ("ceramic", "large"), "color", ("white",), 5), ("white",)) == 0.0


def test_search_ranks_by_shared_words_then_catalog_order():
    catalog = (Product("p0", "mug", ("glass", "small"), "color", ("white",), 5),
               Product("p1", "mug", ("ceramic", "large"), "color", ("white",), 5),
               Product("p2", "lamp", ("led", "small"), "color", ("white",), 5))
    assert [p.id for p in search(catalog, "large ceramic mug", 3)] == ["p1", "p0"]  # p2 shares nothing
    assert [p.id for p in search(catalog, "small", 1)] == ["p0"]
    assert [p.id for p in search(catalog, "p2", 3)] == ["p2"]


def test_pages_and_actions_and_invalid_ones_leave_the_page():
    env = WebShopEnv(catalog_seed=0, max_steps=20, invalid_action_penalty=0.1)
    first = env.first_observation(7)
    query, click, option, buy = env.expert_actions(env.goal)
    assert first.endswith("\n[search]")
    steps = play_env(env, ["click[buy now]", "hello", query])
    assert [s[1] for s in steps] == [-0.1, -0.1, 0.0] and [s[4]["action_is_valid"] for s in steps] == [0, 0, 1]
    assert steps[0][0] == first  # an invalid action leaves the page as it was
    results = steps[2][0]
    assert results.startswith("[p") and f"[{click[len('click['):-1]}]" in results
    assert len(results.splitlines()) == env.results_per_page
    page, r, *_ = asyncio.run(env.step(query))
    assert page == results and r == -0.1  # no search box on the results page
    item, *_ = asyncio.run(env.step(click))
    assert "[buy now]" in item and f"[{option[len('click['):-1]}]" not in item
    picked, *_ = asyncio.run(env.step(option))
    assert f"[{option[len('click['):-1]}]" in picked  # the selected value is marked
    twin = copy.deepcopy(env)  # a fork plays on its own
    back, *_ = asyncio.run(twin.step("click[back to search]"))
    assert back == first
    assert asyncio.run(env.step(buy))[1:4] == (1.0, True, False)


def test_max_steps_truncates_and_stepping_after_the_end_is_an_error():
    env = WebShopEnv(max_steps=2)
    env.first_observation(1)
    steps = play_env(env, ["search[mug]", "click[nothing]"])
    assert steps[-1][2:4] == (False, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        asyncio.run(env.step("click[back to search]"))


def test_stepping_after_buying_is_an_error_until_the_next_reset():
    """A purchase ends the episode: a second `buy now` was paid its reward again."""
    env = WebShopEnv()
    env.first_observation(1)
    assert play_env(env, env.expert_actions(env.goal))[-1][1:4] == (1.0, True, False)
    for shop in (env, copy.deepcopy(env)):
        with pytest.raises(RuntimeError, match="after the episode ended"):
            asyncio.run(shop.step("click[buy now]"))
    env.first_observation(1)
    assert asyncio.run(env.step(env.expert_actions(env.goal)[0]))[2:4] == (False, False)


def test_a_row_whose_prompt_is_not_its_seed_s_task_in_this_catalog_is_refused_at_reset():
    """Rows hold a seed; a row made with another catalog asked for one thing and was scored against another."""
    made_with = WebShopEnv(catalog_seed=0, num_products=40)
    row = {"prompt": made_with.first_observation(7), "seed": 7}
    assert asyncio.run(WebShopEnv(catalog_seed=0, num_products=40).reset(options=row))[0] == row["prompt"]
    with pytest.raises(ValueError, match="the row of seed 7 asks for something else than its task in this shop"):
        asyncio.run(WebShopEnv(catalog_seed=1, num_products=40).reset(options=row))


def test_a_scripted_shopper_plays_through_the_text_game_agent(tokenizer, tokenizer_dir):
    """Two chains: the expert's actions (reward 1), and a shopper who searches the type alone and buys the first
    result without choosing an option (less)."""
    env = WebShopEnv(catalog_seed=0)
    text = env.first_observation(11)
    expert = env.expert_actions(env.goal)
    hasty_search = f"search[{env.goal.type}]"
    first_result = search(env.catalog, env.goal.type, env.results_per_page)[0]
    scripts = [expert, [hasty_search, f"click[{first_result.id}]", "click[buy now]"]]
    eos = tokenizer.eos_token_id
    prompt = Prompt("shop11", chat_prompt_ids(tokenizer, text), {"prompt": text, "answer": " ".join(expert),
                                                                  "seed": 11})

    def policy(prompt_ids, gconfig, sample):  # chain i says scripts[i][k] at turn k; known by its first action
        history = tokenizer.decode(prompt_ids).split("<|assistant|>")[1:]
        if len(history) == 1:
            return ids(tokenizer, scripts[sample][0]) + [eos]
        chain = next(s for s in scripts if s[0] == history[0].split("<|end|>")[0])
        return ids(tokenizer, chain[len(history) - 1]) + [eos]

    agent = make_agent(AgentAbstraction("text-game", {
        "gconfig": GenerationConfig(n=2, max_new_tokens=40, stop_token_ids=[eos]),
        "tokenizer_path": str(tokenizer_dir), "num_turns": 8, "max_context_tokens": 512}))
    engine = ScriptedEngine(policy, logprob=-0.5)
    expert_run, hasty = asyncio.run(run_scripted_episode(agent, env, prompt, policy, engine))
    assert expert_run.reward == 1.0 and expert_run.metrics["success"] == 1.0
    assert expert_run.turn_rewards == [0.0, 0.0, 0.0, 1.0] and expert_run.metrics["action_is_valid"] == 1.0
    generated = tokenizer.decode([t for t, m in zip(expert_run.token_ids, expert_run.loss_mask) if m])
    assert generated == "<|end|>".join(expert) + "<|end|>"  # exactly the actions, each ended by eos
    assert hasty.metrics["turns"] == 3 and hasty.metrics["success"] == 0.0
    assert hasty.reward == reward(env.goal, first_result, ()) < 1.0
    assert not expert_run.void and not hasty.void
