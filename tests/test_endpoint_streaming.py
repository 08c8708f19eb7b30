"""`"stream": true` on the OpenAI-compatible endpoint: Server-Sent Events as OpenAI sends them, read by the real
`openai` client (and LangGraph) from the real server, and a training record identical to the unstreamed call's."""

import asyncio
import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from rlsys.api import GenerationConfig, GenerationOutput, Model
from rlsys.endpoint.server import Endpoint
from rlsys.endpoint.session import EpisodeSession
from tests.endpoint_clients import RESPONSES, TOOLS
from tests.scripted import ids
from tests.test_openai_endpoint import CALL, LOGPROB, run_episode, tool_then_answer

CONTEXT = 512
USER = [{"role": "user", "content": "What is 12*34+1?"}]


def served(tokenizer, replies: list[list[str]], calls):
    """`calls(client, http)` against a real server on a fresh episode's key, with the real `openai` client and a raw
    httpx client; the model answers each request with the next of `replies` (a text per choice, then eos). What
    `calls` returned, and the episode's session. A request past the script is never answered: `calls` times out."""
    async def main():
        endpoint = Endpoint()
        await endpoint.start()
        obs_queue, act_queue, script = asyncio.Queue(), asyncio.Queue(), iter(replies)

        async def engine():
            while True:
                qid, token_ids, gconfig = await obs_queue.get()
                texts = next(script)
                assert len(texts) == gconfig.n
                out = [ids(tokenizer, text) + [tokenizer.eos_token_id] for text in texts]
                act_queue.put_nowait(GenerationOutput(qid, token_ids, out, [[LOGPROB] * len(o) for o in out],
                                                      [[0] * len(o) for o in out], ["stop"] * len(out)))

        serving = asyncio.create_task(engine())
        try:
            async with Model(obs_queue, act_queue) as model:
                defaults = GenerationConfig(max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id])
                session = EpisodeSession(model, tokenizer, defaults, CONTEXT, "rlsys")
                key = endpoint.open(session)
                client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
                async with httpx.AsyncClient(base_url=endpoint.base_url,
                                             headers={"Authorization": f"Bearer {key}"}) as http:
                    result = await asyncio.wait_for(calls(client, http), 30)  # a call past the script hangs
                endpoint.close(key)
        finally:
            serving.cancel()
            endpoint.task.cancel()
        return result, session

    return asyncio.run(main())


async def chunks_of(stream) -> list:
    return [chunk async for chunk in stream]


def reassembled(chunks, tools=()):
    state = ChatCompletionStreamState(input_tools=list(tools))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()


