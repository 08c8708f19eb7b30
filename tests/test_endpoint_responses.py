"""OpenAI's Responses API (`POST /v1/responses`) on the endpoint: answered by the chat path, so read by the real
`openai` client (`client.responses.create`) from the real server and recorded token-exactly, a function call and
its output continuing the sample the model's own ids began; every field it does not honour refused, naming it."""

import json

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlsys.api import NOT_GENERATED
from tests.endpoint_clients import RESPONSES, RESPONSES_TOOLS, TOOLS
from tests.scripted import ids
from tests.test_endpoint_streaming import served
from tests.helpers import with_field
from tests.test_openai_endpoint import CALL, CONTEXT, LOGPROB, PROPERTIES, ROW, json_values, post, refusal, \
    responses_overflow, run_episode, tool_then_answer

INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "12+34="}]}]
BODY = {"model": "rlsys", "instructions": "Use the calculator.", "input": INPUT, "tools": RESPONSES_TOOLS,
        "max_output_tokens": 8, "temperature": 0.7, "top_p": 0.9}


def test_a_string_input_is_answered_as_a_response_and_prompted_as_the_chat_call_would_be(tokenizer):
    async def calls(client, http):
        response = await client.responses.create(model="rlsys", input="12+34=", instructions="Be brief.")
        chat = await http.post("/chat/completions", json={"model": "rlsys", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]})
        return response, chat.json()

    (response, chat), session = served(tokenizer, [["46"], ["46"]], calls)
    assert isinstance(response, openai.types.responses.Response)
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == "46" and response.incomplete_details is None
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    first, second = session.outputs
    assert first.prompt_ids == second.prompt_ids  # the chat call's prompt: instructions are its system message
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], chat["usage"]["total_tokens"])
    sample = session.conversation.samples[0]
    assert sample.transcript.token_ids == first.prompt_ids + ids(tokenizer, "46") + [tokenizer.eos_token_id]



def test_developer_input_items_are_system_messages_to_a_template_without_that_role(tokenizer):
    """The Agents SDK and Codex send instructions and `developer` input items: both reach a template that has no
    developer role as system messages, as the chat path renders them."""
    async def calls(client, http):
        await client.responses.create(model="rlsys", instructions="Be brief.", input=[
            {"role": "developer", "content": "Use digits."}, {"role": "user", "content": "12+34="}])

    _, session = served(tokenizer, [["46"]], calls)
    [output] = session.outputs
    assert output.prompt_ids == ids(tokenizer, "<|system|>Be brief.<|end|><|system|>Use digits.<|end|>"
                                               "<|user|>12+34=<|end|><|assistant|>")

@pytest.mark.parametrize("run", ["responses_tools_run", "responses_streaming_tools_run"])
def test_a_function_call_and_its_output_continue_the_recorded_sample_token_exactly(tokenizer, tokenizer_dir, run):
    """The agent's loop on the Responses API: the first response is a function_call item, parsed as chat parses
    tool calls; the second call sends the output items back with the call's output, and its prompt is the first
    call's ids, the model's own ids, then only the tool's output through the template."""
    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}",
                                       tool_then_answer(tokenizer))
    first, second = [r for r in RESPONSES if isinstance(r, openai.types.responses.Response)]
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calculator",
                                                                  {"expression": "12*34+1"})
    assert call.call_id.startswith("call_") and first.status == "completed"
    assert second.output_text == "409"
    check_tool_then_answer(tokenizer, trajectory, engine, {k: RESPONSES_TOOLS[0][k] for k in ("name", "description",
                                                                                          "parameters")})
    assert trajectory.turn_rewards == [0.0, 1.0] and trajectory.metrics["calls"] == 2


