"""Contract tests of the multi-turn agents and rollout strategies: real episode router, bus and inference
worker, scripted model. Each checks the trajectories token by token: ids, loss masks, logprobs, versions,
turn ends and rewards, group ids, state keys, void flags and the counted metrics."""

import asyncio

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from rlsys.api import NOT_GENERATED, AgentAbstraction, EnvServiceAbstraction, GenerationConfig, GenerationOutput, \
    Prompt, make_agent, make_env
from rlsys.impl.agent.math_multi_turn import CORRECT_FEEDBACK, WRONG_FEEDBACK
from rlsys.impl.agent.model_client import ModelClient
from rlsys.impl.agent.multi_turn import MultiTurnAgent, Reaction, RolloutStrategy, token_key
from rlsys.impl.env.frozen_lake import FrozenLakeEnv, generate_lake, shortest_path
from rlsys.impl.env.sokoban import SokobanEnv, generate_room, solve
from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids, row_prompt_ids
from tests.scripted import ids, run_scripted_episode
from tests.scripted_engine import ScriptedEngine

LOGPROB = -0.25




def user_turn(tokenizer, text: str) -> list[int]:
    """The seed's feedback: the message rendered by the chat template on its own, then tokenized."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return ids(tokenizer, rendered)


def answer_by_history(tokenizer, scripts: list[list[str]]):
    """Chain i answers scripts[i][k] at turn k; a chain is recognised by its first answer in the context."""
    eos = tokenizer.eos_token_id

    def policy(prompt_ids, gconfig, sample):
        history = tokenizer.decode(prompt_ids).split("<|assistant|>")[1:]
        if len(history) == 1:  # the first turn: the group's samples
            return ids(tokenizer, scripts[sample][0]) + [eos]
        first_answer = history[0].split("<|end|>")[0]
        chain = next(s for s in scripts if s[0] == first_answer)
        return ids(tokenizer, chain[len(history) - 1]) + [eos]
    return policy


def play(agent, env, prompt: Prompt, policy):
    """One episode through the real queues; returns its trajectories and the requests the model saw."""
    engine = ScriptedEngine(policy, logprob=LOGPROB)
    return asyncio.run(run_scripted_episode(agent, env, prompt, policy, engine)), engine.requests


def math_env():
    return make_env(EnvServiceAbstraction("math-code-single-step"))


def turn_answers(tokenizer, trajectory) -> list[str]:
    """The text the model generated in each turn (the loss-mask-1 tokens up to each turn end)."""
    starts = [0] + trajectory.turn_ends[:-1]
    return [tokenizer.decode([tok for tok, m in zip(trajectory.token_ids[s:e], trajectory.loss_mask[s:e]) if m],
                             skip_special_tokens=True) for s, e in zip(starts, trajectory.turn_ends)]


def math_agent(tokenizer_dir, n: int, seed: int | None = None, **kwargs):
    gconfig = GenerationConfig(n=n, max_new_tokens=8, stop_token_ids=[build_char_tokenizer().eos_token_id], seed=seed)
    return make_agent(AgentAbstraction("math-multi-turn", {"gconfig": gconfig, "tokenizer_path": str(tokenizer_dir),
                                                           **kwargs})), gconfig


def math_prompt(tokenizer) -> Prompt:
    return Prompt("q7", chat_prompt_ids(tokenizer, "12+34="), {"prompt": "12+34=", "answer": "46"})


def game_prompt(tokenizer, env, name: str, seed: int, answer: str = "") -> Prompt:
    """The dataset row of puzzle `seed` (id name + seed), as the rollout worker hands it to the agent."""
    text = env.first_observation(seed)
    return Prompt(f"{name}{seed}", chat_prompt_ids(tokenizer, text), {"prompt": text, "answer": answer, "seed": seed})


def test_math_multi_turn_chains_retry_after_wrong_answers(tokenizer, tokenizer_dir):
    scripts = [["46"], ["45", "46"], ["1", "2", "3"]]
    agent, gconfig = math_agent(tokenizer_dir, n=3, seed=5, num_turns=3, turn_discount=0.5)
    prompt = math_prompt(tokenizer)
    trajectories, requests = play(agent, math_env(), prompt, answer_by_history(tokenizer, scripts))

    eos, n = tokenizer.eos_token_id, len(prompt.token_ids)
    right, wrong = user_turn(tokenizer, CORRECT_FEEDBACK), user_turn(tokenizer, WRONG_FEEDBACK)
    # The group: one request of n=3 for the prompt, then each chain alone: n=1 per later turn.
    assert [(len(p), g.n) for p, g in requests][0] == (n, 3)
    assert sorted(g.n for _, g in requests[1:]) == [1, 1, 1]
    assert len({g.seed for _, g in requests}) == 4  # one fixed seed, yet each request draws its own stream
    assert len(trajectories) == 3 and {t.group_id for t in trajectories} == {"q7"}
    by_first = {turn_answers(tokenizer, t)[0]: t for t in trajectories}

    first = by_first["46"]
    a46 = ids(tokenizer, "46") + [eos]
    assert first.token_ids == prompt.token_ids + a46 + right
    assert first.loss_mask == [0] * n + [1] * 3 + [0] * len(right)
    assert first.logprobs == [0.0] * n + [LOGPROB] * 3 + [0.0] * len(right)
    assert first.versions == [NOT_GENERATED] * n + [0] * 3 + [NOT_GENERATED] * len(right)
    assert first.turn_ends == [n + 3] and first.turn_rewards == [1.0] and first.reward == 1.0

    second = by_first["45"]
    a45 = ids(tokenizer, "45") + [eos]
    assert second.token_ids == prompt.token_ids + a45 + wrong + a46 + right
    assert second.loss_mask == [0] * n + [1] * 3 + [0] * len(wrong) + [1] * 3 + [0] * len(right)
    assert second.turn_ends == [n + 3, n + 6 + len(wrong)]
    assert second.turn_rewards == [0.0, 1.0] and second.reward == 0.5  # a success at turn 2 earns 0.5**1

    third = by_first["1"]
    assert third.turn_rewards == [0.0, 0.0, 0.0] and third.reward == 0.0
    assert third.token_ids[-2:] == [ids(tokenizer, "3")[0], eos]  # no feedback after the last allowed turn
    assert [t.metrics["turns"] for t in (first, second, third)] == [1, 2, 3]
    assert [t.metrics["success"] for t in (first, second, third)] == [1, 1, 0]
    assert [t.metrics["first_turn_success"] for t in (first, second, third)] == [1, 0, 0]
    assert [t.metrics["truncated"] for t in (first, second, third)] == [0, 0, 1]
    assert not any(t.void for t in trajectories)
    # Every chain's first turn saw the same context: one anchor state; later contexts differ by the answers.
    assert len({t.turn_obs_keys[0] for t in trajectories}) == 1
    assert second.turn_obs_keys[1] == token_key(second.token_ids[:second.turn_ends[0]] + wrong)


class UsersRetryAgent(MultiTurnAgent):
    """A user's multi-turn agent as docs/agents.md has one written: __init__ passes only what it changes."""

    def __init__(self, gconfig, tokenizer_path, num_turns: int = 2):
        super().__init__(gconfig, tokenizer_path, num_turns)

    async def start(self, env, prompt):
        await env.reset(options=prompt.data)

    async def react(self, env, prompt, response, stop_reason):
        _, success, *_ = await env.step((prompt.qid, [response]))
        right = success[0] == 1.0
        return Reaction(reward=float(right), done=right, feedback=CORRECT_FEEDBACK if right else WRONG_FEEDBACK,
                        success=right)


