"""Contract tests of the OpenAI-compatible endpoint and the `openai-agent` plugin: the real `openai` client and a
real LangGraph agent over HTTP, the real episode router, bus and inference worker, a scripted model. Trajectories
are checked token by token against what the engine was asked and produced, call by call."""

import asyncio
import json

import httpx
import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from rlsys.api import NOT_GENERATED, AgentAbstraction, EnvServiceAbstraction, GenerationConfig, Model, Prompt, \
    make_agent, make_env
from rlsys.model.tokenizer import chat_prompt_ids
from rlsys.workers.episode_failure import EpisodeFailed
from tests.endpoint_clients import RESPONSES, SEEN
from tests.scripted import ids, run_scripted_episode
from tests.scripted_engine import ScriptedEngine

LOGPROB = -0.25
ROW = {"prompt": "What is 12*34+1?", "answer": "409"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34+1"}}</tool_call>'


def tool_then_answer(tokenizer, call: str = CALL):
    """A model that calls the calculator first, and answers 409 once a tool response is in its prompt."""
    response = ids(tokenizer, "<tool_response>")

    def policy(prompt_ids, gconfig, sample):
        text = "409" if _contains(prompt_ids, response) else call
        return ids(tokenizer, text) + [tokenizer.eos_token_id]

    return policy


def _contains(seq, sub) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def agent(tokenizer, tokenizer_dir, run: str, n: int = 1, **kwargs):
    # The scripted model stops at a stop token only; a real engine stops at eos by itself.
    gconfig = GenerationConfig(n=n, max_new_tokens=200, stop_token_ids=[tokenizer.eos_token_id])
    return make_agent(AgentAbstraction("openai-agent", {
        "gconfig": gconfig, "tokenizer_path": str(tokenizer_dir),
        "run": run, **kwargs}))


def run_episode(tokenizer, tokenizer_dir, run: str, policy, n: int = 1, **kwargs):
    RESPONSES.clear()
    engine = ScriptedEngine(policy, logprob=LOGPROB)
    prompt = Prompt("q0", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
    env = make_env(EnvServiceAbstraction("math-code-single-step"))
    trajectories = asyncio.run(run_scripted_episode(agent(tokenizer, tokenizer_dir, run, n, **kwargs), env, prompt, policy,
                                                    engine))
    return trajectories, engine


def check_calls(trajectory, engine, calls: list[int]) -> None:
    """The trajectory holds these calls (indices into the engine's requests and RESPONSES): each call's prompt
    is the trajectory so far, exactly as the engine was asked it; the ids the engine generated follow with loss
    mask 1, their logprob and version 0; everything else has loss mask 0 and NOT_GENERATED."""
    position = 0
    generated = set()
    for i in calls:
        prompt_ids, response = engine.requests[i][0], RESPONSES[i]
        assert trajectory.token_ids[:len(prompt_ids)] == prompt_ids
        assert response.model_extra["prompt_token_ids"] == prompt_ids
        out = response.choices[0].model_extra["token_ids"]
        assert trajectory.token_ids[len(prompt_ids):len(prompt_ids) + len(out)] == out
        generated.update(range(len(prompt_ids), len(prompt_ids) + len(out)))
        position = len(prompt_ids) + len(out)
    assert position == len(trajectory.token_ids)
    assert trajectory.loss_mask == [int(i in generated) for i in range(position)]
    assert trajectory.logprobs == [LOGPROB if i in generated else 0.0 for i in range(position)]
    assert trajectory.versions == [0 if i in generated else NOT_GENERATED for i in range(position)]


def test_openai_client_tool_calls_are_token_exact(tokenizer, tokenizer_dir):
    trajectories, engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:openai_tools_run",
                                       tool_then_answer(tokenizer))
    [trajectory] = trajectories
    first, second = RESPONSES
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "12*34+1"})
    assert second.choices[0].message.content == "409" and second.choices[0].finish_reason == "stop"
    assert [c.logprob for c in second.choices[0].logprobs.content] == [LOGPROB] * 4  # "409" and eos
    check_calls(trajectory, engine, [0, 1])
    # The second prompt is the first call's ids, then only the new tool message through the template.
    expected_tail = ids(tokenizer, "<|user|><tool_response>409</tool_response><|end|><|assistant|>")
    assert engine.requests[1][0] == engine.requests[0][0] + ids(tokenizer, CALL) + [tokenizer.eos_token_id] + \
        expected_tail
    assert trajectory.reward == 1.0 and trajectory.turn_rewards == [0.0, 1.0]
    assert trajectory.metrics["history_splits"] == 0 and trajectory.metrics["calls"] == 2