def check_tool_then_answer(tokenizer, trajectory, engine, function: dict) -> None:
    """A tool loop's two calls are one sample: the first prompted with the system prompt, the row's question and the
    tool (`function`, in chat's shape) through the template; the second with the first's ids, the model's own call and
    only the tool's result through the template; each generated id trained with its logprob and version."""
    (prompt, _), (continued, _) = engine.requests
    assert prompt == ids(tokenizer, tokenizer.apply_chat_template(
        [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": ROW["prompt"]}],
        tools=[{"type": "function", "function": function}], add_generation_prompt=True, tokenize=False))
    call_ids, answer = ids(tokenizer, CALL) + [tokenizer.eos_token_id], ids(tokenizer, "409") + [tokenizer.eos_token_id]
    assert continued == prompt + call_ids + ids(tokenizer, "<|user|><tool_response>409</tool_response><|end|>"
                                                           "<|assistant|>")
    assert trajectory.token_ids == continued + answer
    generated = [0] * len(prompt) + [1] * len(call_ids) + [0] * (len(continued) - len(prompt) - len(call_ids)) + \
        [1] * len(answer)
    assert trajectory.loss_mask == generated
    assert trajectory.logprobs == [LOGPROB if g else 0.0 for g in generated]
    assert trajectory.versions == [0 if g else NOT_GENERATED for g in generated]
    assert trajectory.reward == 1.0 and trajectory.metrics["history_splits"] == 0


def test_a_streamed_response_is_the_unstreamed_one_as_the_responses_events(tokenizer):
    async def calls(client, http):
        unstreamed = await http.post("/responses", json=BODY)
        streamed = await http.post("/responses", json={**BODY, "stream": True})
        async with client.responses.stream(**BODY) as stream:  # the client's own check
            final = await stream.get_final_response()
        return unstreamed.json(), streamed, final

    (unstreamed, streamed, final), session = served(tokenizer, [[CALL + "Done."]] * 3, calls)
    events = typed_events(streamed)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert {k: v for k, v in done.items() if k not in ("id", "created_at", "output")} == \
        {k: v for k, v in unstreamed.items() if k not in ("id", "created_at", "output")}
    assert [(i["type"], i.get("content"), i.get("name"), i.get("arguments")) for i in done["output"]] == \
        [(i["type"], i.get("content"), i.get("name"), i.get("arguments")) for i in unstreamed["output"]]
    assert events[4]["delta"] == "Done." and json.loads(events[9]["delta"]) == {"expression": "12*34+1"}
    assert final.output_text == "Done." and [i.type for i in final.output] == ["message", "function_call"]
    assert len(session.conversation.samples) == 3  # each call recorded: the same input thrice, a sample each


def typed_events(streamed) -> list[dict]:
    """A stream of typed events (`event: <type>` and `data: <json>` of that type), checked for its shape."""
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    blocks = streamed.text.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == kind[len("event: "):]
    return events


def test_a_prompt_past_the_context_is_the_responses_apis_context_overflow_unstreamed_and_streamed(tokenizer):
    """Unstreamed, refused with the body OpenAI's Responses API sends (400, code "context_length_exceeded", param
    "input"), indented as OpenAI sends it. Streamed, as OpenAI streams it: a stream that fails, `response.created` and
    `response.in_progress`, an `error` event holding that body, then `response.failed`, its response's error that code
    and message. Codex reads a context overflow from that `response.failed` code alone
    (codex-rs/codex-api/src/sse/responses.rs; a 400 is to it an invalid request); the openai client raises the `error`
    event as an APIError with the code. LangChain's ChatOpenAI on the Responses API raises both as its context overflow:
    the 400 by its message's "Input tokens exceed the configured limit" (openai words str(e) from the message alone,
    so the code is not seen), the failed stream by "exceeds the context window". Nothing reaches the model."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI
    long = "1" * (CONTEXT + 1)

    async def calls(client, http):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="rlsys", input=long)
        raw = await http.post("/responses", json={"model": "rlsys", "input": long})
        streamed = await http.post("/responses", json={"model": "rlsys", "input": long, "stream": True})
        with pytest.raises(openai.APIError) as failed:
            async for _ in await client.responses.create(model="rlsys", input=long, stream=True):
                pass
        overflows = []
        for streaming in (False, True):
            model = ChatOpenAI(base_url=str(http.base_url), model="rlsys", max_retries=0, use_responses_api=True,
                               api_key=http.headers["authorization"].removeprefix("Bearer "), streaming=streaming)
            with pytest.raises(ContextOverflowError) as overflow:
                await model.ainvoke(long)
            overflows.append(overflow.value)
        return refused.value, raw, streamed, failed.value, overflows

    (refused, raw, streamed, failed, overflows), session = served(tokenizer, [], calls)
    expected = responses_overflow(len(ids(tokenizer, f"<|user|>{long}<|end|><|assistant|>")))
    assert (refused.status_code, refused.body, refused.code) == (400, expected, "context_length_exceeded")
    assert raw.text == json.dumps({"error": expected}, indent=4)
    events = typed_events(streamed)
    assert [(e["type"], e["sequence_number"]) for e in events] == \
        [("response.created", 0), ("response.in_progress", 1), ("error", 2), ("response.failed", 3)]
    started, failure = events[0]["response"], events[3]["response"]
    assert events[2] == {"type": "error", "sequence_number": 2, "error": expected}
    assert (started["status"], started["error"], failure["status"], failure["output"], failure["usage"]) == \
        ("in_progress", None, "failed", [], None)
    assert failure["error"] == {"code": "context_length_exceeded", "message": expected["message"]}
    assert {k: v for k, v in failure.items() if k not in ("status", "error")} == \
        {k: v for k, v in started.items() if k not in ("status", "error")}
    assert type(failed) is openai.APIError and (failed.code, failed.message) == \
        ("context_length_exceeded", expected["message"])
    unstreamed, streamed_overflow = overflows
    assert isinstance(unstreamed, openai.BadRequestError) and unstreamed.status_code == 400
    assert isinstance(streamed_overflow, openai.APIError) and session.outputs == []


def test_litellm_raises_its_context_window_error_for_a_prompt_past_the_context_on_every_api(tokenizer, monkeypatch):
    """LiteLLM tells a context overflow from any bad request by the error's text: on /v1/responses by OpenAI's
    `"code": "context_length_exceeded"` with the space OpenAI's indented body has, on the others by their words. Each
    of its calls, on each API the endpoint serves, raises its ContextWindowExceededError (what its callers trim on),
    streamed or not (`aresponses(stream=True)` calls a model LiteLLM does not know unstreamed); none reaches the
    model."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else its import fetches model prices from the web
    litellm = pytest.importorskip("litellm")  # scripts/install.sh --tests installs it, apart from the extras
    long = "1" * (CONTEXT + 1)

    async def calls(client, http):
        base, key = str(http.base_url), http.headers["authorization"].removeprefix("Bearer ")
        openai_api = {"model": "openai/rlsys", "api_base": base, "api_key": key, "num_retries": 0}
        chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 8}
        raised = []
        for call in (litellm.acompletion(**openai_api, **chat), litellm.acompletion(**openai_api, **chat, stream=True),
                     litellm.atext_completion(**openai_api, prompt=long, max_tokens=8),
                     litellm.aresponses(**openai_api, input=long), litellm.aresponses(**openai_api, input=long,
                                                                                      stream=True),
                     litellm.acompletion(model="anthropic/rlsys", api_base=base + "messages", api_key=key,
                                         num_retries=0, **chat)):
            with pytest.raises(litellm.BadRequestError) as refused:
                answer = await call
                async for _ in answer:  # a stream raises once read
                    pass
            raised.append(refused.value)
        return raised

    raised, session = served(tokenizer, [], calls)
    assert [type(e).__name__ for e in raised] == ["ContextWindowExceededError"] * 6, [str(e) for e in raised]
    assert session.outputs == []