def events(response: httpx.Response) -> list:
    """The JSON of each event of a raw SSE body, checked for OpenAI's framing; the last event is [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    parts = body.split("\n\n")
    assert parts[-1] == "" and parts[-2] == "data: [DONE]" and all(p.startswith("data: {") for p in parts[:-2])
    return [json.loads(p[len("data: "):]) for p in parts[:-2]]


def test_a_streamed_text_reply_is_the_unstreamed_reply_in_openais_chunks(tokenizer):
    async def calls(client, http):
        plain = await client.chat.completions.create(model="rlsys", messages=USER, logprobs=True)
        streamed = await chunks_of(await client.chat.completions.create(model="rlsys", messages=USER, logprobs=True,
                                                                        stream=True))
        raw = await http.post("/chat/completions", json={"model": "rlsys", "messages": USER, "stream": True})
        return plain, streamed, raw

    (plain, streamed, raw), _ = served(tokenizer, [["46"], ["46"], ["46"]], calls)
    assert {(c.id, c.created, c.model, c.object) for c in streamed} == {
        (streamed[0].id, streamed[0].created, "rlsys", "chat.completion.chunk")}
    first, *middle, last = [c.choices[0] for c in streamed]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    assert "".join(c.delta.content or "" for c in middle) == plain.choices[0].message.content == "46"
    assert last.finish_reason == "stop" and last.delta.content is None and last.delta.tool_calls is None
    logprobs = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert logprobs == plain.choices[0].logprobs.content and len(logprobs) == 3  # "46" and eos
    assert all(c.usage is None for c in streamed)
    whole = reassembled(streamed)
    assert whole.choices[0].message.content == "46" and whole.choices[0].finish_reason == "stop"
    # On the wire: text/event-stream, `data: <json>` events, [DONE] last; no usage key unless asked.
    for event in events(raw):
        assert event["object"] == "chat.completion.chunk" and "usage" not in event
        assert [c["index"] for c in event["choices"]] == [0]


def test_a_streamed_tool_call_reassembles_to_the_unstreamed_reply(tokenizer):
    async def calls(client, http):
        plain = await client.chat.completions.create(model="rlsys", messages=USER, tools=TOOLS, logprobs=True)
        streamed = await chunks_of(await client.chat.completions.create(model="rlsys", messages=USER, tools=TOOLS,
                                                                        logprobs=True, stream=True))
        return plain, streamed

    (plain, streamed), _ = served(tokenizer, [[CALL], [CALL]], calls)
    [delta] = [c.choices[0].delta for c in streamed if c.choices[0].delta.tool_calls]
    [call] = delta.tool_calls
    assert (call.index, call.type, call.id.startswith("call_")) == (0, "function", True)
    whole = reassembled(streamed, TOOLS).choices[0]
    expected = plain.choices[0]
    assert whole.finish_reason == expected.finish_reason == "tool_calls"
    # ids are drawn per call; the client's reassembly adds its own fields (the chunk's index, parsed arguments)
    called = lambda calls: [(c.type, c.function.name, c.function.arguments) for c in calls]  # noqa: E731
    assert called(whole.message.tool_calls) == called(expected.message.tool_calls)
    assert json.loads(whole.message.tool_calls[0].function.arguments) == {"expression": "12*34+1"}
    assert not whole.message.content and expected.message.content is None
    assert whole.logprobs.content == expected.logprobs.content and len(expected.logprobs.content) == len(
        ids(tokenizer, CALL)) + 1


def test_n_choices_each_name_their_index_and_usage_comes_last_when_asked(tokenizer):
    async def calls(client, http):
        plain = await client.chat.completions.create(model="rlsys", messages=USER, n=2)
        streamed = await chunks_of(await client.chat.completions.create(
            model="rlsys", messages=USER, n=2, stream=True, stream_options={"include_usage": True}))
        return plain, streamed

    (plain, streamed), _ = served(tokenizer, [["46", "57"], ["46", "57"]], calls)
    *choices, usage = streamed
    assert usage.choices == [] and usage.usage == plain.usage and plain.usage.completion_tokens == 6
    assert all(len(c.choices) == 1 and c.usage is None for c in choices)
    for index, text in enumerate(["46", "57"]):
        own = [c.choices[0] for c in choices if c.choices[0].index == index]
        assert own[0].delta.role == "assistant" and own[-1].finish_reason == "stop"
        assert "".join(c.delta.content or "" for c in own) == text
    whole = reassembled(streamed)
    assert [c.message.content for c in whole.choices] == [c.message.content for c in plain.choices] == ["46", "57"]


def test_a_streamed_completion_is_the_unstreamed_one_in_text_completion_chunks(tokenizer):
    async def calls(client, http):
        plain = await client.completions.create(model="rlsys", prompt="12+34=", logprobs=0)
        streamed = await chunks_of(await client.completions.create(
            model="rlsys", prompt="12+34=", logprobs=0, stream=True, stream_options={"include_usage": True}))
        raw = await http.post("/completions", json={"prompt": "12+34=", "stream": True, "n": 2,
                                                    "return_token_ids": True})
        return plain, streamed, raw

    (plain, streamed, raw), session = served(tokenizer, [["46"], ["46"], ["46", "57"]], calls)
    *texts, usage = streamed
    assert all(c.object == "text_completion" and c.id == streamed[0].id for c in streamed)
    assert "".join(c.choices[0].text for c in texts) == plain.choices[0].text == "46"
    assert texts[-1].choices[0].finish_reason == "stop"
    assert [t for c in texts if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        plain.choices[0].logprobs.token_logprobs
    assert usage.choices == [] and usage.usage == plain.usage
    chunks = events(raw)
    assert chunks[0]["prompt_token_ids"] == session.outputs[-1].prompt_ids
    assert {c["choices"][0]["index"]: (c["choices"][0]["text"], c["choices"][0]["token_ids"]) for c in chunks} == {
        i: (text, ids(tokenizer, text) + [tokenizer.eos_token_id]) for i, text in enumerate(["46", "57"])}


@pytest.mark.parametrize("body, param", [
    ({"stream": True, "temperature": "hot"}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"stream": "yes"}, "stream"),
], ids=["bad-field-streamed", "options-without-stream", "options-with-stream-false", "options-not-an-object",
        "include_usage-not-a-flag", "obfuscation", "an-unknown-option", "stream-not-a-flag"])
def test_a_refused_streamed_call_is_an_http_error_in_openais_shape_not_a_stream(tokenizer, body, param):
    async def calls(client, http):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="rlsys", messages=USER, **body)
        raw = await http.post("/completions", json={"prompt": "12+34=", **body})
        return refused.value, raw

    (refused, raw), session = served(tokenizer, [], calls)
    assert refused.status_code == 400 and refused.body["param"] == param and refused.body["message"].startswith(param)
    assert raw.status_code == 400 and raw.headers["content-type"] == "application/json"
    assert raw.json()["error"]["param"] == param and session.outputs == []


def test_streamed_include_obfuscation_false_and_usage_false_are_answered(tokenizer):
    async def calls(client, http):
        return await chunks_of(await client.chat.completions.create(
            model="rlsys", messages=USER, stream=True,
            stream_options={"include_usage": False, "include_obfuscation": False}))

    streamed, _ = served(tokenizer, [["46"]], calls)
    assert reassembled(streamed).choices[0].message.content == "46" and all(c.usage is None for c in streamed)


def record(trajectories, engine) -> tuple[list[dict], list[list[int]]]:
    """The trajectories but for their ids (drawn per trajectory), and every prompt the engine was asked."""
    return [{k: v for k, v in t.to_dict().items() if k != "traj_id"} for t in trajectories], \
        [prompt for prompt, _ in engine.requests]


def test_a_streamed_tool_loop_records_the_same_trajectory_as_the_unstreamed_one(tokenizer, tokenizer_dir):
    """Through the whole loop (the openai-agent plugin, router, bus, inference worker): the same seeded calls streamed
    leave exactly the unstreamed calls' samples: ids, loss mask, logprobs, versions, turns."""
    recorded = {}
    for run in ("openai_tools_run", "openai_streaming_tools_run"):
        trajectories, engine = run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}",
                                           tool_then_answer(tokenizer))
        assert [r.choices[0].finish_reason for r in RESPONSES] == ["tool_calls", "stop"]
        assert all(gconfig.seed == 7 for _, gconfig in engine.requests)
        recorded[run] = record(trajectories, engine)
    assert recorded["openai_streaming_tools_run"] == recorded["openai_tools_run"]
    [trajectory], _ = recorded["openai_tools_run"]
    assert trajectory["reward"] == 1.0 and sum(trajectory["loss_mask"]) == len(ids(tokenizer, CALL)) + 1 + 4


