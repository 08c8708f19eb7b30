"""Contract tests of the tool-calling agent with the math-tools env: real episode router, bus and inference
worker, a scripted model. Trajectories are checked token by token."""

import asyncio
import dataclasses

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from experiments import AsyncPPOMATHToolsConfig
from experiments.common import GenerationHyperparameters, ModelConfig
from rlsys.api import (NOT_GENERATED, AgentAbstraction, EnvironmentService, EnvServiceAbstraction, GenerationConfig,
                       GenerationOutput, Prompt, make_agent, make_env)
from rlsys.impl.agent.multi_turn import SEED_STRIDE
from rlsys.impl.env import math_tools
from rlsys.impl.env.math_verifier import Verdict
from rlsys.model.tokenizer import chat_prompt_ids
from tests.scripted import ids, run_scripted_episode
from tests.scripted_engine import ScriptedEngine

SEED = 100  # chain c's turn t samples with seed SEED + c + SEED_STRIDE * t: how the scripted model tells chains apart
LOGPROB = -0.25
ROW = {"prompt": "What is 12*34+1?", "answer": "409"}
CALCULATOR = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
PYTHON = '<tool_call>{"name": "python", "arguments": {"code": "print(408 + 1)"}}</tool_call>'




def scripted(tokenizer, scripts: dict[int, list[str]], eos: bool = True):
    """A model that says scripts[chain][turn] (then eos); the turn is read off the assistant prompts so far."""
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")

    def policy(prompt_ids, gconfig, sample):
        chain, turn = (gconfig.seed - SEED) % SEED_STRIDE, prompt_ids.count(assistant) - 1
        return ids(tokenizer, scripts[chain][turn]) + [tokenizer.eos_token_id] * eos

    return policy


def run(agent, env, policy, prompt):
    engine = ScriptedEngine(policy, logprob=LOGPROB)
    return asyncio.run(run_scripted_episode(agent, env, prompt, policy, engine)), engine


def tool_agent(tokenizer_dir, n=1, max_new_tokens=200, **kwargs):
    gconfig = GenerationConfig(n=n, max_new_tokens=max_new_tokens, seed=SEED)
    return make_agent(AgentAbstraction("tool-calling", {"gconfig": gconfig, "tokenizer_path": str(tokenizer_dir),
                                                        **kwargs}))


def pieces_match(trajectory, pieces: list[tuple[list[int], int]]) -> None:
    """The trajectory is exactly these (token ids, generated?) pieces, with masks, logprobs and versions to match."""
    assert trajectory.token_ids == [t for piece, _ in pieces for t in piece]
    assert trajectory.loss_mask == [g for piece, g in pieces for _ in piece]
    assert trajectory.logprobs == [LOGPROB if g else 0.0 for piece, g in pieces for _ in piece]
    assert trajectory.versions == [0 if g else NOT_GENERATED for piece, g in pieces for _ in piece]


@pytest.mark.parametrize("role", ["system", "developer"])
def test_the_environment_s_instructions_join_the_row_s_system_message_under_either_name(tokenizer, tokenizer_dir, role):
    """A developer message (OpenAI's newer name for the system role) is the row's system message: the instructions
    join it, rather than coming first as a second system message."""
    row = {"messages": [{"role": role, "content": "Be terse."}, {"role": "user", "content": "2+2="}]}
    prompt = Prompt("q1", [], row)
    rendered = tokenizer.decode(tool_agent(tokenizer_dir).prompt_ids(prompt, "Use the tools."))
    assert rendered == "<|system|>Be terse.\n\nUse the tools.<|end|><|user|>2+2=<|end|><|assistant|>"