def test_langgraph_react_agent_is_token_exact(tokenizer, tokenizer_dir):
    trajectories, engine = run_episode(tokenizer, tokenizer_dir, "rlsys.impl.agent.langgraph_example:run",
                                       tool_then_answer(tokenizer))
    [trajectory] = trajectories
    assert len(engine.requests) == 2
    (first, _), (second, _) = engine.requests
    call_ids = ids(tokenizer, CALL) + [tokenizer.eos_token_id]
    assert second == first + call_ids + ids(tokenizer, "<|user|><tool_response>409</tool_response><|end|><|assistant|>")
    answer = ids(tokenizer, "409") + [tokenizer.eos_token_id]
    assert trajectory.token_ids == second + answer
    assert trajectory.loss_mask == [0] * len(first) + [1] * len(call_ids) + [0] * (len(second) - len(first) -
                                                                                     len(call_ids)) + [1] * len(answer)
    assert trajectory.reward == 1.0  # the env scored the agent's last answer, 409
    assert trajectory.metrics["history_splits"] == 0


def test_a_client_that_edits_history_is_split_and_counted(tokenizer, tokenizer_dir):
    answers = iter(["46", "47", "48"])
    trajectories, engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:editing_run",
                                       lambda prompt_ids, gconfig, sample: ids(tokenizer, next(answers)) +
                                       [tokenizer.eos_token_id])
    first, second = trajectories
    assert [t.metrics["history_splits"] for t in trajectories] == [1, 1]
    check_calls(first, engine, [0])  # what the model said before the edit: a sample of its own
    check_calls(second, engine, [1, 2])  # the edited history, rendered whole, then continued token-exactly
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": ROW["prompt"]},
                                              {"role": "assistant", "content": "edited"},
                                              {"role": "user", "content": "again"}], add_generation_prompt=True,
                                             tokenize=False)
    assert engine.requests[1][0] == ids(tokenizer, rendered)
    assert engine.requests[2][0] == engine.requests[1][0] + ids(tokenizer, "47") + [tokenizer.eos_token_id] + \
        ids(tokenizer, "<|user|>more<|end|><|assistant|>")
    assert all(t.reward == 0.5 for t in trajectories)


def test_keys_requests_and_completions(tokenizer, tokenizer_dir):
    SEEN.clear()
    trajectories, engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:probing_run",
                                       lambda prompt_ids, gconfig, sample: ids(tokenizer, "46") + [tokenizer.eos_token_id])
    assert SEEN["wrong_key"] == 401 and SEEN["bad"] == 400
    assert SEEN["models"]["data"][0]["id"] == "rlsys"
    assert SEEN["completion"] == "46"
    assert engine.requests[0][0] == ids(tokenizer, "12+34=")  # a completion's prompt is its text, as it is
    [trajectory] = trajectories
    assert trajectory.token_ids == ids(tokenizer, "12+34=46") + [tokenizer.eos_token_id]

    async def after_the_episode():  # the episode ended: its key is refused with 410, saying so
        async with httpx.AsyncClient(base_url=SEEN["base_url"]) as http:
            return await http.get("/models", headers={"Authorization": f"Bearer {SEEN['key']}"})

    # The endpoint belongs to the event loop the episode ran in; a new loop's client reaches it only while that
    # loop runs, so this check runs the refusal through the endpoint object itself.
    from rlsys.endpoint.server import Endpoint, RequestError
    endpoint = Endpoint()
    endpoint.close("k")
    with pytest.raises(RequestError) as refused:
        endpoint.session(type("R", (), {"headers": {"authorization": "Bearer k"}})())
    assert refused.value.status == 410