def test_a_langgraph_agent_streaming_messages_records_the_same_trajectory_as_invoked(tokenizer, tokenizer_dir):
    """LangGraph's stream_mode="messages" over ChatOpenAI(streaming=True, stream_usage=True): the agent gets its tool
    call and answer, and the episode's record is the one `ainvoke` without streaming leaves."""
    pytest.importorskip("langgraph")
    recorded = []
    for run in ("rlsys.impl.agent.langgraph_example:run", "tests.endpoint_clients:langgraph_streaming_run"):
        trajectories, engine = run_episode(tokenizer, tokenizer_dir, run, tool_then_answer(tokenizer))
        recorded.append(record(trajectories, engine))
    assert recorded[1] == recorded[0]
    [trajectory], prompts = recorded[0]
    assert trajectory["reward"] == 1.0 and len(prompts) == 2
    from langchain_core.messages import AIMessageChunk

    chunks = [m for m in RESPONSES if isinstance(m, AIMessageChunk)]  # whole AIMessages, had the model not streamed
    assert "".join(m.content for m in chunks if isinstance(m.content, str)) == "409"
    assert [m.usage_metadata["output_tokens"] for m in chunks if m.usage_metadata] == [len(ids(tokenizer, CALL)) + 1, 4]
    calls = [c for m in chunks for c in m.tool_call_chunks]
    assert any(c["name"] == "calculator" and json.loads(c["args"]) == {"expression": "12*34+1"} for c in calls)



def test_a_prompt_past_the_context_is_chat_openais_context_overflow(tokenizer):
    """Refused with the body OpenAI's API sends for its current models ("Input tokens exceed the configured limit of
    <context> tokens. Your messages resulted in <prompt> tokens. ...", code "context_length_exceeded", param
    "messages"): the openai client gives the code as the error's, and LangChain's ChatOpenAI, whose check reads the
    message (openai 3.x words str(e) from the message alone), raises its context overflow (what LangChain's
    summarizing middleware acts on), not any bad request."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    async def calls(client, http):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="rlsys", max_tokens=8,
                                                 messages=[{"role": "user", "content": "1" * (CONTEXT + 1)}])
        model = ChatOpenAI(base_url=str(http.base_url), api_key=http.headers["authorization"].removeprefix("Bearer "),
                           model="rlsys", max_retries=0, max_tokens=8)
        with pytest.raises(ContextOverflowError) as overflow:
            await model.ainvoke("1" * (CONTEXT + 1))
        return refused.value, overflow.value

    (refused, overflow), session = served(tokenizer, [], calls)
    assert (refused.status_code, refused.type, refused.code, refused.param) == \
        (400, "invalid_request_error", "context_length_exceeded", "messages")
    assert refused.body["message"].startswith("Input tokens exceed the configured limit of 512 tokens. Your messages "
                                              "resulted in ") and session.outputs == []
    assert isinstance(overflow, openai.BadRequestError) and overflow.status_code == 400