def test_a_users_multi_turn_agent_passes_only_its_turns_and_gets_chains_undiscounted(tokenizer, tokenizer_dir):
    gconfig = GenerationConfig(n=1, max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id])
    agent = UsersRetryAgent(gconfig, str(tokenizer_dir))
    trajectories, _ = play(agent, math_env(), math_prompt(tokenizer), answer_by_history(tokenizer, [["45", "46"]]))
    assert agent.strategy == RolloutStrategy() and agent.max_context_tokens > 0
    [trajectory] = trajectories
    assert turn_answers(tokenizer, trajectory) == ["45", "46"]
    assert trajectory.turn_rewards == [0.0, 1.0] and trajectory.reward == 1.0  # no discount unless asked


class EarlierNamesAgent(UsersRetryAgent):
    """A user's agent written before the turn limit took the seed's name, num_turns."""

    def __init__(self, gconfig, tokenizer_path):
        MultiTurnAgent.__init__(self, gconfig, tokenizer_path, max_turns=2)


def test_the_turn_limit_is_num_turns_and_the_earlier_max_turns_is_refused_naming_it(tokenizer_dir):
    """One name for the limit, the seed's and experiment=async-ppo-math-multi-turn's: max_turns is refused, not
    read, so that the agents of one name-space (MultiTurnAgent and its subclasses) never spell it two ways."""
    gconfig = GenerationConfig(n=1, max_new_tokens=8)
    assert frozen_lake_agent(tokenizer_dir, n=1, num_turns=5).num_turns == 5
    assert UsersRetryAgent(gconfig, str(tokenizer_dir)).num_turns == 2
    with pytest.raises(TypeError, match=r"EarlierNamesAgent: max_turns is now num_turns .*num_turns=2"):
        EarlierNamesAgent(gconfig, str(tokenizer_dir))
    with pytest.raises(TypeError, match=r"TextGameAgent: max_turns is now num_turns .*num_turns=4"):
        frozen_lake_agent(tokenizer_dir, n=1, max_turns=4)