def test_n_samples_fork_and_unparseable_calls_are_counted(tokenizer, tokenizer_dir):
    bad = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    trajectories, engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:openai_tools_run",
                                       tool_then_answer(tokenizer, call=bad), n=2)
    assert len(trajectories) == 2  # the group: two runs, each its own key and sample
    for t in trajectories:
        assert t.stop_reason == "decode_error" and t.metrics["decode_errors"] == 1 and t.reward == 0.0
        assert sum(t.loss_mask) == len(ids(tokenizer, bad)) + 1


@pytest.mark.parametrize("run, reason", [("failing_run", "agent_error"), ("hanging_run", "agent_timeout")])
def test_a_failing_or_hanging_user_function_ends_the_episode_with_a_reason(tokenizer, tokenizer_dir, run, reason):
    policy = tool_then_answer(tokenizer)
    if reason == "agent_error":
        with pytest.raises(RuntimeError, match="the user's agent broke"):  # the rollout worker counts it agent_error
            run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}", policy)
    else:
        with pytest.raises(EpisodeFailed) as failed:
            run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}", policy, timeout=0.5)
        assert failed.value.reason == reason


def test_model_generates_with_request_ids_of_its_own():
    async def main():
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()

        async def engine():
            from rlsys.api import GenerationOutput
            while True:
                qid, token_ids, gconfig = await obs_queue.get()
                await asyncio.sleep(0.01 * (3 - len(token_ids)))  # later requests answered first
                act_queue.put_nowait(GenerationOutput(qid, token_ids, [token_ids[::-1]], [[0.0] * len(token_ids)],
                                                      [[0] * len(token_ids)], ["stop"]))

        served = [asyncio.create_task(engine()) for _ in range(3)]
        async with Model(obs_queue, act_queue) as model:
            outputs = await asyncio.gather(*(model.generate(list(range(k)), GenerationConfig()) for k in (1, 2, 3)))
        for task in served:
            task.cancel()
        return outputs

    outputs = asyncio.run(main())
    assert [o.output_ids[0] for o in outputs] == [[0], [1, 0], [2, 1, 0]]
    assert len({o.qid for o in outputs}) == 3


def test_runs_share_the_workers_http_pools_and_each_call_carries_its_own_key(tokenizer, tokenizer_dir):
    """The openai example builds no HTTP client per run (an SSL context each, ~50 ms of CPU): every call of two
    episodes' runs goes through the loop's shared pools, each with its own run's key, and lands in that run's
    session."""
    from rlsys.endpoint.http_client import POOLS, shared_http_client
    from rlsys.endpoint.server import shared_endpoint

    policy = lambda prompt_ids, gconfig, sample: ids(tokenizer, "46") + [tokenizer.eos_token_id]  # noqa: E731

    async def main():
        sent = []

        async def record(request):
            sent.append(request.headers["authorization"].removeprefix("Bearer "))

        pools = {id(client): client for client in (shared_http_client() for _ in range(2 * POOLS))}
        assert len(pools) == POOLS  # handed out in turn, the same ones again
        for client in pools.values():
            client.event_hooks = {"request": [record], "response": []}
        episodes = []
        for _ in range(2):
            prompt = Prompt("q0", chat_prompt_ids(tokenizer, ROW["prompt"]), ROW)
            env = make_env(EnvServiceAbstraction("math-code-single-step"))
            episodes.append(await run_scripted_episode(
                agent(tokenizer, tokenizer_dir, "rlsys.impl.agent.openai_example:run", n=4), env, prompt, policy))
        return sent, set((await shared_endpoint()).finished), episodes

    sent, finished, episodes = asyncio.run(main())
    assert len(sent) == 8 and set(sent) == finished  # one call per run, each with its own episode's key
    for trajectories in episodes:
        assert len(trajectories) == 4
        assert all(t.metrics["calls"] == 1 and t.token_ids[-3:] == ids(tokenizer, "46") + [tokenizer.eos_token_id]
                   for t in trajectories)