def test_a_reply_cut_by_max_output_tokens_is_incomplete(tokenizer, tokenizer_dir):
    def policy(prompt_ids, gconfig, sample):
        return ids(tokenizer, "12345") + [tokenizer.eos_token_id]

    [trajectory], _ = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:responses_cut_run", policy)
    [response] = RESPONSES
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 2
    assert trajectory.stop_reason == "length" and sum(trajectory.loss_mask) == 2


def test_neutral_and_labelling_fields_are_answered(tokenizer):
    """`store` (OpenAI's default is true) is accepted either way; nothing is kept, as the docs say."""
    neutral = {"store": True, "metadata": {"run": "a"}, "user": "u", "truncation": "disabled", "include": [],
               "parallel_tool_calls": True, "tool_choice": "auto", "text": {"format": {"type": "text"}},
               "top_logprobs": 0, "reasoning": {}, "background": False, "service_tier": "auto",
               "previous_response_id": None, "stream": False}
    response, (asked,) = post(tokenizer, "/responses", {**BODY, **neutral})
    assert response.status_code == 200, response.text
    assert asked["gconfig"]["max_new_tokens"] == 8 and asked["gconfig"]["temperature"] == 0.7
    assert asked["gconfig"]["top_p"] == 0.9 and response.json()["metadata"] == {"run": "a"}
    no_tools = {k: v for k, v in BODY.items() if k != "tools"}
    response, _ = post(tokenizer, "/responses", {**no_tools, "store": False, "tool_choice": "none"})
    assert response.status_code == 200, response.text