def test_math_multi_turn_marks_cut_off_and_empty_answers_void(tokenizer, tokenizer_dir):
    eos = tokenizer.eos_token_id
    agent, _ = math_agent(tokenizer_dir, n=2, num_turns=2)

    def policy(prompt_ids, gconfig, sample):
        if tokenizer.decode(prompt_ids).count("<|assistant|>") == 2:
            return ids(tokenizer, "46") + [eos]
        return ids(tokenizer, "123456789") if sample == 0 else [eos]  # cut off at 8 tokens; empty

    prompt = math_prompt(tokenizer)
    trajectories, _ = play(agent, math_env(), prompt, policy)
    cut, empty = trajectories
    assert cut.stop_reason == "stop" and cut.void and empty.void
    assert [t.metrics["void_turns"] for t in trajectories] == [1, 1]
    n = len(prompt.token_ids)
    # The cut-off answer is closed with an eos the model did not produce before the feedback follows.
    assert cut.token_ids[n:n + 9] == ids(tokenizer, "12345678") + [eos]
    assert cut.loss_mask[n:n + 9] == [1] * 8 + [0] and cut.versions[n + 8] == NOT_GENERATED
    assert [t.turn_rewards for t in trajectories] == [[0.0, 1.0], [0.0, 1.0]]


def test_tree_rollout_branches_at_the_first_turns_after_the_first(tokenizer, tokenizer_dir):
    eos = tokenizer.eos_token_id

    def policy(prompt_ids, gconfig, sample):
        turn = tokenizer.decode(prompt_ids).count("<|assistant|>")
        answer = {1: ["10", "20"][sample], 2: ["46", "30"][sample], 3: "40"}[turn]
        return ids(tokenizer, answer) + [eos]

    agent, _ = math_agent(tokenizer_dir, n=2, num_turns=3,
                          strategy=RolloutStrategy(mode="tree", tree_branching=2, tree_depth=1))
    prompt = math_prompt(tokenizer)
    trajectories, requests = play(agent, math_env(), prompt, policy)

    # n=2 roots, each branching into 2 at turn 2; turn 3 goes on as chains (depth 1): 4 leaves, 2*2**1.
    assert sorted(g.n for _, g in requests) == [1, 1, 2, 2, 2]
    paths = sorted(turn_answers(tokenizer, t) for t in trajectories)
    assert paths == [["10", "30", "40"], ["10", "46"], ["20", "30", "40"], ["20", "46"]]
    assert {t.group_id for t in trajectories} == {"q7"}
    # Siblings share their parent's tokens and the state they branched from.
    siblings = [t for t in trajectories if turn_answers(tokenizer, t)[0] == "10"]
    assert len(siblings) == 2
    assert siblings[0].token_ids[:siblings[0].turn_ends[0]] == siblings[1].token_ids[:siblings[1].turn_ends[0]]
    assert siblings[0].turn_obs_keys[:2] == siblings[1].turn_obs_keys[:2]
    assert sorted(t.reward for t in trajectories) == [0.0, 0.0, 0.5, 0.5]


