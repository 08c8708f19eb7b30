"""Contract tests of the OpenAI-compatible endpoint and the `openai-agent` plugin: the real `openai` client and a
real LangGraph agent over HTTP, the real episode router, bus and inference worker, a scripted model. Trajectories
are checked token by token against what the engine was asked and produced, call by call."""

import asyncio
import functools
import json
import logging
import math
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from rlsys.api import NOT_GENERATED, AgentAbstraction, EnvServiceAbstraction, GenerationConfig, GenerationOutput, \
    Model, Prompt, make_agent, make_env
from rlsys.bus import InProcessBus
from rlsys.endpoint import http_protocol, server
from rlsys.endpoint.server import Endpoint
from rlsys.endpoint.session import EpisodeSession, _cut_at_stop_strings
from rlsys.model.tokenizer import chat_prompt_ids
from rlsys.workers.episode_failure import EpisodeFailed
from rlsys.workers.routing import EpisodeRouter
from tests.endpoint_clients import RESPONSES, SEEN, TOOLS
from tests.helpers import with_field
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
    trajectories = asyncio.run(run_scripted_episode(agent(tokenizer, tokenizer_dir, run, n, **kwargs), env, prompt,
                                                    policy, engine))
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
                                       lambda prompt_ids, gconfig, sample: (ids(tokenizer, "46")
                                                                            + [tokenizer.eos_token_id]))
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
    from rlsys.endpoint.server import RequestError
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


@pytest.mark.parametrize("run, reason", [("failing_run", "agent_error"), ("hanging_run", "agent_timeout"),
                                         ("own_timeout_run", "agent_error")])
def test_a_failing_or_hanging_user_function_ends_the_episode_with_a_reason(tokenizer, tokenizer_dir, run, reason):
    """A TimeoutError of the function's own, well within its timeout, is its error, not an agent_timeout."""
    policy = tool_then_answer(tokenizer)
    if reason == "agent_error":  # raised as is: the rollout worker counts it agent_error
        with pytest.raises((RuntimeError, TimeoutError), match="the user's (agent broke|HTTP call timed out)"):
            run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}", policy)
    else:
        with pytest.raises(EpisodeFailed) as failed:
            run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}", policy, timeout=0.5)
        assert failed.value.reason == reason


@pytest.mark.parametrize("args, message", [({"timeout": 0}, "timeout must be positive"),
                                           ({"max_total_tokens": 0}, "max_total_tokens must leave room"),
                                           ({"host": "no-such-host.invalid"}, "host 'no-such-host.invalid' cannot be")])
def test_agent_arguments_no_call_could_succeed_under_are_refused_when_it_is_built(tokenizer, tokenizer_dir, args,
                                                                                 message):
    with pytest.raises(ValueError, match=message):
        agent(tokenizer, tokenizer_dir, "tests.endpoint_clients:openai_tools_run", **args)


def test_the_endpoint_listens_on_an_ipv6_host_and_names_it_in_its_url():
    async def main():
        endpoint = Endpoint("::1")
        await endpoint.start()
        try:
            async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                return endpoint.base_url, await http.get("/models", headers={"Authorization": "Bearer nobody"})
        finally:
            endpoint.task.cancel()

    url, refused = asyncio.run(main())
    assert url.startswith("http://[::1]:") and url.endswith("/v1")
    assert refused.status_code == 401  # served: the key is refused, not the connection


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


def test_headers_that_never_end_are_refused_before_they_fill_the_workers_memory():
    """Headers are read before any key is checked, and every local user reaches the endpoint: the server stops
    reading a header block long before it has taken 64 MiB, and ends the connection."""
    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: endpoint\r\nX-Pad: ")
        try:
            for _ in range(64):
                writer.write(b"a" * 2**20)
                await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)  # still reading headers: never answers
        except ConnectionError:  # closed while we wrote
            answer = b""
        except TimeoutError:
            answer = None
        finally:
            writer.close()
            endpoint.task.cancel()
        return answer

    answer = asyncio.run(main())
    assert answer is not None, "the server kept reading 64 MiB of headers"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]