def test_calculator_then_python_then_answer(tokenizer, tokenizer_dir):
    config = AsyncPPOMATHToolsConfig(model=ModelConfig(path=str(tokenizer_dir)), group_size=2,
                                     gen=GenerationHyperparameters(max_new_tokens=200), max_total_tokens=4096)
    config.inference.max_model_len = 4096
    agent_spec = config.agent
    agent_spec.args["gconfig"] = dataclasses.replace(agent_spec.args["gconfig"], seed=SEED)
    agent, env = make_agent(agent_spec), make_env(config.env)
    bad_calls = '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call><tool_call>{oops</tool_call>'
    scripts = {0: ["Let me compute. " + CALCULATOR, PYTHON, "<answer>409</answer>"],
               1: [bad_calls, "<answer>408</answer>"]}
    prompt = Prompt("q7", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    (right, wrong), engine = run(agent, env, scripted(tokenizer, scripts), prompt)

    instructions, _ = asyncio.run(make_env(config.env).reset(options=ROW))
    prompt_ids = ids(tokenizer, f"<|system|>{instructions}<|end|><|user|>{ROW['prompt']}<|end|><|assistant|>")
    assert "calculator(expression)" in instructions and "python(code)" in instructions
    eos = [tokenizer.eos_token_id]
    turns = [ids(tokenizer, text) + eos for text in scripts[0]]
    observations = [ids(tokenizer, "<|user|><tool_response>408</tool_response><|end|><|assistant|>"),
                    ids(tokenizer, "<|user|><tool_response>409\n</tool_response><|end|><|assistant|>")]
    pieces_match(right, [(prompt_ids, 0), (turns[0], 1), (observations[0], 0), (turns[1], 1), (observations[1], 0),
                         (turns[2], 1)])
    ends = [len(prompt_ids) + len(turns[0])]
    ends += [ends[0] + len(observations[0]) + len(turns[1])]
    ends += [ends[1] + len(observations[1]) + len(turns[2])]
    assert right.turn_ends == ends and right.turn_rewards == [0.0, 0.0, 1.0] and right.reward == 1.0
    assert right.group_id == wrong.group_id == "q7" and right.stop_reason == wrong.stop_reason == "answer"
    assert not right.void and not wrong.void  # undecodable calls are calls, not void turns
    assert right.metrics == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0, "decode_errors": 0,
                             "void_turns": 0, "answered": 1, "success": 1, "prefix_breaks": 0,
                             "verify_failed": 0}

    error_text = tokenizer.decode(wrong.token_ids[wrong.turn_ends[0]:], skip_special_tokens=False)
    assert error_text.startswith("<|user|><tool_response>error: calculator: missing argument 'expression'; "
                                 "unknown argument 'expr' (takes ['expression'])</tool_response>\n"
                                 "<tool_response>error: not valid JSON: Expecting property name")
    assert wrong.turn_rewards == [0.0, 0.0] and wrong.reward == 0.0
    assert wrong.metrics == {"turns": 2, "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "decode_errors": 2,
                             "void_turns": 0, "answered": 1, "success": 0, "prefix_breaks": 0,
                             "verify_failed": 0}

    # token in, token out: each request was exactly the chain's tokens up to the start of one of its turns
    assert len(engine.requests) == 5
    assert len({gconfig.seed for _, gconfig in engine.requests}) == 5  # each turn of each chain: its own stream
    requested = {0: [], 1: []}
    for request_ids, gconfig in engine.requests:
        chain = {0: right, 1: wrong}[(gconfig.seed - SEED) % SEED_STRIDE]
        assert gconfig.n == 1 and request_ids == chain.token_ids[:len(request_ids)]
        requested[(gconfig.seed - SEED) % SEED_STRIDE].append(len(request_ids))
    for chain, trajectory in ((0, right), (1, wrong)):
        mask = trajectory.loss_mask
        assert sorted(requested[chain]) == [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]