def test_greedy_rollouts_never_branch_nor_split(tokenizer, tokenizer_dir):
    eos = tokenizer.eos_token_id
    agent, _ = math_agent(tokenizer_dir, n=1, num_turns=3,
                          strategy=RolloutStrategy(mode="tree", tree_branching=3, single_turn_samples=True))
    agent.gconfig.temperature = 0.0
    trajectories, _ = play(agent, math_env(), math_prompt(tokenizer), lambda p, g, i: ids(tokenizer, "45") + [eos])
    assert len(trajectories) == 1 and trajectories[0].metrics["turns"] == 3


def test_single_turn_samples_train_each_turn_with_its_history_as_prompt(tokenizer, tokenizer_dir):
    agent, _ = math_agent(tokenizer_dir, n=1, num_turns=3, turn_discount=0.5,
                          strategy={"single_turn_samples": True})
    prompt = math_prompt(tokenizer)
    samples, _ = play(agent, math_env(), prompt, answer_by_history(tokenizer, [["1", "2", "46"]]))

    eos, n = tokenizer.eos_token_id, len(prompt.token_ids)
    wrong = user_turn(tokenizer, WRONG_FEEDBACK)
    a = {x: ids(tokenizer, x) + [eos] for x in ("1", "2", "46")}
    full = prompt.token_ids + a["1"] + wrong + a["2"] + wrong + a["46"]
    assert len(samples) == 3
    for k, (sample, answer) in enumerate(zip(samples, ("1", "2", "46"))):
        end = sample.turn_ends[0]
        assert sample.token_ids == full[:end]  # the history is this sample's prompt
        start = end - len(a[answer])
        assert sample.loss_mask == [0] * start + [1] * len(a[answer])
        assert sample.versions == [NOT_GENERATED] * start + [0] * len(a[answer])
        assert sample.logprobs == [0.0] * start + [LOGPROB] * len(a[answer])
        assert sample.group_id == "q7" and len(sample.turn_obs_keys) == 1
    # Each sample's reward is its discounted return: the success at turn 3 seen from turns 1, 2, 3.
    assert [s.reward for s in samples] == [0.25, 0.5, 1.0]
    assert [s.turn_rewards for s in samples] == [[0.25], [0.5], [1.0]]


def test_single_turn_samples_count_each_episode_once_in_the_learner_s_agent_metrics(tokenizer, tokenizer_dir):
    """A chain right at once and one wrong three times: half the episodes succeeded, in 2 turns on average, as whole
    episodes log it. With the episode's metrics on every sample the learner logged 1/4 and 2.5 turns."""
    from rlsys.training_step import mean_agent_metrics

    policy = answer_by_history(tokenizer, [["46"], ["1", "2", "3"]])
    agent, _ = math_agent(tokenizer_dir, n=2, num_turns=3, strategy={"single_turn_samples": True})
    samples, _ = play(agent, math_env(), math_prompt(tokenizer), policy)
    assert len(samples) == 4
    logged = mean_agent_metrics(samples)
    assert logged["agent/success"] == 0.5 and logged["agent/turns"] == 2.0
    assert logged["agent/truncated"] == 0.5 and logged["agent/prefix_breaks"] == 0.0
    whole, _ = math_agent(tokenizer_dir, n=2, num_turns=3)
    episodes, _ = play(whole, math_env(), math_prompt(tokenizer), policy)
    assert mean_agent_metrics(episodes) == logged