def test_logprobs_included_are_each_output_tokens_as_chat_lists_them(tokenizer):
    """`include: ["message.output_text.logprobs"]` (with `top_logprobs` 0) fills the output text's logprobs, in the
    response and on its streamed delta and done events, with what chat's `logprobs: true` lists for the same reply."""
    asked = {**BODY, "include": ["message.output_text.logprobs"], "top_logprobs": 0}

    async def calls(client, http):
        response = await client.responses.create(**asked)
        streamed = await http.post("/responses", json={**asked, "stream": True})
        chat = await http.post("/chat/completions", json={
            "model": "rlsys", "max_tokens": 8, "logprobs": True, "tools": TOOLS, "messages": [
                {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12+34="}]})
        return response, streamed, chat.json()

    (response, streamed, chat), session = served(tokenizer, [["46"]] * 3, calls)
    expected = chat["choices"][0]["logprobs"]["content"]
    assert [lp["logprob"] for lp in expected] == [LOGPROB] * len(session.outputs[0].output_ids[0])
    assert [lp.model_dump() for lp in response.output[0].content[0].logprobs] == expected
    events = typed_events(streamed)
    assert [e["logprobs"] for e in events if e["type"].startswith("response.output_text.")] == [expected, expected]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected


CONVERSATION = [*INPUT, {"type": "function_call", "call_id": "c1", "name": "calculator",
                         "arguments": '{"expression": "12+34"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "46"}]
REFUSED = {  # name -> (body, param)
    "a previous response": ({**BODY, "previous_response_id": "resp_1"}, "previous_response_id"),
    "a stored conversation": ({**BODY, "conversation": "conv_1"}, "conversation"),
    "a field this endpoint does not know": ({**BODY, "prompt_template": "x"}, "prompt_template"),
    "a stored prompt": ({**BODY, "prompt": {"id": "pmpt_1"}}, "prompt"),
    "an image": ({**BODY, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "data:image/png;base64,"}
    ]}]}, "input[0].content[1]"),
    "a file as a call's output": ({**BODY, "input": [*CONVERSATION[:2], {**CONVERSATION[2], "output": [
        {"type": "input_file", "file_id": "f"}]}]}, "input[2].output[0]"),
    "a reasoning item": ({**BODY, "input": [*INPUT, {"type": "reasoning", "summary": []}]}, "input[1]"),
    "an item reference": ({**BODY, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    "a tool role": ({**BODY, "input": [{"role": "tool", "content": "46"}]}, "input[0].role"),
    "no input": ({k: v for k, v in BODY.items() if k != "input"}, "input"),
    "an empty input": ({**BODY, "input": []}, "input"),
    "a call without its id": ({**BODY, "input": [*INPUT, {"type": "function_call", "name": "calculator",
                                                         "arguments": "{}"}]}, "input[1]"),
    "an output without its call id": ({**BODY, "input": [{"type": "function_call_output", "output": "46"}]},
                                      "input[0].call_id"),
    "a built-in tool": ({**BODY, "tools": [{"type": "web_search"}]}, "tools[0]"),
    "a chat-shaped tool": ({**BODY, "tools": [{"type": "function", "function": RESPONSES_TOOLS[0]}]}, "tools[0]"),
    "a tool's bad schema": ({**BODY, "tools": [{**RESPONSES_TOOLS[0], "parameters": {"properties": [1]}}]},
                            "tools[0].parameters"),
    "a forced tool call": ({**BODY, "tool_choice": "required"}, "tool_choice"),
    "one tool call a turn": ({**BODY, "parallel_tool_calls": False}, "parallel_tool_calls"),
    "a JSON reply": ({**BODY, "text": {"format": {"type": "json_object"}}}, "text"),
    "a reasoning effort": ({**BODY, "reasoning": {"effort": "high"}}, "reasoning"),
    "other extra output included": ({**BODY, "include": ["message.output_text.logprobs",
                                                         "reasoning.encrypted_content"]}, "include"),
    "include as text": ({**BODY, "include": "message.output_text.logprobs"}, "include"),
    "top logprobs": ({**BODY, "top_logprobs": 3}, "top_logprobs"),
    "truncation": ({**BODY, "truncation": "auto"}, "truncation"),
    "in the background": ({**BODY, "background": True}, "background"),
    "max_output_tokens past the context": ({**BODY, "max_output_tokens": CONTEXT + 1}, "max_output_tokens"),
    "max_output_tokens -1": ({**BODY, "max_output_tokens": -1}, "max_output_tokens"),
    "temperature hot": ({**BODY, "temperature": "hot"}, "temperature"),
    "instructions as a list": ({**BODY, "instructions": [{"role": "system", "content": "x"}]}, "instructions"),
    "stream options unstreamed": ({**BODY, "stream_options": {"include_obfuscation": False}}, "stream_options"),
    "obfuscated events": ({**BODY, "stream": True, "stream_options": {"include_obfuscation": True}},
                          "stream_options.include_obfuscation"),
    "chat's stream usage": ({**BODY, "stream": True, "stream_options": {"include_usage": True}},
                            "stream_options.include_usage"),
    "store as text": ({**BODY, "store": "yes"}, "store"),
    "chat's n": ({**BODY, "n": 2}, "n"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_field_not_honoured_is_refused_naming_it_and_never_reaches_the_model(tokenizer, name):
    body, param = REFUSED[name]
    response, asked = post(tokenizer, "/responses", body)
    error = refusal(response)
    assert response.status_code == 400 and error["param"] == param and asked == [], error
    assert error["message"].startswith(param)


def test_a_model_without_a_chat_template_refuses_responses_saying_so():
    from rlsys.model.tokenizer import build_char_tokenizer

    base = build_char_tokenizer()
    base.chat_template = None
    response, asked = post(base, "/responses", BODY)
    error = refusal(response)
    assert response.status_code == 404 and "not a chat model" in error["message"] and asked == []
    assert "/v1/responses: call /v1/completions" in error["message"]


FULL = {**BODY, "input": CONVERSATION, "stream": False, "store": False, "metadata": {"a": "b"}, "tool_choice": "auto"}
FIELDS = [(k,) for k in FULL] + [("input", 0), ("input", 0, "role"), ("input", 0, "content"),
                                 ("input", 0, "content", 0), ("input", 0, "content", 0, "type"), ("input", 1),
                                 ("input", 1, "arguments"), ("input", 1, "call_id"), ("input", 2, "output"),
                                 ("input", 2, "call_id"), ("tools", 0), ("tools", 0, "parameters"),
                                 ("tools", 0, "type"), ("text",), ("reasoning",), ("include",), ("stream_options",)]


@PROPERTIES
@given(body=json_values)
def test_any_json_body_is_answered_or_refused_never_a_server_error(tokenizer, body):
    response, _ = post(tokenizer, "/responses", body)
    if response.status_code != 200:
        refusal(response)


@PROPERTIES
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_a_valid_body_with_one_field_replaced_is_answered_or_refused_naming_that_field(tokenizer, field, value):
    answered_or_refused_naming(tokenizer, "/responses", with_field(FULL, field, value), field[0])


def answered_or_refused_naming(tokenizer, path: str, body: dict, field: str, check_refusal=refusal, names="param"):
    """`body` is answered, the model asked once, or refused before the model asks, the refusal's `names` naming
    `field`."""
    response, asked = post(tokenizer, path, body)
    if response.status_code == 200:
        assert len(asked) == 1
        return
    error = check_refusal(response)
    assert response.status_code == 400 and asked == [], error
    if not (error[names] or "").startswith(field):  # refused as a whole: a string no tokenizer takes may sit anywhere,
        # and any field may make the prompt longer than the context
        assert "not valid Unicode" in error["message"] or "prompt is too long" in error["message"], error


@pytest.mark.parametrize("run", ["agents_sdk_run", "agents_sdk_streamed_run"])
def test_an_openai_agents_sdk_agent_with_a_function_tool_trains_token_exactly(tokenizer, tokenizer_dir, run):
    """The Agents SDK's default model (`OpenAIResponsesModel`) on the endpoint: the tool call it runs and the answer
    after it are one sample, the second call continuing the first's ids. The SDK is not among the `agents` extras
    (openai-agents 0.24 pins websockets below the 17 installed): scripts/install.sh --tests installs it alone."""
    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}",
                                       tool_then_answer(tokenizer))
    first, second = RESPONSES
    assert [(i.type, i.name) for i in first.output] == [("function_call", "calculator")]
    assert second.output[0].content[0].text == "409"
    (prompt, _), (continued, _) = engine.requests
    call_ids = ids(tokenizer, CALL) + [tokenizer.eos_token_id]
    assert continued == prompt + call_ids + ids(tokenizer, "<|user|><tool_response>409</tool_response><|end|>"
                                                           "<|assistant|>")
    assert trajectory.token_ids == continued + ids(tokenizer, "409") + [tokenizer.eos_token_id]
    assert trajectory.reward == 1.0 and trajectory.metrics["history_splits"] == 0