def test_python_timeout_and_void_turn_are_observations_and_counted(tokenizer, tokenizer_dir):
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"python": {"limits": {"wall_seconds": 1}}}}))
    loop = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    scripts = {0: [loop, "thinking...", "<answer>409</answer>"]}
    prompt = Prompt("q8", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    [trajectory], _ = run(tool_agent(tokenizer_dir, use_instructions=False), env, scripted(tokenizer, scripts), prompt)

    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    assert "<tool_response>[wall time limit of 1s exceeded; killed]</tool_response>" in text
    assert "<|user|>No tool call and no answer found." in text
    assert trajectory.token_ids[:len(prompt.token_ids)] == prompt.token_ids  # no instructions asked for
    assert trajectory.metrics == {"turns": 3, "tool_calls": 1, "tool_errors": 1, "tool_timeouts": 1,
                                  "decode_errors": 0, "void_turns": 1, "answered": 1, "success": 1,
                                  "prefix_breaks": 0, "verify_failed": 0}
    assert trajectory.reward == 1.0 and trajectory.stop_reason == "answer"
    assert trajectory.void  # a turn with neither a call nor an answer: ppo.mask_void_trajectories keeps it out


class TimedOutPool:
    """A verifier pool whose every check ran out of time."""

    async def score(self, answers, reference, timeout):
        return [Verdict(False, "timeout", "check took longer than 5s") for _ in answers]


def test_an_answer_whose_check_timed_out_counts_as_verify_failed(tokenizer, tokenizer_dir, monkeypatch):
    """Scored 0 as a wrong answer is, and counted (agent/verify_failed) as the math agents count math-verify's
    failures: the tools run's wrong answers hid them."""
    monkeypatch.setattr(math_tools, "shared_pool", lambda workers=None: TimedOutPool())
    prompt = Prompt("q16", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    [trajectory], _ = run(tool_agent(tokenizer_dir, use_instructions=False), make_env(EnvServiceAbstraction(
        "math-tools")), scripted(tokenizer, {0: ["<answer>409</answer>"]}), prompt)
    assert trajectory.reward == 0.0 and trajectory.stop_reason == "answer"
    assert trajectory.metrics["answered"] == 1 and trajectory.metrics["verify_failed"] == 1


def test_num_turns_ends_the_episode_after_the_last_turn(tokenizer, tokenizer_dir):
    env = make_env(EnvServiceAbstraction("math-tools"))
    prompt = Prompt("q9", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    [trajectory], engine = run(tool_agent(tokenizer_dir, num_turns=3, use_instructions=False), env,
                               scripted(tokenizer, {0: [CALCULATOR] * 5}), prompt)

    assert trajectory.stop_reason == "num_turns" and len(engine.requests) == 3
    # no trailing observation
    assert len(trajectory.turn_ends) == 3 and trajectory.turn_ends[-1] == len(trajectory.token_ids)
    assert trajectory.turn_rewards == [0.0] * 3 and trajectory.reward == 0.0
    assert trajectory.metrics["tool_calls"] == 3 and trajectory.metrics["answered"] == 0
    with pytest.raises(TypeError, match=r"ToolCallingAgent: max_turns is now num_turns .*num_turns=3"):
        tool_agent(tokenizer_dir, max_turns=3)  # the limit's earlier name, as MultiTurnAgent refuses it


def test_token_budget_caps_each_turn_and_ends_the_episode(tokenizer, tokenizer_dir):
    prompt = Prompt("q10", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    budget = len(prompt.token_ids) + 60  # room for 60 tokens: the call is cut short, no observation fits after it
    env = make_env(EnvServiceAbstraction("math-tools"))
    [trajectory], engine = run(tool_agent(tokenizer_dir, max_total_tokens=budget, use_instructions=False), env,
                               scripted(tokenizer, {0: [CALCULATOR] * 3}), prompt)

    assert engine.requests[0][1].max_new_tokens == 60
    assert trajectory.stop_reason == "token_budget" and len(trajectory.token_ids) == budget
    assert trajectory.metrics["decode_errors"] == 1  # the cut call had no closing tag
    pieces_match(trajectory, [(prompt.token_ids, 0), (ids(tokenizer, CALCULATOR)[:60], 1)])


def test_a_turn_cut_at_max_new_tokens_is_closed_with_an_untrained_eos(tokenizer, tokenizer_dir):
    prompt = Prompt("q11", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    scripts = {0: [CALCULATOR, "<answer>409</answer>"]}
    agent = tool_agent(tokenizer_dir, max_new_tokens=len(ids(tokenizer, CALCULATOR)), use_instructions=False)
    [trajectory], _ = run(agent, make_env(EnvServiceAbstraction("math-tools")),
                          scripted(tokenizer, scripts, eos=False), prompt)

    observation = [tokenizer.eos_token_id] + ids(tokenizer, "<|user|><tool_response>408</tool_response>"
                                                            "<|end|><|assistant|>")
    pieces_match(trajectory, [(prompt.token_ids, 0), (ids(tokenizer, CALCULATOR), 1), (observation, 0),
                              (ids(tokenizer, "<answer>409</answer>"), 1)])
    assert trajectory.reward == 1.0 and trajectory.metrics["tool_calls"] == 1


def test_a_prompt_longer_than_the_budget_is_a_clear_error(tokenizer, tokenizer_dir):
    prompt = Prompt("q12", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    agent = tool_agent(tokenizer_dir, max_total_tokens=100)  # the instructions alone are longer
    with pytest.raises(ValueError, match="leaving nothing of the 100-token budget"):
        run(agent, make_env(EnvServiceAbstraction("math-tools")), scripted(tokenizer, {0: ["x"]}), prompt)


def test_the_instructions_join_the_row_s_own_system_prompt_and_earlier_turns(tokenizer, tokenizer_dir):
    """`dataset.system_prompt`, and a conversational row's earlier messages, reach the model beside the
    instructions: not dropped for a system message of the instructions alone."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "<answer>2</answer>"}, {"role": "user", "content": ROW["prompt"]}]
    row = {**ROW, "messages": messages}
    prompt = Prompt("q14", chat_prompt_ids(tokenizer, messages), row)
    agent = tool_agent(tokenizer_dir)
    assert ids(tokenizer, "<|system|>Be brief.\n\nTools!<|end|><|user|>1+1?<|end|><|assistant|><answer>2</answer>"
                          f"<|end|><|user|>{ROW['prompt']}<|end|><|assistant|>") == agent.prompt_ids(prompt, "Tools!")
    without_system = {**ROW, "messages": messages[1:]}
    assert tokenizer.decode(agent.prompt_ids(Prompt("q15", [], without_system), "Tools!")).startswith(
        "<|system|>Tools!<|end|><|user|>1+1?<|end|>")


class FailingChainEnv(EnvironmentService):
    """Chain 0's step raises; chain 1's takes a while and then goes on."""

    async def step(self, action):
        chain, _ = action
        if chain == 0:
            raise RuntimeError("chain 0's env broke")
        await asyncio.sleep(0.1)
        return "go on", 0.0, False, False, {}


def test_a_failing_chain_stops_the_others(tokenizer, tokenizer_dir):
    """The episode fails with chain 0's error, and chain 1 stops with it: not left behind as a task that goes on
    to its next turn and awaits, forever, a reply nobody routes any more."""
    prompt = Prompt("q13", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    agent = tool_agent(tokenizer_dir, n=2, use_instructions=False)

    async def episode():
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()

        async def engine():
            while True:
                qid, token_ids, _ = await obs_queue.get()
                act_queue.put_nowait(GenerationOutput(qid, token_ids, [[5]], [[LOGPROB]], [[0]], ["length"]))

        serving = asyncio.create_task(engine())
        with pytest.raises(RuntimeError, match="chain 0's env broke"):
            await agent.collect_trajectory(prompt, FailingChainEnv(), obs_queue, act_queue)
        await asyncio.sleep(0.3)  # chain 1's step would be over by now
        serving.cancel()
        return [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), serving) and not t.done()]

    assert asyncio.run(episode()) == []