def test_model_client_matches_replies_to_requests_by_qid():
    async def scenario():
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        async with ModelClient(obs_queue, act_queue) as model:
            first = asyncio.create_task(model.generate("q/1", [1], GenerationConfig()))
            second = asyncio.create_task(model.generate("q/2", [2], GenerationConfig()))
            requests = [await obs_queue.get(), await obs_queue.get()]
            assert [(qid, tokens) for qid, tokens, _ in requests] == [("q/1", [1]), ("q/2", [2])]
            for qid, tokens, _ in reversed(requests):  # replies arrive out of order
                act_queue.put_nowait(GenerationOutput(qid, tokens, [[tokens[0] * 10]], [[0.0]], [[0]], ["stop"]))
            return await first, await second
    first, second = asyncio.run(scenario())
    assert first.output_ids == [[10]] and second.output_ids == [[20]]


def frozen_lake_agent(tokenizer_dir, n: int, **kwargs):
    gconfig = GenerationConfig(n=n, max_new_tokens=4, stop_token_ids=[build_char_tokenizer().eos_token_id])
    return make_agent(AgentAbstraction("text-game", {"gconfig": gconfig, "tokenizer_path": str(tokenizer_dir),
                                                     **kwargs}))


def test_text_game_agent_plays_frozen_lake_turn_by_turn(tokenizer, tokenizer_dir):
    seed = 3
    env = FrozenLakeEnv(max_steps=12, invalid_action_penalty=0.1)
    path = shortest_path(generate_lake(4, 0.8, seed))
    prompt = game_prompt(tokenizer, env, "lake", seed, answer=path)
    eos = tokenizer.eos_token_id

    def policy(prompt_ids, gconfig, sample):
        turn = tokenizer.decode(prompt_ids).count("<|assistant|>")
        if sample == 1 and turn == 1:
            return ids(tokenizer, "jump") + [eos]  # not a move: penalised, and nothing happens
        moves_made = turn - 1 - (1 if "jump" in tokenizer.decode(prompt_ids) else 0)
        return ids(tokenizer, path[moves_made]) + [eos]

    agent = frozen_lake_agent(tokenizer_dir, n=2, num_turns=12)
    trajectories, _ = play(agent, env, prompt, policy)
    clean, invalid = trajectories

    assert clean.turn_rewards == [0.0] * (len(path) - 1) + [1.0] and clean.reward == 1.0
    assert invalid.turn_rewards == [-0.1] + [0.0] * (len(path) - 1) + [1.0]
    assert invalid.reward == pytest.approx(0.9)
    assert clean.metrics["action_is_valid"] == 1.0 and invalid.metrics["action_is_valid"] == pytest.approx(
        len(path) / (len(path) + 1))
    assert invalid.void and not clean.void and invalid.metrics["void_turns"] == 1
    assert clean.metrics["success"] == invalid.metrics["success"] == 1.0

    # Tokens: prompt, then per turn the move (trained) and the new board as a user message (not trained).
    replay = FrozenLakeEnv(max_steps=12)
    board, _ = asyncio.run(replay.reset(seed=seed))
    expected, mask, keys = list(prompt.token_ids), [0] * len(prompt.token_ids), []
    for k, move in enumerate(path):
        keys.append(board)
        board, *_ = asyncio.run(replay.step(move))
        expected += ids(tokenizer, move) + [eos]
        mask += [1, 1]
        if k < len(path) - 1:  # the game ended: no observation after the last move
            expected += user_turn(tokenizer, board)
            mask += [0] * len(user_turn(tokenizer, board))
    assert clean.token_ids == expected and clean.loss_mask == mask
    assert clean.turn_obs_keys == keys and keys[0] == prompt.data["prompt"][len(env.instruction):]
    assert invalid.turn_obs_keys[:2] == [keys[0], keys[0]]  # the invalid move left the board as it was
    assert all(v == NOT_GENERATED for v, m in zip(clean.versions, clean.loss_mask) if not m)