async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before it closed the connection, or None if it was still open after `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except ConnectionError:
        return b""
    except TimeoutError:
        return None


def test_a_request_that_does_not_arrive_in_time_is_closed_and_an_answered_one_is_not(monkeypatch):
    """Every local user reaches the endpoint, and each connection holds a descriptor of the rollout worker's: a
    connection that never sends, trickles its headers or stops in its body is closed at the deadline (more bytes do
    not restart it); an answered connection stays open for its next request, and a handler slower than the
    deadline is not cut."""
    monkeypatch.setattr(http_protocol, "REQUEST_READ_SECONDS", 0.5)

    async def main():
        endpoint = Endpoint()

        @endpoint.app.get("/slow")
        async def slow():
            await asyncio.sleep(1.0)
            return {"ok": True}

        @endpoint.app.post("/echo")
        async def echo(request: Request):
            return {"body": (await request.body()).decode()}

        await endpoint.start()
        connect = functools.partial(asyncio.open_connection, "127.0.0.1", endpoint.port)
        (silent, _), (trickle, trickle_w), (body, body_w), (kept, kept_w) = [await connect() for _ in range(4)]
        body_w.write(b"POST /echo HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n" + b"{" * 10)
        kept_w.write(b"GET /slow HTTP/1.1\r\nHost: e\r\n\r\n")
        started = asyncio.get_running_loop().time()
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: e\r\nX-Pad: aaaaaaa":  # a byte every 50 ms
            if trickle_w.is_closing() or trickle.at_eof():
                break
            trickle_w.write(bytes([byte]))
            await asyncio.sleep(0.05)
        trickled = asyncio.get_running_loop().time() - started
        closed = [await _closed_within(r, 2.0) for r in (silent, trickle, body)]
        slow_answer = await kept.readuntil(b'{"ok":true}')
        await asyncio.sleep(0.7)  # idle past the deadline, within keep-alive
        kept_w.write(b"GET /v1/models HTTP/1.1\r\nHost: e\r\n\r\n")
        second = await asyncio.wait_for(kept.readuntil(b"invalid_api_key"), 5)
        endpoint.task.cancel()
        return trickled, closed, slow_answer, second

    trickled, closed, slow_answer, second = asyncio.run(main())
    assert closed == [b"", b"", b""], closed  # each closed, none answered
    assert trickled < 1.5, trickled  # the trickle was cut near the deadline, not when it finished (2.1 s)
    assert slow_answer.startswith(b"HTTP/1.1 200"), slow_answer
    assert second.startswith(b"HTTP/1.1 401"), second


def test_connections_over_the_cap_are_answered_busy_and_closed_until_one_ends(monkeypatch):
    """The endpoint keeps at most its cap of connections (half the descriptors the process may open, beyond a
    reserve), so connections opened and held by anyone cannot take the rollout worker's last descriptors."""
    monkeypatch.setattr(server, "connection_cap", lambda descriptors: 3, raising=False)

    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        connect = functools.partial(asyncio.open_connection, "127.0.0.1", endpoint.port)
        held = [await connect() for _ in range(3)]
        over, _ = await connect()
        refused = await _closed_within(over, 5)
        held[0][1].close()
        await asyncio.sleep(0.2)
        reader, writer = await connect()
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: e\r\n\r\n")
        answered = await asyncio.wait_for(reader.readuntil(b"invalid_api_key"), 5)
        endpoint.task.cancel()
        return refused, answered

    refused, answered = asyncio.run(main())
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert answered.startswith(b"HTTP/1.1 401"), answered


@pytest.mark.parametrize("ends", ["while_the_body_arrives", "while_the_model_generates"])
def test_a_call_whose_episode_ends_before_it_is_answered_gets_410(tokenizer, ends):
    """The episode's model answers nothing once the episode has ended (a run of its group failed, say): a call still
    sending its body then, or waiting on the model, is refused with 410, and none waits forever or fails with 500."""
    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        looked_up, session_of = asyncio.Event(), endpoint.session
        endpoint.session = lambda request: looked_up.set() or session_of(request)
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        body = json.dumps({"prompt": "12+34=", "max_tokens": 4}).encode()
        async with Model(obs_queue, act_queue) as model:
            key = endpoint.open(EpisodeSession(model, tokenizer, GenerationConfig(max_new_tokens=4), 64, "rlsys"))
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            sent = 5 if ends == "while_the_body_arrives" else len(body)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nAuthorization: Bearer " + key.encode() +
                         b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:sent])
            await writer.drain()
            if sent == len(body):
                await obs_queue.get()  # the request reached the model, which will never answer it
            else:
                await looked_up.wait()  # the server has read the headers and checked the key
            endpoint.close(key)  # as the agent ends an episode: keys closed, then the model
        writer.write(body[sent:])
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.readuntil(b"\n}"), 20)  # the end of the indented body
        except TimeoutError:
            answer = b"no answer"
        writer.close()
        endpoint.task.cancel()
        return answer, obs_queue.qsize()

    answer, asked = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 410") and b"episode_ended" in answer, answer
    assert asked == 0  # nothing was asked of the model for an episode that had ended


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_client_gave_up_is_not_recorded_and_its_retry_is(tokenizer, stream):
    """The `openai` client times out a call the model is slow to answer and sends it again: the reply to the call it
    gave up on reaches nobody, and no sample holds it (it was trained with the episode's reward, beside the retry's).
    Streamed, the same: the client gave up before the first chunk."""
    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()

        async def engine():  # answers the first request once its retry has come, the retry next
            requests = [await obs_queue.get() for _ in range(2)]
            for (qid, token_ids, _), text in zip(requests, ("99", "46")):
                reply = ids(tokenizer, text) + [tokenizer.eos_token_id]
                act_queue.put_nowait(GenerationOutput(qid, token_ids, [reply], [[LOGPROB] * len(reply)],
                                                      [[0] * len(reply)], ["stop"]))
                await asyncio.sleep(0.2)

        serving = asyncio.create_task(engine())
        async with Model(obs_queue, act_queue) as model:
            session = EpisodeSession(model, tokenizer, GenerationConfig(max_new_tokens=8), CONTEXT, "rlsys")
            key = endpoint.open(session)
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=1, timeout=1.0)
            messages = [{"role": "user", "content": "12+34="}]
            response = await client.chat.completions.create(model="rlsys", messages=messages, stream=stream)
            content = ("".join([c.choices[0].delta.content or "" async for c in response if c.choices]) if stream
                       else response.choices[0].message.content)
            await serving
            endpoint.close(key)
        endpoint.task.cancel()
        return content, session.conversation

    content, conversation = asyncio.run(main())
    assert content == "46"
    [trajectory] = conversation.trajectories(1.0, "q0")
    assert trajectory.token_ids == ids(tokenizer, "<|user|>12+34=<|end|><|assistant|>46") + [tokenizer.eos_token_id]
    assert trajectory.metrics["calls"] == 1


def test_concurrent_calls_that_continue_one_sample_each_fork_it(tokenizer):
    """A client may send several calls from the same history at once (a search over next steps): each continues the
    sample, as n > 1 would fork it, and none is refused for the other having consumed it."""
    async def main():
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        reply = ids(tokenizer, "46") + [tokenizer.eos_token_id]

        async def engine(together: int):  # answers once `together` requests are in: all of them saw the same samples
            while True:
                requests = [await obs_queue.get() for _ in range(together)]
                for qid, token_ids, _ in requests:
                    act_queue.put_nowait(GenerationOutput(qid, token_ids, [reply], [[LOGPROB] * len(reply)],
                                                          [[0] * len(reply)], ["stop"]))

        async with Model(obs_queue, act_queue) as model:
            session = EpisodeSession(model, tokenizer, GenerationConfig(max_new_tokens=8), CONTEXT, "rlsys")
            key = ENDPOINT.open(session)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ENDPOINT.app), base_url="http://e/v1",
                                         headers={"Authorization": f"Bearer {key}"}) as http:
                serving = asyncio.create_task(engine(1))
                history = [{"role": "user", "content": "12+34="}]
                first = await http.post("/chat/completions", json={"messages": history})
                history.append(first.json()["choices"][0]["message"])
                serving.cancel()
                serving = asyncio.create_task(engine(2))
                followed = await asyncio.gather(*(http.post("/chat/completions", json={
                    "messages": history + [{"role": "user", "content": text}]}) for text in ("again", "more")))
                serving.cancel()
            ENDPOINT.close(key)
        return followed, session.conversation.trajectories(1.0, "q0")

    followed, trajectories = asyncio.run(main())
    assert [r.status_code for r in followed] == [200, 200], [r.text for r in followed]
    first_turn = ids(tokenizer, "<|user|>12+34=<|end|><|assistant|>46") + [tokenizer.eos_token_id]
    assert len(trajectories) == 2 and all(t.token_ids[:len(first_turn)] == first_turn for t in trajectories)
    assert all(len(t.turn_ends) == 2 and t.metrics["history_splits"] == 0 for t in trajectories)


# Renders the last assistant turn apart, as Qwen3's template does (an empty think block, which earlier turns lose)
LAST_TURN_APART = ("{% for message in messages %}<|{{ message['role'] }}|>"
                   "{% if message['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
                   "{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def two_chat_calls(tokenizer):
    """A call, then one that sends its history and a new user message: the second's response, the prompt ids the
    engine was asked, and the episode's conversation."""
    async def main():
        obs_queue, act_queue, asked = asyncio.Queue(), asyncio.Queue(), []
        reply = ids(tokenizer, "46") + [tokenizer.eos_token_id]

        async def engine():
            while True:
                qid, token_ids, _ = await obs_queue.get()
                asked.append(token_ids)
                act_queue.put_nowait(GenerationOutput(qid, token_ids, [reply], [[LOGPROB] * len(reply)],
                                                      [[0] * len(reply)], ["stop"]))

        serving = asyncio.create_task(engine())
        async with Model(obs_queue, act_queue) as model:
            session = EpisodeSession(model, tokenizer, GenerationConfig(max_new_tokens=8), CONTEXT, "rlsys")
            key = ENDPOINT.open(session)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ENDPOINT.app), base_url="http://e/v1",
                                         headers={"Authorization": f"Bearer {key}"}) as http:
                history = [{"role": "user", "content": "12+34="}]
                first = await http.post("/chat/completions", json={"messages": history})
                history += [first.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
                second = await http.post("/chat/completions", json={"messages": history})
            ENDPOINT.close(key)
        serving.cancel()
        return second, asked, session.conversation

    return asyncio.run(main())


def test_a_template_that_renders_the_last_assistant_turn_apart_is_continued_token_exactly():
    """Every call after the first continues the model's own ids with the new messages; the stand-in exchange this is
    rendered after must be cut where a following message starts, not where the template ends a last turn (it was a
    ValueError, a 500 for every such call)."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = LAST_TURN_APART
    second, asked, conversation = two_chat_calls(tokenizer)
    assert second.status_code == 200, second.text
    assert asked[1] == asked[0] + ids(tokenizer, "46") + [tokenizer.eos_token_id] + \
        ids(tokenizer, "<|user|>again<|end|><|assistant|>")
    assert conversation.history_splits == 0


def test_a_template_that_renders_earlier_turns_anew_splits_the_episode_rather_than_failing_the_call():
    """A template whose rendering of the first messages depends on what follows (here: it starts with the last
    message's text) leaves no ids to append: the call is served from the whole conversation's rendering, and the
    split counted, as for a client that rewrote its history; it was a 500."""
    from rlsys.model.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{{ messages[-1]['content'] }}" + CHAT_TEMPLATE
    second, asked, conversation = two_chat_calls(tokenizer)
    assert second.status_code == 200, second.text
    assert asked[1] == ids(tokenizer, "again<|user|>12+34=<|end|><|assistant|>46<|end|><|user|>again<|end|>"
                                "<|assistant|>")
    assert conversation.history_splits == 1 and len(conversation.samples) == 2

def test_a_process_that_serves_the_endpoint_raises_its_descriptor_limit_to_the_hard_one():
    """Under the usual soft limit of 1024 the endpoint's cap would be 384 connections, below the 512 calls 64
    episodes of 8 runs may have in flight; the process that starts an endpoint raises its soft limit to the hard
    one."""
    code = ("import asyncio, resource; from rlsys.endpoint.server import Endpoint; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); e = Endpoint(); "
            "asyncio.run(e.start()); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    raised, hard = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).parents[1]).stdout.split()
    assert int(hard) > 256, "this machine's hard limit leaves nothing to raise"
    wanted = http_protocol.DESCRIPTORS_WANTED if int(hard) == resource.RLIM_INFINITY else int(hard)
    assert int(raised) == wanted, (raised, hard)

def scripted_calls(tokenizer, replies: list[str], calls, stop_reason: str = "stop"):
    """`calls(http)` on a fresh episode's key over ASGI, its model answering each request with the next of `replies`
    (and eos) ended with `stop_reason`: what `calls` returned, the prompt ids the engine was asked, and the episode's
    conversation."""
    async def main():
        obs_queue, act_queue, asked, script = asyncio.Queue(), asyncio.Queue(), [], iter(replies)

        async def engine():
            while True:
                qid, token_ids, gconfig = await obs_queue.get()
                asked.append(token_ids)
                reply = ids(tokenizer, next(script)) + [tokenizer.eos_token_id]
                act_queue.put_nowait(GenerationOutput(qid, token_ids, [reply] * gconfig.n,
                                                      [[LOGPROB] * len(reply)] * gconfig.n,
                                                      [[0] * len(reply)] * gconfig.n, [stop_reason] * gconfig.n))

        serving = asyncio.create_task(engine())
        async with Model(obs_queue, act_queue) as model:
            defaults = GenerationConfig(max_new_tokens=32, stop_token_ids=[tokenizer.eos_token_id])
            session = EpisodeSession(model, tokenizer, defaults, CONTEXT, "rlsys")
            key = ENDPOINT.open(session)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ENDPOINT.app), base_url="http://e/v1",
                                         headers={"Authorization": f"Bearer {key}"}) as http:
                result = await calls(http)
            ENDPOINT.close(key)
        serving.cancel()
        return result, asked, session.conversation

    return asyncio.run(main())


def test_a_call_that_adds_tools_is_rendered_with_them_not_appended_to_a_sample_without_them():
    """A template renders the tools ahead of the messages: a call that sends tools the earlier calls did not (an agent
    that offers a tool from its second step) is rendered whole, with them, and the split counted; appended to the
    earlier sample, the model never saw the tools it was asked to call."""
    from rlsys.model.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% if tools %}<|system|>tools: {{ tools|length }}<|end|>{% endif %}" + CHAT_TEMPLATE

    async def calls(http):
        history = [{"role": "user", "content": "12+34="}]
        first = await http.post("/chat/completions", json={"messages": history})
        history += [first.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
        for _ in range(2):  # the second time with the same tools: continued
            reply = await http.post("/chat/completions", json={"messages": history, "tools": TOOLS})
            history += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]

    _, asked, conversation = scripted_calls(tokenizer, ["46", "57", "68"], calls)
    assert asked[1] == ids(tokenizer, "<|system|>tools: 1<|end|><|user|>12+34=<|end|><|assistant|>46<|end|>"
                                      "<|user|>again<|end|><|assistant|>")
    assert asked[2] == asked[1] + ids(tokenizer, "57") + [tokenizer.eos_token_id] + \
        ids(tokenizer, "<|user|>more<|end|><|assistant|>")
    assert conversation.history_splits == 1


def test_logprobs_list_each_token_as_its_text_for_a_byte_level_vocabulary():
    """GPT-2's, Llama 3's and Qwen's vocabularies hold bytes as stand-in characters (a space is "Ġ"): each token in
    `logprobs` is its text, as OpenAI lists it (and a chat choice's `bytes` that text's UTF-8); they were the
    vocabulary's stand-ins."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["hello world, café " * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")

    async def calls(http):
        chosen = await http.post("/completions", json={"prompt": "hello", "logprobs": 0})
        return chosen.json()["choices"][0]["logprobs"]

    logprobs, _, _ = scripted_calls(tokenizer, [" world café"], calls)
    assert "".join(logprobs["tokens"]) == " world café<eos>"


@pytest.mark.parametrize("sent_back, continued", [("Observation: 4\nThought:", True), ("\nObservation: 4", False)],
                         ids=["the-stop-string", "other-text"])
def test_a_completion_cut_at_a_stop_string_is_continued_from_the_text_its_ids_hold(tokenizer, sent_back, continued):
    """ReAct over /v1/completions: the reply is cut at "Observation:" and returned without it; the client sends the
    stop string back with the tool's result. The model must see it once (its own ids already hold it: it was seen
    twice), and a client that sends other text in its place starts a new sample from its own text."""
    prompt = "Q: 2+2?\nThought:"

    async def calls(http):
        first = await http.post("/completions", json={"prompt": prompt, "stop": ["Observation:"]})
        text = first.json()["choices"][0]["text"]
        assert text == " calc "
        await http.post("/completions", json={"prompt": prompt + text + sent_back, "stop": ["Observation:"]})

    _, asked, conversation = scripted_calls(tokenizer, [" calc Observation: junk", " done"], calls)
    if continued:
        assert asked[1] == asked[0] + ids(tokenizer, " calc Observation:") + ids(tokenizer, " 4\nThought:")
    else:
        assert asked[1] == ids(tokenizer, prompt + " calc " + sent_back)
    assert conversation.history_splits == int(not continued)


def test_a_completion_that_ended_with_eos_is_continued_once_past_it(tokenizer):
    """A client that writes its chat template itself sends the model's end of turn back after its reply: the eos the
    model generated is not appended a second time."""
    first_prompt = "<|user|>12+34=<|end|><|assistant|>"

    async def calls(http):
        first = await http.post("/completions", json={"prompt": first_prompt})
        text = first.json()["choices"][0]["text"]
        then = first_prompt + text + "<|end|><|user|>again<|end|><|assistant|>"
        await http.post("/completions", json={"prompt": then})

    _, asked, conversation = scripted_calls(tokenizer, ["46", "57"], calls)
    assert asked[1] == asked[0] + ids(tokenizer, "46") + [tokenizer.eos_token_id] + \
        ids(tokenizer, "<|user|>again<|end|><|assistant|>")
    assert conversation.history_splits == 0


def test_a_refused_call_is_no_history_split():
    """A call that continues no sample but is refused (its prompt past the context, a 400) produced no tokens: no
    sample holds it, so the episode was not split; it was counted one, for chat and for completions alike."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()

    async def calls(http):
        await http.post("/chat/completions", json={"messages": [{"role": "user", "content": "12+34="}]})
        await http.post("/completions", json={"prompt": "12+34="})
        for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "x" * (CONTEXT + 1)}]}),
                           ("/completions", {"prompt": "x" * (CONTEXT + 1)})):
            refused = await http.post(path, json=body)
            assert refused.status_code == 400 and "context" in refused.text, refused.text

    _, asked, conversation = scripted_calls(tokenizer, ["46", "46"], calls)
    assert len(asked) == 2 and conversation.history_splits == 1  # the completion beside the chat sample


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_generation_the_engine_aborted_or_failed_is_a_server_error_and_not_recorded(reason):
    """vLLM's reasons "abort" and "error" end a generation that is no answer: every path answers 500 naming the reason
    (as vLLM's own server answers "error"; the `openai` client sends such a call again), and no sample holds it. It was
    answered as a finished reply ("stop", "end_turn") and trained as one."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    user = [{"role": "user", "content": "12+34="}]

    async def calls(http):
        return [await http.post(path, json=body) for path, body in (
            ("/chat/completions", {"messages": user}), ("/completions", {"prompt": "12+34="}),
            ("/responses", {"input": "12+34="}), ("/messages", {"messages": user, "max_tokens": 8}))]

    answers, asked, conversation = scripted_calls(tokenizer, ["46"] * 4, calls, stop_reason=reason)
    assert len(asked) == 4 and [a.status_code for a in answers] == [500] * 4
    assert all(f"ended with {reason!r}" in a.text for a in answers), [a.text for a in answers]
    assert answers[0].json()["error"]["type"] == "server_error" and answers[3].json()["error"]["type"] == "api_error"
    assert conversation.samples == [] and conversation.calls == 0

# A template that knows system, user and assistant only, and refuses any other role (as Qwen3.5's does).
STRICT_ROLES = ("{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('Unexpected message role.') }}{% endif %}<|{{ message['role'] }}|>"
                "{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template", ["char", "strict"])
def test_a_developer_message_is_a_system_message_to_a_template_without_that_role(template):
    """OpenAI's clients send `developer` (its newer name for the system role) for newer models: a template with no
    developer role renders it as system, as vLLM does, on the first call and on one that continues a sample. It was
    rendered as a role the model never saw ("<|developer|>" as plain characters) or refused by the template (a 400)."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if template == "strict":
        tokenizer.chat_template = STRICT_ROLES

    async def calls(http):
        history = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "12+34="}]
        first = await http.post("/chat/completions", json={"messages": history})
        assert first.status_code == 200, first.text
        history += [first.json()["choices"][0]["message"], {"role": "developer", "content": "Again."}]
        second = await http.post("/chat/completions", json={"messages": history})
        assert second.status_code == 200, second.text

    _, asked, conversation = scripted_calls(tokenizer, ["46", "46"], calls)
    assert asked[0] == ids(tokenizer, "<|system|>Be brief.<|end|><|user|>12+34=<|end|><|assistant|>")
    assert asked[1] == asked[0] + ids(tokenizer, "46") + [tokenizer.eos_token_id] + \
        ids(tokenizer, "<|system|>Again.<|end|><|assistant|>")
    assert conversation.history_splits == 0


# A template that wants the system message first and refuses one anywhere else (Qwen3's `loop.first` guard)
SYSTEM_FIRST = ("{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{% endif %}<|{{ message['role'] }}|>"
                "{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_system_message_after_the_first_turn_is_never_moved_so_a_system_first_template_refuses_it(role):
    """vLLM 0.32's chat path moves system messages only where a developer message is sent to a template without that
    role: every system message then becomes one, first (vllm/renderers/hf.py, _consolidate_system_messages). Its
    /v1/messages path does the same to a system turn where the template refuses one after the first. rlsys moves
    none: the later message's text, merged into the first, would change the ids the model saw on the calls before,
    and the call would no longer continue them. The template's refusal is answered (400) naming it, and the ids of
    the call before stay recorded as the model saw them."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = SYSTEM_FIRST

    async def calls(http):
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]
        first = await http.post("/chat/completions", json={"messages": history})
        assert first.status_code == 200, first.text
        history += [first.json()["choices"][0]["message"], {"role": role, "content": "Again."},
                    {"role": "user", "content": "56+1="}]
        return await http.post("/chat/completions", json={"messages": history})

    refused, asked, conversation = scripted_calls(tokenizer, ["46", "57"], calls)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == \
        "the model's chat template refused these messages: System message must be at the beginning."
    assert asked == [ids(tokenizer, "<|system|>Be brief.<|end|><|user|>12+34=<|end|><|assistant|>")]
    (sample,) = conversation.samples
    assert sample.transcript.token_ids == asked[0] + ids(tokenizer, "46") + [tokenizer.eos_token_id]


def test_a_template_with_a_developer_role_gets_it_as_sent():
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = STRICT_ROLES.replace("'system', ", "'system', 'developer', ")

    async def calls(http):
        await http.post("/chat/completions", json={"messages": [{"role": "developer", "content": "Be brief."},
                                                                  {"role": "user", "content": "12+34="}]})

    _, asked, _ = scripted_calls(tokenizer, ["46"], calls)
    assert asked[0] == ids(tokenizer, "<|developer|>Be brief.<|end|><|user|>12+34=<|end|><|assistant|>")


# ---- what a client may send: answered, or refused with 4xx naming the field and why; never a 500

ENDPOINT = Endpoint()
CONTEXT = 512  # the sessions' max_total_tokens
CHAT = {"model": "rlsys", "messages": [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": [{"type": "text", "text": "12+34="}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "46"}],
    "tools": TOOLS, "n": 2, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n\n"],
    "logprobs": True, "return_token_ids": True, "user": "anyone"}
COMPLETION = {"model": "rlsys", "prompt": ["12+34="], "max_tokens": 4, "n": 1, "logprobs": 0, "stop": "\n"}
CHAT_PATHS = [(k,) for k in CHAT] + [
    ("max_completion_tokens",), ("stream",), ("stream_options",), ("messages", 1), ("messages", 1, "role"),
    ("messages", 1, "content"), ("messages", 1, "content", 0), ("messages", 2, "tool_calls"),
    ("messages", 2, "tool_calls", 0, "function"),
    ("messages", 3, "tool_call_id"), ("tools", 0), ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "parameters", "required"), ("stop", 0)]
COMPLETION_PATHS = [(k,) for k in COMPLETION] + [("prompt", 0)]
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                                     st.sampled_from(["\ud800", "\x00", "é", ""])),  # a lone surrogate: valid JSON
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
PROPERTIES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def post(tokenizer, path: str, body, max_new_tokens: int = 8) -> tuple[httpx.Response, list[dict]]:
    """`body` (bytes, or a value sent as JSON) posted with a fresh episode's key (its agent's default budget
    `max_new_tokens`); the response, and the requests that reached the model, each as the router checked it on its
    way to an inference worker."""
    async def main():
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        router, asked = EpisodeRouter(InProcessBus(), "replies", n_inference_workers=1), []
        reply = ids(tokenizer, "46") + [tokenizer.eos_token_id]

        async def engine():
            while True:
                qid, message = router.checked_request(await obs_queue.get())  # raises on what a worker refuses
                asked.append(message)
                n = message["gconfig"]["n"]
                logprobs, versions = [[LOGPROB] * len(reply)] * n, [[0] * len(reply)] * n
                act_queue.put_nowait(GenerationOutput(qid, message["token_ids"], [reply] * n, logprobs, versions,
                                                      ["stop"] * n))

        serving = asyncio.create_task(engine())
        async with Model(obs_queue, act_queue) as model:
            defaults = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
            key = ENDPOINT.open(EpisodeSession(model, tokenizer, defaults, CONTEXT, "rlsys"))
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ENDPOINT.app),
                                             base_url="http://endpoint/v1") as http:
                    response = await asyncio.wait_for(http.post(path, content=content, headers={
                        "Authorization": f"Bearer {key}", "Content-Type": "application/json"}), 30)
            finally:
                ENDPOINT.close(key)
                serving.cancel()
        return response, asked

    return asyncio.run(main())


def refusal(response: httpx.Response) -> dict:
    """OpenAI's error body of a 4xx, checked for its shape."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_valid_chat_and_completion_bodies_are_answered_as_asked(tokenizer):
    response, (asked,) = post(tokenizer, "/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    assert [c["message"]["content"] for c in response.json()["choices"]] == ["46", "46"]
    assert asked["gconfig"] == {"n": 2, "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3,
                                "stop_token_ids": asked["gconfig"]["stop_token_ids"]}
    response, _ = post(tokenizer, "/completions", COMPLETION)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "46"


def test_settings_sent_at_their_neutral_value_are_answered_and_top_k_reaches_the_model(tokenizer):
    """Clients send penalties at 0, tool_choice "auto" and the like by default: those are answered as asked."""
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "min_p": 0,
               "top_logprobs": 0, "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "auto",
               "parallel_tool_calls": True, "functions": None, "function_call": "auto"}
    response, (asked,) = post(tokenizer, "/chat/completions", {**CHAT, **neutral, "top_k": 5})
    assert response.status_code == 200, response.text
    assert asked["gconfig"]["top_k"] == 5
    response, _ = post(tokenizer, "/completions", {**COMPLETION, "echo": False, "suffix": None, "best_of": 1})
    assert response.status_code == 200, response.text
    no_tools = {k: v for k, v in CHAT.items() if k != "tools"}
    response, _ = post(tokenizer, "/chat/completions", {**no_tools, "tool_choice": "none"})
    assert response.status_code == 200, response.text


def test_a_model_without_a_chat_template_refuses_chat_calls_saying_so_and_serves_completions():
    from rlsys.model.tokenizer import build_char_tokenizer

    base = build_char_tokenizer()
    base.chat_template = None
    chat, asked = post(base, "/chat/completions", CHAT)
    assert chat.status_code == 404 and "/v1/completions" in chat.json()["error"]["message"] and asked == []
    completion, _ = post(base, "/completions", COMPLETION)
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "46"


HOSTILE = {  # name -> (path, body, status, param)
    "negative max_tokens": ("/chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens"),
    "a million samples": ("/chat/completions", {**CHAT, "n": 1_000_000}, 400, "n"),
    "n=true": ("/chat/completions", {**CHAT, "n": True}, 400, "n"),
    "temperature hot": ("/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    "negative temperature": ("/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    "NaN temperature": ("/chat/completions", {**CHAT, "temperature": math.nan}, 400, "temperature"),
    "top_p 7": ("/chat/completions", {**CHAT, "top_p": 7}, 400, "top_p"),
    "top_p 0": ("/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    "seed 2**70": ("/chat/completions", {**CHAT, "seed": 2**70}, 400, "seed"),
    "seed 2**64": ("/completions", {**COMPLETION, "seed": 2**64}, 400, "seed"),
    "max_tokens abc": ("/chat/completions", {**CHAT, "max_tokens": "abc"}, 400, "max_tokens"),
    "max_tokens 1e400": ("/completions", json.dumps({**COMPLETION, "max_tokens": 42}).replace("42", "1e400").encode(),
                         400, "max_tokens"),
    "max_tokens NaN": ("/completions", {**COMPLETION, "max_tokens": math.nan}, 400, "max_tokens"),
    "max_tokens past the context": ("/chat/completions", {**CHAT, "max_tokens": CONTEXT + 1}, 400, "max_tokens"),
    "stop 5": ("/chat/completions", {**CHAT, "stop": 5}, 400, "stop"),
    "stop [1, 2]": ("/completions", {**COMPLETION, "stop": [1, 2]}, 400, "stop"),
    "20,000 stop strings": ("/chat/completions", {**CHAT, "stop": ["x"] * 20_000}, 400, "stop"),
    "tools [1]": ("/chat/completions", {**CHAT, "tools": [1]}, 400, "tools[0]"),
    "a dict as content": ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": {"a": 1}}]}, 400,
                          "messages[0].content"),
    "an unknown role": ("/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
                        "messages[0].role"),
    "prompt ids past the vocabulary": ("/completions", {**COMPLETION, "prompt": [5, 10**9]}, 400, "prompt"),
    "an empty prompt": ("/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    "logprobs 99": ("/completions", {**COMPLETION, "logprobs": 99}, 400, "logprobs"),
    # Settings no engine here applies: sampled as if unset, and trained on as such.
    "logprobs 2 (alternatives)": ("/completions", {**COMPLETION, "logprobs": 2}, 400, "logprobs"),
    "top_logprobs 3": ("/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    "presence_penalty 1": ("/chat/completions", {**CHAT, "presence_penalty": 1.0}, 400, "presence_penalty"),
    "frequency_penalty 0.5": ("/completions", {**COMPLETION, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    "repetition_penalty 1.2": ("/chat/completions", {**CHAT, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    "min_p 0.1": ("/chat/completions", {**CHAT, "min_p": 0.1}, 400, "min_p"),
    "a logit bias": ("/chat/completions", {**CHAT, "logit_bias": {"5": 100}}, 400, "logit_bias"),
    "a JSON reply": ("/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
                     "response_format"),
    "a forced tool call": ("/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    "a named tool call": ("/chat/completions", {**CHAT, "tool_choice": {"type": "function",
                                                                        "function": {"name": "calculator"}}},
                          400, "tool_choice"),
    "no tool call with tools": ("/chat/completions", {**CHAT, "tool_choice": "none"}, 400, "tool_choice"),
    "one tool call a turn": ("/chat/completions", {**CHAT, "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    "legacy functions": ("/chat/completions", {**CHAT, "functions": [TOOLS[0]["function"]]}, 400, "functions"),
    "a legacy forced call": ("/chat/completions", {**CHAT, "function_call": {"name": "calculator"}}, 400,
                             "function_call"),
    "an image": ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    ]}]}, 400, "messages[0].content[1]"),
    "the prompt echoed": ("/completions", {**COMPLETION, "echo": True}, 400, "echo"),
    "a suffix": ("/completions", {**COMPLETION, "suffix": " = 46"}, 400, "suffix"),
    "best of 3": ("/completions", {**COMPLETION, "best_of": 3}, 400, "best_of"),
    "JSON 100,000 deep": ("/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    "JSON 100 deep": ("/chat/completions", {**CHAT, "metadata": functools.reduce(lambda x, _: [x], range(100), 0)},
                      400, None),
    "not JSON": ("/chat/completions", b"{'messages': ", 400, None),
    "a lone surrogate": ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, 400, None),
    "10 MB": ("/chat/completions", {**CHAT, "user": "x" * 10 * 2**20}, 413, None),
}


def test_a_path_or_method_not_served_is_refused_in_openais_error_shape(tokenizer):
    """The `openai` client reads the error from OpenAI's shape; FastAPI's {"detail": "Not Found"} said nothing of
    what is served (a client cancelling a stored response, say: nothing is stored)."""
    response, asked = post(tokenizer, "/responses/resp_1/cancel", {})
    assert response.status_code == 404 and "POST /v1/responses" in refusal(response)["message"] and asked == []

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ENDPOINT.app), base_url="http://e/v1") as http:
            return await http.get("/chat/completions")

    response = asyncio.run(get())
    assert response.status_code == 405 and "POST /v1/chat/completions" in refusal(response)["message"]
    assert response.headers["allow"] == "POST"


def test_a_client_that_disconnects_while_sending_its_body_leaves_no_traceback_in_the_log(tokenizer):
    """A client gone mid-body is answered to nobody; Starlette's ClientDisconnect was logged as an ASGI application's
    exception, with its traceback, once per such client."""
    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        errors = []
        handler = logging.Handler(logging.ERROR)
        handler.emit = errors.append
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            async with Model(asyncio.Queue(), asyncio.Queue()) as model:
                key = endpoint.open(EpisodeSession(model, tokenizer, GenerationConfig(max_new_tokens=4), 64, "rlsys"))
                _, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nAuthorization: Bearer " + key.encode() +
                             b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
                await writer.drain()
                await asyncio.sleep(0.3)
                writer.close()
                await asyncio.sleep(0.5)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
            endpoint.task.cancel()
        return errors

    assert asyncio.run(main()) == []


@pytest.mark.parametrize("arguments", ['{"expression": ' + "1" * 5000 + "}", "[" * 10_000],
                         ids=["a-5000-digit-number", "10000-deep"])
def test_tool_call_arguments_json_cannot_read_are_taken_as_text(tokenizer, arguments):
    """A client's earlier tool call whose arguments string Python's JSON reader refuses (an integer past 4,300
    digits, nesting past its recursion limit) is compared and rendered as the text it is, not a server error: here
    its thousands of characters are more tokens than the context holds, and the call is refused saying so."""
    messages = [dict(m) for m in CHAT["messages"]]
    messages[2] = {**messages[2], "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "calculator", "arguments": arguments}}]}
    response, asked = post(tokenizer, "/chat/completions", {**CHAT, "messages": messages})
    assert refusal(response)["code"] == "context_length_exceeded" and asked == []


RESPONSES_CALL = {"model": "rlsys", "input": "12+34="}
BUDGETS = {  # path -> (body, the field that asks the reply's budget)
    "/chat/completions": (CHAT, "max_tokens"),
    "/chat/completions (max_completion_tokens)": (CHAT, "max_completion_tokens"),
    "/completions": (COMPLETION, "max_tokens"),
    "/responses": (RESPONSES_CALL, "max_output_tokens"),
}


@pytest.mark.parametrize("name", BUDGETS)
def test_a_budget_past_the_context_is_refused_in_the_words_of_vllms_openai_server(tokenizer, name):
    """What vLLM's OpenAI server answers (its TokenizeParams check), not the refusal /v1/messages words in Anthropic's
    terms."""
    body, param = BUDGETS[name]
    response, asked = post(tokenizer, name.split()[0], {**body, param: CONTEXT + 1})
    assert response.status_code == 400 and refusal(response) == vllm_refusal(
        f"{param}={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}. Please request fewer output tokens.",
        param, CONTEXT + 1) and asked == []


def vllm_refusal(message: str, param: str, value: int, code: str | int = 400) -> dict:
    """The error vLLM 0.32's OpenAI server answers a request its checks refuse (a VLLMValidationError, as its
    create_error_response words it; `code` where the endpoint gives OpenAI's instead of the status)."""
    return {"message": f"{message} (parameter={param}, value={value})", "type": "BadRequestError", "param": param,
            "code": code}


def responses_overflow(length: int) -> dict:
    """The body for an input of `length` tokens past the context on /v1/responses: OpenAI's Responses API's, its
    sentence followed by OpenAI's chat one (which LangChain's ChatOpenAI reads from a 400)."""
    return {"message": f"Your input exceeds the context window of this model. Input tokens exceed the configured limit "
                       f"of {CONTEXT} tokens. Your input resulted in {length} tokens. Please adjust your input and try "
                       f"again.", "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}


LONG_PROMPTS = {  # path -> a body whose prompt is `CONTEXT + 1` characters (a token each) past a short one's
    "/chat/completions": {**CHAT, "messages": [{"role": "user", "content": "1" * (CONTEXT + 2)}]},
    "/completions": {**COMPLETION, "prompt": "1" * (CONTEXT + 2)},
    "/responses": {**RESPONSES_CALL, "input": "1" * (CONTEXT + 2)},
}


@pytest.mark.parametrize("path", LONG_PROMPTS)
def test_a_prompt_past_the_context_is_refused_as_openai_or_vllms_openai_server_refuses_it(tokenizer, path):
    """On /v1/chat/completions with the body OpenAI's API sends for its current models (whose message LangChain's
    ChatOpenAI reads as a context overflow), on /v1/responses with the body OpenAI's Responses API sends, on
    /v1/completions in vLLM's words, status and type with OpenAI's code for it; the prompt's length its own (vLLM's
    count, where it tokenizes the prompt itself, stops one past the context: "at least"), not /v1/messages' refusal in
    Anthropic's words."""
    body = LONG_PROMPTS[path]
    short = {**body, **({"prompt": "1"} if path == "/completions" else {"input": "1"} if path == "/responses" else
                        {"messages": [{"role": "user", "content": "1"}]})}
    _, (fits,) = post(tokenizer, path, short)
    length = len(fits["token_ids"]) + CONTEXT + 1
    response, asked = post(tokenizer, path, body)
    expected = {"message": f"Input tokens exceed the configured limit of {CONTEXT} tokens. Your messages resulted in "
                           f"{length} tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"} \
        if path == "/chat/completions" else responses_overflow(length) if path == "/responses" else vllm_refusal(
            f"This model's maximum context length is {CONTEXT} tokens. However, your prompt contains {length} input "
            f"tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
            f"prompt.", "input_tokens", length, "context_length_exceeded")
    assert response.status_code == 400 and refusal(response) == expected and asked == []


@pytest.mark.parametrize("budget", [{}, {"max_tokens": 4}], ids=["the agent's default", "max_tokens"])
def test_a_prompt_that_fills_the_context_is_refused_as_vllm_refuses_the_budget_of_0_it_leaves(tokenizer, budget):
    """vLLM admits a prompt of the whole context, cuts the reply's budget to the 0 tokens it leaves, and refuses that
    budget; so does the endpoint, rather than send the model a request it sets aside."""
    body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
    response, asked = post(tokenizer, "/completions", {**body, **budget, "prompt": ids(tokenizer, "1") * CONTEXT})
    assert response.status_code == 400 and refusal(response) == vllm_refusal(
        "max_tokens must be at least 1, got 0.", "max_tokens", 0) and asked == []
    response, (asked,) = post(tokenizer, "/completions", {**body, **budget,
                                                          "prompt": ids(tokenizer, "1") * (CONTEXT - 1)})
    assert response.status_code == 200 and asked["gconfig"]["max_new_tokens"] == 1, response.text


@pytest.mark.parametrize("path, body", [("/chat/completions", {k: v for k, v in CHAT.items() if k != "max_tokens"}),
                                        ("/completions", {k: v for k, v in COMPLETION.items() if k != "max_tokens"}),
                                        ("/responses", RESPONSES_CALL)], ids=["chat", "completions", "responses"])
def test_an_agents_default_budget_past_the_context_is_cut_to_what_the_prompt_leaves_not_refused(tokenizer, path, body):
    """A call that sets no budget asked for none past the context: it gets the agent's default, cut to what the
    prompt leaves (as vLLM cuts its own default), and no refusal naming a field the call did not send."""
    response, (asked,) = post(tokenizer, path, body, max_new_tokens=CONTEXT + 100)
    assert response.status_code == 200, response.text
    assert asked["gconfig"]["max_new_tokens"] == CONTEXT - len(asked["token_ids"])


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_request_is_refused_naming_its_field_and_never_reaches_the_model(tokenizer, name):
    path, body, status, param = HOSTILE[name]
    response, asked = post(tokenizer, path, body)
    error = refusal(response)
    assert response.status_code == status and error["param"] == param and asked == []
    if param is not None:
        assert error["message"].startswith(param)  # names the field, then says what is wrong


@PROPERTIES
@given(path=st.sampled_from(["/chat/completions", "/completions"]), body=json_values)
def test_any_json_body_is_answered_or_refused_never_a_server_error(tokenizer, path, body):
    response, _ = post(tokenizer, path, body)
    if response.status_code != 200:
        refusal(response)


@PROPERTIES
@given(endpoint=st.sampled_from([("/chat/completions", CHAT, CHAT_PATHS), ("/completions", COMPLETION,
                                                                          COMPLETION_PATHS)])
       .flatmap(lambda e: st.tuples(st.just(e[0]), st.just(e[1]), st.sampled_from(e[2]))), value=json_values)
def test_a_valid_body_with_one_field_replaced_is_answered_or_refused_naming_that_field(tokenizer, endpoint, value):
    path, body, field = endpoint
    response, asked = post(tokenizer, path, with_field(body, field, value))
    if response.status_code == 200:
        assert len(asked) == 1
        return
    error = refusal(response)
    assert response.status_code == 400 and asked == [], error
    if error["param"] is None:  # refused as a whole: a string no tokenizer takes may sit in any field
        assert "not valid Unicode" in error["message"]
    else:
        named = "max_" if field[0] in ("max_tokens", "max_completion_tokens") else field[0]  # either names the budget
        assert error["param"].startswith(named), error


@PROPERTIES
@given(n=st.integers(1, 4), temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True),
       seed=st.none() | st.integers(0, 2**63 - 1), max_tokens=st.integers(1, CONTEXT),
       stop=st.lists(st.text(max_size=8), max_size=16))
def test_any_settings_within_the_bounds_are_answered_and_reach_the_model_as_asked(tokenizer, n, temperature, top_p,
                                                                                    seed, max_tokens, stop):
    body = {**CHAT, "n": n, "temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens,
            "stop": stop}
    response, (asked,) = post(tokenizer, "/chat/completions", body)
    assert response.status_code == 200 and len(response.json()["choices"]) == n
    gconfig = asked["gconfig"]
    assert (gconfig["n"], gconfig["temperature"], gconfig["top_p"]) == (n, temperature, top_p)
    assert gconfig["seed"] == seed and gconfig["max_new_tokens"] == min(max_tokens, CONTEXT - len(asked["token_ids"]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet="ab\n.", max_size=40), min_size=1, max_size=3),
       stops=st.lists(st.text(alphabet="ab\n.", min_size=1, max_size=3), max_size=3))
def test_each_sample_is_cut_after_the_first_token_that_completes_a_stop_string(tokenizer, texts, stops):
    """As a scan of every prefix cuts it (the oracle here), in a few decodes a sample instead of one per token."""
    samples = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    output = GenerationOutput("q", [1], samples, [[-0.5] * len(s) for s in samples], [[3] * len(s) for s in samples],
                              ["length"] * len(samples))
    cut = _cut_at_stop_strings(output, stops, tokenizer)
    for sample, kept, reason, logprobs, versions in zip(samples, cut.output_ids, cut.stop_reasons, cut.logprobs,
                                                        cut.versions):
        first = next((k for k in range(1, len(sample) + 1)
                      if any(s in tokenizer.decode(sample[:k], skip_special_tokens=True) for s in stops)), None)
        assert kept == sample[:first] if first else kept == sample
        assert reason == ("stop" if first else "length")
        assert logprobs == [-0.5] * len(kept) and versions == [3] * len(kept)
    assert output.output_ids == samples  # the output it was given is left as it was