def test_text_game_episode_ends_at_num_turns_or_in_a_hole(tokenizer, tokenizer_dir):
    seed = 15
    assert generate_lake(4, 0.8, seed)[1][0] == "O"  # moving down from the start falls through
    env = FrozenLakeEnv()
    prompt = game_prompt(tokenizer, env, "lake", seed)
    eos = tokenizer.eos_token_id
    agent = frozen_lake_agent(tokenizer_dir, n=2, num_turns=3)
    trajectories, _ = play(agent, env, prompt, lambda p, g, i: ids(tokenizer, "UD"[i]) + [eos])
    bumping, falling = trajectories
    assert bumping.metrics["turns"] == 3 and bumping.metrics["truncated"] == 1.0
    assert bumping.metrics["action_is_effective"] == 0.0 and bumping.turn_rewards == [0.0] * 3
    assert falling.metrics["turns"] == 1 and falling.metrics["truncated"] == 0.0
    assert falling.turn_rewards == [0.0] and falling.metrics["success"] == 0.0
    assert falling.token_ids == prompt.token_ids + ids(tokenizer, "D") + [eos]  # nothing after the fall


def test_an_episode_the_env_cuts_at_its_step_limit_counts_as_truncated(tokenizer, tokenizer_dir):
    """The experiments give the env's step limit and the agent's turn limit one value (num_turns): the env ends the
    episode at the last turn, and that episode was cut short all the same (it counted 0)."""
    seed = 15
    env = FrozenLakeEnv(max_steps=3)
    prompt = game_prompt(tokenizer, env, "lake", seed)
    eos = tokenizer.eos_token_id
    agent = frozen_lake_agent(tokenizer_dir, n=2, num_turns=3)
    bumping, falling = play(agent, env, prompt, lambda p, g, i: ids(tokenizer, "UD"[i]) + [eos])[0]
    assert bumping.metrics["turns"] == 3 and bumping.metrics["truncated"] == 1.0
    assert falling.metrics["turns"] == 1 and falling.metrics["truncated"] == 0.0


def test_tree_rollout_forks_the_game_so_branches_play_on_their_own_boards(tokenizer, tokenizer_dir):
    seed = 3
    env = SokobanEnv()
    assert solve(generate_room(6, 1, seed)) == "LLDR"
    prompt = game_prompt(tokenizer, env, "room", seed, answer="LLDR")
    eos = tokenizer.eos_token_id

    def policy(prompt_ids, gconfig, sample):
        made = moves_made(tokenizer, prompt_ids)
        if len(made) == 1 and sample == 1:
            return ids(tokenizer, "U") + [eos]  # into the wall: the branch keeps its board
        rest = "LLDR"[len([m for m in made if m != "U"]):]
        return ids(tokenizer, rest[0]) + [eos]

    agent = make_agent(AgentAbstraction("text-game", {
        "gconfig": GenerationConfig(n=1, max_new_tokens=4, stop_token_ids=[eos]),
        "tokenizer_path": str(tokenizer_dir), "num_turns": 10, "max_context_tokens": 512,
        "strategy": RolloutStrategy(mode="tree", tree_branching=2, tree_depth=1)}))
    trajectories, requests = play(agent, env, prompt, policy)

    assert sorted(g.n for _, g in requests) == [1] * 6 + [2]  # the branch at turn 2, then two chains
    paths = sorted(turn_answers(tokenizer, t) for t in trajectories)
    assert paths == [["L", "L", "D", "R"], ["L", "U", "L", "D", "R"]]
    for t in trajectories:
        assert t.reward == 1.0 and t.metrics["success"] == 1.0 and t.group_id == "room3"
    bumped = next(t for t in trajectories if len(t.turn_ends) == 5)
    assert bumped.metrics["action_is_effective"] == pytest.approx(4 / 5)
    assert bumped.turn_obs_keys[1] == bumped.turn_obs_keys[2]  # the wall left the board as it was
    assert bumped.turn_obs_keys[:2] == next(t for t in trajectories if t is not bumped).turn_obs_keys[:2]


def moves_made(tokenizer, token_ids) -> list[str]:
    """What the model answered after each <|assistant|> of a context."""
    parts = tokenizer.decode(token_ids).split("<|assistant|>")[1:]
    return [part.split("<|end|>")[0] for part in parts if part]


def test_warm_start_walks_are_tokenized_exactly_like_the_agents_conversations(tokenizer, tokenizer_dir):
    from rlsys.data.games import random_walks, valid_moves
    from rlsys.impl.env.frozen_lake import FrozenLake

    eos = tokenizer.eos_token_id
    for seed in (3, 15):
        env = FrozenLakeEnv(max_steps=6)
        row = {"prompt": env.first_observation(seed), "answer": "", "seed": seed}
        (walk,), checks = random_walks(tokenizer, env, [row], num_turns=6, seed=seed, hint=0.5)
        moves = moves_made(tokenizer, walk.token_ids)
        prompt = Prompt(f"lake{seed}", chat_prompt_ids(tokenizer, row["prompt"]), row)
        (trajectory,), _ = play(frozen_lake_agent(tokenizer_dir, n=1, num_turns=6), env, prompt,
                                lambda p, g, i: ids(tokenizer, moves[len(moves_made(tokenizer, p))]) + [eos])
        assert trajectory.token_ids == walk.token_ids and trajectory.loss_mask == walk.taught
        assert len(checks) == len(moves)
        for check in checks:  # each state of the walk accepts exactly the valid moves there
            game = FrozenLake(generate_lake(4, 0.8, seed))
            for move in moves_made(tokenizer, check.prompt_ids):
                game.move(move)
            assert check.accepted == tuple(valid_moves(game))


def test_game_and_shop_walks_start_from_the_prompt_the_rollout_worker_sends(tokenizer):
    """A row with a system prompt (dataset.system_prompt) is walked as it is sent: from its messages; the walks
    taught the board alone, without the system message every episode starts with."""
    from rlsys.data.games import random_walks
    from rlsys.data.webshop import shop_walks
    from rlsys.impl.env.webshop import WebShopEnv

    for env, walks in ((FrozenLakeEnv(max_steps=4), random_walks), (WebShopEnv(max_steps=4), shop_walks)):
        text = env.first_observation(3)
        row = {"prompt": text, "answer": "", "seed": 3,
               "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}
        (walk,), _ = walks(tokenizer, env, [row], 4, 0, 1.0)
        sent = row_prompt_ids(tokenizer, row)
        assert "Be brief." in tokenizer.decode(sent) and walk.token_ids[:len(sent)] == sent
        assert walk.taught[:len(sent)] == [0] * len(sent)


def test_retry_warm_start_is_tokenized_exactly_like_the_agents_second_attempt(tokenizer, tokenizer_dir):
    from rlsys.impl.agent.math_multi_turn import retry_sequences

    (sequence,) = retry_sequences(tokenizer, [{"prompt": "12+34=", "answer": "46"}], seed=0)
    wrong = moves_made(tokenizer, sequence.token_ids)[0]
    assert wrong != "46" and abs(int(wrong) - 46) in (1, 10)
    agent, _ = math_agent(tokenizer_dir, n=1, num_turns=2)
    (trajectory,), _ = play(agent, math_env(), math_prompt(tokenizer), answer_by_history(tokenizer, [[wrong, "46"]]))
    right = ids(tokenizer, "46") + [tokenizer.eos_token_id]
    assert trajectory.token_ids == sequence.token_ids + user_turn(tokenizer, CORRECT_FEEDBACK)
    assert sequence.taught == [0] * (len(sequence.token_ids) - len(right)) + [1] * len(right)
    # a row with a system prompt is taught as the rollout worker sends it (the prompt alone left the system out)
    row = {"prompt": "12+34=", "answer": "46", "messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "12+34="}]}
    (sequence,) = retry_sequences(tokenizer, [row], seed=0)
    sent = row_prompt_ids(tokenizer, row)
    assert "Be brief." in tokenizer.decode(sent) and sequence.token_ids[:len(sent)] == sent


class BrokenLake(FrozenLakeEnv):
    """Crashes on a move down: the episode must fail as a whole, leaving no chain behind."""

    async def step(self, action):
        if action.strip() == "D":
            raise RuntimeError("the lake cracked")
        await asyncio.sleep(0.05)  # the other chain is mid-episode when the crash comes
        return await super().step(action)


def test_a_crashing_env_fails_the_episode_and_cancels_its_other_chains(tokenizer, tokenizer_dir):
    seed = 3
    env = BrokenLake(max_steps=50)
    prompt = game_prompt(tokenizer, env, "lake", seed)
    eos = tokenizer.eos_token_id

    async def scenario():
        agent = frozen_lake_agent(tokenizer_dir, n=2, num_turns=50, max_context_tokens=10_000)
        with pytest.raises(RuntimeError, match="the lake cracked"):
            await run_scripted_episode(agent, env, prompt, lambda p, g, i: ids(tokenizer, "LD"[i]) + [eos])
        await asyncio.sleep(0.2)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert asyncio.run(scenario()) == []


def test_an_episode_stops_before_its_context_outgrows_the_budget(tokenizer, tokenizer_dir):
    seed = 3
    env = FrozenLakeEnv(max_steps=20)
    prompt = game_prompt(tokenizer, env, "lake", seed)
    eos = tokenizer.eos_token_id
    per_turn = 2 + len(user_turn(tokenizer, prompt.data["prompt"][len(env.instruction):]))  # a move, then the board
    budget = len(prompt.token_ids) + 2 * per_turn + 4  # room for two turns and a third's 4 new tokens
    agent = frozen_lake_agent(tokenizer_dir, n=1, num_turns=20, max_context_tokens=budget)
    (trajectory,), _ = play(agent, env, prompt, lambda p, g, i: ids(tokenizer, "L") + [eos])
    assert trajectory.metrics["turns"] == 3 and trajectory.metrics["truncated"] == 1.0
    assert len(trajectory.token_ids) <= budget


def test_a_zero_context_budget_means_the_models_own_limit(tmp_path, tokenizer_dir):
    import json
    import sys

    from rlsys.impl.agent.multi_turn import context_limit

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 300}))
    assert context_limit(str(tmp_path)) == 300
    assert context_limit(str(tokenizer_dir)) == sys.maxsize  # a directory that does not say: no limit
    build_char_tokenizer().save_pretrained(tmp_path)
    assert frozen_lake_agent(tmp_path, n=1).max_context_tokens == 300


def test_feedback_follows_a_turn_under_a_template_that_renders_the_last_assistant_turn_apart(tmp_path):
    """Qwen3's template gives the last assistant turn an empty think block that earlier turns lack: the feedback's ids
    are still what the template renders after the turn (it failed every episode that got feedback, a ValueError)."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}<|{{ message['role'] }}|>"
                               "{% if message['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
                               "{{ message['content'] }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.save_pretrained(tmp_path)
    agent, _ = math_agent(tmp_path, n=1, num_turns=2)
    prompt = math_prompt(tokenizer)
    (trajectory,), _ = play(agent, math_env(), prompt, answer_by_history(tokenizer, [["45", "46"]]))
    eos = tokenizer.eos_token_id
    assert trajectory.token_ids == prompt.token_ids + ids(tokenizer, "45") + [eos] + \
        ids(tokenizer, f"<|user|>{WRONG_FEEDBACK}<|end|><|assistant|>") + ids(tokenizer, "46") + [eos] + \
        ids(tokenizer, f"<|user|>{CORRECT_FEEDBACK}<|end|><|assistant|>")
    assert trajectory.turn_rewards == [0.0, 1.0]
