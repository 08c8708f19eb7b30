"""Anthropic's Messages API (`POST /v1/messages`) on the endpoint: answered by the chat path, so read by the real
`anthropic` client from the real server and recorded token-exactly, a tool_use and its tool_result continuing the
sample the model's own ids began; every field it does not honour refused in Anthropic's error shape, naming it."""

import json

import anthropic
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.endpoint_clients import ANTHROPIC_TOOLS, CLAUDE_CODE, RESPONSES, claude_code_binary
from tests.test_endpoint_responses import answered_or_refused_naming, check_tool_then_answer, typed_events
from tests.helpers import with_field
from tests.scripted import ids
from tests.test_endpoint_streaming import record, served
from tests.test_openai_endpoint import CALL, CONTEXT, PROPERTIES, json_values, post, run_episode, tool_then_answer

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}  # LangChain's ChatAnthropic sends them
BODY = {"model": "rlsys", "max_tokens": 8, "system": "Use the calculator.", "tools": ANTHROPIC_TOOLS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "12+34="}]}], **SAMPLING}
# The installed `anthropic` (2.17) takes no sampling arguments: they go as extra body fields.
CLAUDE_CODE_CONTEXT = 100_000  # over its prompt (some 10,000 characters, a token each here), under its max_tokens
# A context the Messages agents' conversations and their max_tokens of 128 fit (Anthropic refuses them past it).
ROOMY = 512
CLIENT_BODY = {**{k: v for k, v in BODY.items() if k not in SAMPLING}, "extra_body": SAMPLING}


def messages_served(tokenizer, replies, calls):
    """`calls(client, http)` with the real `anthropic` client and a raw httpx client on a fresh episode's key."""
    async def with_anthropic(_openai, http):
        key = http.headers["authorization"].removeprefix("Bearer ")
        client = anthropic.AsyncAnthropic(base_url=str(http.base_url).removesuffix("/v1/"), api_key=key, max_retries=0)
        return await calls(client, http)

    return served(tokenizer, replies, with_anthropic)


def anthropic_refusal(response: httpx.Response) -> dict:
    """Anthropic's error body of a 4xx, checked for its shape."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


def test_a_string_message_is_answered_as_a_message_and_prompted_as_the_chat_call_would_be(tokenizer):
    async def calls(client, http):
        message = await client.messages.create(model="rlsys", max_tokens=8, system="Be brief.",
                                               messages=[{"role": "user", "content": "12+34="}])
        chat = await http.post("/chat/completions", json={"model": "rlsys", "max_tokens": 8, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]})
        return message, chat.json()

    (message, chat), session = messages_served(tokenizer, [["46"], ["46"]], calls)
    assert isinstance(message, anthropic.types.Message)
    assert (message.type, message.role, message.model) == ("message", "assistant", "rlsys")
    assert message.id.startswith("msg_") and message.stop_reason == "end_turn" and message.stop_sequence is None
    assert [(b.type, b.text) for b in message.content] == [("text", "46")]
    first, second = session.outputs
    assert first.prompt_ids == second.prompt_ids  # the chat call's prompt: system is its system message
    assert (message.usage.input_tokens, message.usage.output_tokens) == \
        (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
    sample = session.conversation.samples[0]
    assert sample.transcript.token_ids == first.prompt_ids + ids(tokenizer, "46") + [tokenizer.eos_token_id]


def chat_anthropic(http, **settings):
    """LangChain's ChatAnthropic on the endpoint, as users build it: the endpoint's root as its base URL."""
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(base_url=str(http.base_url).removesuffix("/v1/"), model="rlsys", max_retries=0,
                         api_key=http.headers["authorization"].removeprefix("Bearer "), **settings)


def test_a_chat_anthropic_call_is_answered_and_prompted_as_the_chat_call_would_be(tokenizer):
    """LangChain's ChatAnthropic, invoked: its system message the chat call's, its usage the reply's ids, its
    stop_sequences cutting the reply (it sends them with temperature, top_k and top_p, which the model gets); a
    top-level `cache_control` (prompt caching, which it sends as asked) changes nothing."""
    pytest.importorskip("langchain_anthropic")  # scripts/install.sh --tests installs it, apart from the extras
    from langchain_core.messages import HumanMessage, SystemMessage

    async def calls(_client, http):
        model = chat_anthropic(http, max_tokens=8, temperature=0.7, top_k=5, top_p=0.9)
        asked = [SystemMessage("Be brief."), HumanMessage("12+34=")]
        answer = await model.ainvoke(asked, cache_control={"type": "ephemeral"})
        cut = await model.ainvoke(asked, stop=["3"])
        chat = await http.post("/chat/completions", json={"model": "rlsys", "max_tokens": 8, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]})
        return answer, cut, chat.json()

    (answer, cut, chat), session = messages_served(tokenizer, [["46"], ["12345"], ["46"]], calls)
    assert answer.content == "46" and answer.response_metadata["stop_reason"] == "end_turn"
    assert (answer.usage_metadata["input_tokens"], answer.usage_metadata["output_tokens"]) == \
        (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
    assert cut.content == "12" and (cut.response_metadata["stop_reason"], cut.response_metadata["stop_sequence"]) == \
        ("stop_sequence", "3")
    first, second, third = session.outputs
    assert first.prompt_ids == second.prompt_ids == third.prompt_ids


def test_a_prompt_past_the_context_is_chat_anthropics_context_overflow(tokenizer):
    """Refused as Anthropic words it ("prompt is too long"), which ChatAnthropic raises as its context overflow (what
    LangChain's summarizing middleware acts on), not as any bad request."""
    pytest.importorskip("langchain_anthropic")
    from langchain_anthropic.chat_models import AnthropicContextOverflowError

    async def calls(_client, http):
        with pytest.raises(AnthropicContextOverflowError) as overflow:
            await chat_anthropic(http, max_tokens=8).ainvoke("x" * CONTEXT)
        return overflow.value

    overflow, session = messages_served(tokenizer, [], calls)
    assert overflow.status_code == 400 and "prompt is too long: " in overflow.message and session.outputs == []


def test_a_prompt_past_the_context_is_refused_in_anthropics_sentence_whose_numbers_claude_code_reads(tokenizer):
    """"prompt is too long: <prompt> tokens > <context> maximum", as Anthropic words it: Claude Code compacts its
    conversation on "prompt is too long" and reads the two numbers for how much."""
    def body(text: str) -> dict:
        return {**BODY, "messages": [{"role": "user", "content": text}]}

    _, (fits,) = post(tokenizer, "/messages", body("1"))
    length = len(fits["token_ids"]) + CONTEXT
    response, asked = post(tokenizer, "/messages", body("1" * (CONTEXT + 1)))
    assert response.status_code == 400 and anthropic_refusal(response) == {
        "type": "invalid_request_error", "message": f"prompt is too long: {length} tokens > {CONTEXT} maximum"}
    assert asked == []


def test_a_chat_anthropic_agent_records_what_the_chat_completions_agent_does(tokenizer, tokenizer_dir):
    """The LangGraph example's ReAct agent on ChatAnthropic (its calculator bound with bind_tools), invoked and
    streamed with stream_mode="messages": the tool_use it gets is the calculator call, the answer 409, and the
    episode's record, token for token, the one the same agent on ChatOpenAI leaves through /v1/chat/completions."""
    pytest.importorskip("langchain_anthropic")  # scripts/install.sh --tests installs it, apart from the extras
    from langchain_core.messages import AIMessage, AIMessageChunk

    recorded = []
    for run in ("rlsys.impl.agent.langgraph_example:run", "tests.endpoint_clients:chat_anthropic_run",
                "tests.endpoint_clients:chat_anthropic_streaming_run"):
        trajectories, engine = run_episode(tokenizer, tokenizer_dir, run, tool_then_answer(tokenizer),
                                           max_total_tokens=ROOMY)
        recorded.append(record(trajectories, engine))
        if run.endswith("chat_anthropic_run"):
            call, answer = [m for m in RESPONSES if isinstance(m, AIMessage)]
            assert [(c["name"], c["args"]) for c in call.tool_calls] == [("calculator", {"expression": "12*34+1"})]
            assert call.response_metadata["stop_reason"] == "tool_use" and answer.content == "409"
    assert recorded[1] == recorded[0] and recorded[2] == recorded[0]
    [trajectory], prompts = recorded[0]
    assert trajectory["reward"] == 1.0 and trajectory["metrics"]["history_splits"] == 0 and len(prompts) == 2
    chunks = [m for m in RESPONSES if isinstance(m, AIMessageChunk)]  # the streamed run's
    calls = [c for m in chunks for c in m.tool_call_chunks if c["args"]]
    assert [json.loads(c["args"]) for c in calls] == [{"expression": "12*34+1"}]
    text = "".join(b["text"] if isinstance(b, dict) else b for m in chunks if isinstance(m.content, list)
                   for b in m.content if isinstance(b, str) or b.get("type") == "text")
    assert text == "409"
    assert [m.usage_metadata["output_tokens"] for m in chunks if m.usage_metadata and
            m.usage_metadata["output_tokens"]] == [len(ids(tokenizer, CALL)) + 1, 4]


@pytest.mark.parametrize("run", ["anthropic_tools_run", "anthropic_streaming_tools_run"])
def test_a_tool_use_and_its_result_continue_the_recorded_sample_token_exactly(tokenizer, tokenizer_dir, run):
    """The agent's tool loop on the Messages API: the first reply is a tool_use block, parsed as chat parses tool
    calls; the second call sends it back with a tool_result, and its prompt is the first call's ids, the model's own
    ids, then only the tool's result through the template."""
    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, f"tests.endpoint_clients:{run}",
                                       tool_then_answer(tokenizer), max_total_tokens=ROOMY)
    first, second = RESPONSES
    [call] = first.content
    assert (call.type, call.name, call.input) == ("tool_use", "calculator", {"expression": "12*34+1"})
    assert first.stop_reason == "tool_use" and second.stop_reason == "end_turn"
    assert second.content[0].text == "409"
    check_tool_then_answer(tokenizer, trajectory, engine, {"name": "calculator", "description": "arithmetic",
                                                           "parameters": ANTHROPIC_TOOLS[0]["input_schema"]})


def test_an_empty_reply_sent_back_as_no_blocks_continues_its_sample(tokenizer):
    """The model's empty turn is a message with no content blocks (as Anthropic answers one); sent back as it came,
    it is still that turn, so the next call continues the sample rather than splitting it."""
    async def calls(client, _http):
        messages = [{"role": "user", "content": "12+34="}]
        first = await client.messages.create(model="rlsys", max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "again"}]
        return first, await client.messages.create(model="rlsys", max_tokens=8, messages=messages)

    (first, second), session = messages_served(tokenizer, [[""], ["46"]], calls)
    assert first.content == [] and first.stop_reason == "end_turn" and second.content[0].text == "46"
    assert session.conversation.history_splits == 0 and len(session.conversation.samples) == 1
    assert session.outputs[1].prompt_ids[:len(session.outputs[0].prompt_ids) + 1] == \
        session.outputs[0].prompt_ids + [tokenizer.eos_token_id]  # the first call's ids, then its reply's


def test_a_streamed_message_is_the_unstreamed_one_as_anthropic_events(tokenizer):
    async def calls(client, http):
        unstreamed = await http.post("/messages", json=BODY)
        streamed = await http.post("/messages", json={**BODY, "stream": True})
        async with client.messages.stream(**CLIENT_BODY) as stream:  # the client's own reassembly
            final = await stream.get_final_message()
        return unstreamed.json(), streamed, final

    (unstreamed, streamed, final), session = messages_served(tokenizer, [[CALL + "Done."]] * 3, calls)
    events = typed_events(streamed)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[2]["delta"] == {"type": "text_delta", "text": "Done."}
    assert events[5]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[5]["delta"]["partial_json"]) == {"expression": "12*34+1"}
    assert events[7]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[7]["usage"] == unstreamed["usage"]
    assert [b["type"] for b in unstreamed["content"]] == ["text", "tool_use"]
    rebuilt = final.model_dump()  # the client rebuilt the unstreamed message, but for the ids every call draws
    assert {k: rebuilt[k] for k in unstreamed if k not in ("id", "content", "usage")} == \
        {k: v for k, v in unstreamed.items() if k not in ("id", "content", "usage")}
    assert [{k: v for k, v in b.items() if k != "id"} for b in unstreamed["content"]] == \
        [b.model_dump(include={"type", "text", "name", "input"}) for b in final.content]
    assert (final.usage.input_tokens, final.usage.output_tokens) == tuple(unstreamed["usage"].values())
    assert len(session.conversation.samples) == 3  # each call recorded


def test_a_reply_cut_by_max_tokens_or_at_a_stop_sequence_says_so(tokenizer, tokenizer_dir):
    def policy(prompt_ids, gconfig, sample):
        return ids(tokenizer, "12345") + [tokenizer.eos_token_id]

    [trajectory], _ = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:anthropic_cut_run", policy)
    [message] = RESPONSES
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2
    assert trajectory.stop_reason == "length" and sum(trajectory.loss_mask) == 2

    async def calls(client, _http):
        return await client.messages.create(model="rlsys", max_tokens=8, stop_sequences=["3", "2"],
                                            messages=[{"role": "user", "content": "count"}])

    message, session = messages_served(tokenizer, [["12345"]], calls)
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == ("stop_sequence", "2", "1")
    assert session.outputs[0].output_ids[0] == ids(tokenizer, "12")  # the ids kept end at the stop sequence


def test_a_reply_is_decoded_once():
    """The reply's text and the stop sequence it was cut at come from one decode of its ids (a second decode of the
    same ids searched for the stop sequence)."""
    from rlsys.model.tokenizer import build_char_tokenizer

    tokenizer, decoded = build_char_tokenizer(), []
    decode = tokenizer.decode
    tokenizer.decode = lambda token_ids, **kwargs: decoded.append(list(token_ids)) or decode(token_ids, **kwargs)

    async def calls(_client, http):
        return await http.post("/messages", json={"max_tokens": 8, "messages": [{"role": "user", "content": "?"}]})

    reply, session = messages_served(tokenizer, [["46"]], calls)
    assert reply.json()["content"] == [{"type": "text", "text": "46"}] and reply.json()["stop_reason"] == "end_turn"
    assert decoded.count(session.outputs[0].output_ids[0]) == 1


def test_the_key_is_read_from_x_api_key_on_messages_only(tokenizer):
    """Anthropic's clients (LangChain's ChatAnthropic, older `anthropic` releases) send the key as x-api-key; the
    installed `anthropic` sends it as a Bearer token. No other path reads x-api-key."""
    async def calls(client, http):
        key = http.headers["authorization"].removeprefix("Bearer ")
        async with httpx.AsyncClient(base_url=http.base_url, headers={"x-api-key": key}) as bare:
            answered = await bare.post("/messages", json=BODY)
            chat = await bare.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            wrong = await bare.post("/messages", json=BODY, headers={"x-api-key": "nobody"})
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            await anthropic.AsyncAnthropic(base_url=client.base_url, api_key="nobody", max_retries=0).messages.create(
                **CLIENT_BODY)
        return answered, chat, wrong, unknown.value

    (answered, chat, wrong, unknown), _ = messages_served(tokenizer, [["46"]], calls)
    assert answered.status_code == 200 and answered.json()["content"] == [{"type": "text", "text": "46"}]
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
    assert wrong.status_code == 401
    assert anthropic_refusal(wrong)["type"] == "authentication_error"
    assert unknown.status_code == 401 and unknown.type == "authentication_error"


def test_a_refusal_reaches_the_anthropic_client_naming_the_field(tokenizer):
    async def calls(client, _http):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="rlsys", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
        return refused.value

    refused, session = messages_served(tokenizer, [], calls)
    assert refused.status_code == 400 and refused.type == "invalid_request_error"
    assert refused.api_message.startswith("messages[0].content[0] must be a text or tool_result block")
    assert session.outputs == []


CONVERSATION = [
    BODY["messages"][0],
    {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                      {"type": "tool_use", "id": "t1", "name": "calculator",
                                       "input": {"expression": "12+34"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                                         "text": "46"}],
                                  "is_error": False}, {"type": "text", "text": "And so?"}]}]


def test_a_conversation_is_the_chat_call_it_makes(tokenizer):
    """Each tool_result a tool message, in order, and a user turn's text after them a user message; `thinking`
    disabled, `metadata`, `stop_sequences` and `tool_choice` auto accepted; `top_k` reaches the model."""
    body = {**BODY, "messages": CONVERSATION, "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"},
            "stop_sequences": ["\n\n"], "tool_choice": {"type": "auto", "disable_parallel_tool_use": False}}
    response, (asked,) = post(tokenizer, "/messages", body)
    assert response.status_code == 200, response.text
    chat, (chat_asked,) = post(tokenizer, "/chat/completions", {"max_tokens": 8, "messages": [
        {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12+34="},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'}}
        ]}, {"role": "tool", "tool_call_id": "t1", "content": "46"}, {"role": "user", "content": "And so?"}],
        "tools": [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                                    "parameters": ANTHROPIC_TOOLS[0]["input_schema"]}}]})
    assert chat.status_code == 200, chat.text
    assert asked["token_ids"] == chat_asked["token_ids"]
    assert (asked["gconfig"]["max_new_tokens"], asked["gconfig"]["temperature"], asked["gconfig"]["top_p"],
            asked["gconfig"]["top_k"]) == (8, 0.7, 0.9, 5)


def use_claude_code(tmp_path, args: list[str], settings: dict | None = None) -> None:
    """claude_code_run set to run the installed Claude Code with `args` and the environment's `settings`, in a home
    and a working directory of the test's own; the test skipped where it is not installed."""
    binary = claude_code_binary()
    if binary is None:
        pytest.skip("Claude Code is not installed (bash scripts/install.sh --tests installs the Claude Agent SDK, "
                    "which bundles it)")
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    CLAUDE_CODE.update(binary=binary, home=tmp_path / "home", cwd=tmp_path / "work", args=args,
                       settings=settings or {})


@pytest.mark.parametrize("args", [["--model", "rlsys"], []], ids=["a model it does not know", "its own model"])
def test_claude_code_reads_a_file_with_its_tool_and_answers_in_one_recorded_sample(tokenizer, tokenizer_dir, tmp_path,
                                                                                   args):
    """Claude Code itself (`claude -p`: on PATH, else the CLI the Claude Agent SDK bundles, which scripts/install.sh
    --tests installs) on the endpoint, given only its address and the episode's key: every call it makes is answered,
    its Read tool runs on the model's call and the model's answer after it is its result. Its calls are one sample, the
    second continuing the first's ids: Claude Code sends its conversation back as it got it. For its own models it asks
    effort "medium", which is refused in Anthropic's words for a model without effort: it sends the call again without
    one, as it does to Anthropic (for a model it does not know it asks none)."""
    use_claude_code(tmp_path, args)
    (tmp_path / "work" / "answer.txt").write_text("409\n")
    call = json.dumps({"name": "Read", "arguments": {"file_path": str(tmp_path / "work" / "answer.txt")}})
    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:claude_code_run",
                                       tool_then_answer(tokenizer, f"<tool_call>{call}</tool_call>"),
                                       max_total_tokens=CLAUDE_CODE_CONTEXT)
    [result] = RESPONSES
    assert (result.get("is_error"), result.get("result"), result.get("num_turns")) == (False, "409", 2), result
    (first, _), (second, _) = engine.requests
    assert second[:len(first)] == first and "409" in tokenizer.decode(second[len(first):])  # the file, read
    assert trajectory.reward == 1.0 and trajectory.metrics["history_splits"] == 0
    assert trajectory.token_ids == second + ids(tokenizer, "409") + [tokenizer.eos_token_id]


def test_claude_code_asked_for_less_than_the_context_but_more_than_its_prompt_leaves_asks_for_what_it_leaves(
        tokenizer, tokenizer_dir, tmp_path):
    """Claude Code with CLAUDE_CODE_MAX_OUTPUT_TOKENS under the context (which spares the call refused past the whole
    context) but past what its prompt leaves: the call is refused in Anthropic's words, Claude Code reads them and
    asks again for what the context leaves less its margin of 1,000 tokens, and that call is answered. Cut instead,
    the reply would have had the 1,000 tokens Claude Code keeps back, and a max_tokens stop at a budget it never
    asked."""
    context, asked = 36_000, 32_000  # its prompt is some 17,000 tokens here: over 3,000 left, not 32,000
    use_claude_code(tmp_path, [], {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(asked)})
    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:claude_code_run",
                                       lambda *_: ids(tokenizer, "409") + [tokenizer.eos_token_id],
                                       max_total_tokens=context)
    [result] = RESPONSES
    assert (result.get("is_error"), result.get("result")) == (False, "409"), result
    [(prompt, gconfig)] = engine.requests
    assert len(prompt) + asked > context and gconfig.max_new_tokens == context - len(prompt) - 1000


def test_a_claude_agent_sdk_agent_loads_its_tool_calls_it_and_answers_in_one_recorded_sample(tokenizer, tokenizer_dir,
                                                                                               tmp_path):
    """The Python Claude Agent SDK's `query()` (tests.endpoint_clients.claude_agent_sdk_run) with a calculator of its
    own, on the endpoint with only its address and key. Claude Code defers the calculator (an MCP tool): the model
    calls ToolSearch, whose result is a tool_reference, and the calculator's definition is its tool response, in the
    sample; the model then calls the calculator, which the SDK runs in this process, and answers its result. The
    three calls are one sample, each continuing the last, and the episode's reward is the agent's."""
    pytest.importorskip("claude_agent_sdk")  # scripts/install.sh --tests installs it
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    CLAUDE_CODE.update(binary=claude_code_binary(), home=tmp_path / "home", cwd=tmp_path / "work")
    search = json.dumps({"name": "ToolSearch", "arguments": {"query": "select:mcp__math__calculator",
                                                             "max_results": 1}})
    calculate = json.dumps({"name": "mcp__math__calculator", "arguments": {"expression": "12*34+1"}})
    replies = [f"<tool_call>{search}</tool_call>", f"<tool_call>{calculate}</tool_call>", "409"]

    def policy(prompt_ids, gconfig, sample):
        return ids(tokenizer, replies[tokenizer.decode(prompt_ids).count("<tool_response>")]) + \
            [tokenizer.eos_token_id]

    [trajectory], engine = run_episode(tokenizer, tokenizer_dir, "tests.endpoint_clients:claude_agent_sdk_run", policy,
                                       max_total_tokens=CLAUDE_CODE_CONTEXT)
    result = RESPONSES[-1]
    assert (result.is_error, result.result, result.num_turns) == (False, "409", 3), result
    (first, _), (second, _), (third, _) = engine.requests
    assert second[:len(first)] == first and third[:len(second)] == second
    loaded = tokenizer.decode(second[len(first):])  # the tool search's result: the calculator's definition
    assert '"name": "mcp__math__calculator"' in loaded and "Evaluates an arithmetic expression" in loaded
    assert "409" in tokenizer.decode(third[len(second):])  # the calculator's result
    assert trajectory.reward == 1.0 and trajectory.metrics["history_splits"] == 0
    assert trajectory.token_ids == third + ids(tokenizer, "409") + [tokenizer.eos_token_id]


# What Claude Code 2.1.332 sends on every call beside the conversation (seen from its requests to a recording server):
# each field at the value it sends is answered, and changes the prompt only as it says.
CLAUDE_CODE_FIELDS = {"thinking": {"type": "adaptive", "display": "omitted"},
                      "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                      "output_config": {"effort": "high"}, "cache_control": {"type": "ephemeral"},
                      "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'}}


@pytest.mark.parametrize("field", CLAUDE_CODE_FIELDS)
def test_a_field_claude_code_sends_is_answered_at_what_it_sends_and_changes_no_prompt(tokenizer, field):
    """On /v1/messages?beta=true, as Claude Code calls (its anthropic-beta header names features: no header is read
    here, the body's fields are checked): adaptive thinking with nothing displayed (the model thinks or not as its
    template has it; no thinking block is returned), clearing thinking blocks (none is accepted here, so none is
    cleared), effort "high" (Anthropic's default), prompt caching and a user label. The prompt and the sampling are
    the call's without the field."""
    response, (asked,) = post(tokenizer, "/messages?beta=true", {**BODY, field: CLAUDE_CODE_FIELDS[field]})
    assert response.status_code == 200, response.text
    _, (plain,) = post(tokenizer, "/messages", BODY)
    assert (asked["token_ids"], asked["gconfig"]) == (plain["token_ids"], plain["gconfig"])


def test_adaptive_thinking_shown_as_progress_updates_is_answered_with_no_thinking_and_changes_no_prompt(tokenizer):
    """The `anthropic` client's beta `thinking` with `display: "updates"` (thinking not shown; any short progress
    updates the model writes between tool calls shown as blocks of their own): the model thinks or not as its chat
    template has it and writes no such updates, so the reply is its text alone, as a reply with none; the prompt and
    the sampling are the call's without the field."""
    async def calls(client, _http):
        asked = dict(model="rlsys", max_tokens=8, messages=[{"role": "user", "content": "12+34="}])
        return (await client.beta.messages.create(**asked, thinking={"type": "adaptive", "display": "updates"}),
                await client.messages.create(**asked))

    (updates, plain), session = messages_served(tokenizer, [["46"], ["46"]], calls)
    assert [(b.type, b.text) for b in updates.content] == [("text", "46")] and updates.stop_reason == "end_turn"
    with_updates, without = session.outputs
    assert with_updates.prompt_ids == without.prompt_ids


def test_a_system_turn_among_the_messages_is_a_system_message_where_it_stands(tokenizer):
    """Claude Code sends its environment as a system turn after the user's (Anthropic's mid-conversation system
    messages): it is the chat call's system message at that place, and a call whose last turn it is is answered."""
    turns = [CONVERSATION[0], {"role": "system", "content": [{"type": "text", "text": "cwd: /tmp",
                                                              "cache_control": {"type": "ephemeral"}}]}]
    response, (asked,) = post(tokenizer, "/messages", {**BODY, "messages": turns})
    assert response.status_code == 200, response.text
    _, (chat,) = post(tokenizer, "/chat/completions", {"max_tokens": 8, "messages": [
        {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12+34="},
        {"role": "system", "content": "cwd: /tmp"}]})
    assert asked["token_ids"] == chat["token_ids"]


def test_a_tool_whose_loading_is_deferred_is_not_given_to_the_model(tokenizer):
    """`defer_loading: true` (Claude Code's tool search): Anthropic gives the model no such tool until a search loads
    it, so a call to it is a call to a tool the model was not given: text, as any such call is, not a tool_use."""
    deferred = {"name": "WebSearch", "description": "searches the web", "input_schema": {"type": "object"},
                "defer_loading": True}
    call = '<tool_call>{"name": "WebSearch", "arguments": {}}</tool_call>'

    async def calls(_client, http):
        return [(await http.post("/messages", json={**BODY, "tools": [*ANTHROPIC_TOOLS, {**deferred, "defer_loading":
                                                                                       loading}]})).json()
                for loading in (True, False)]

    (hidden, shown), _ = messages_served(tokenizer, [[call], [call]], calls)
    assert (hidden["stop_reason"], hidden["content"]) == ("end_turn", [{"type": "text", "text": call}])
    assert shown["stop_reason"] == "tool_use" and shown["content"][0]["name"] == "WebSearch"


def test_a_tool_reference_loads_its_deferred_tool_showing_its_definition_where_it_stands(tokenizer):
    """Claude Code's ToolSearch answers with tool_reference blocks: Anthropic then shows the model the deferred tool's
    definition there, in the conversation, the tools ahead of it unchanged, and the model may call it from then on.
    Here the tool result's text is the definition as the chat template is given tools, and a call to it a tool_use;
    the same call where the tool is only declared, in chat's shape, is text (no tool the model was given)."""
    search = {"name": "ToolSearch", "description": "loads tools", "input_schema": {"type": "object"}}
    deferred = {"name": "WebSearch", "description": "searches the web", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    turns = [{"role": "user", "content": "12+34="},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                 {"type": "tool_reference", "tool_name": "WebSearch"}]}]}]
    definition = {"type": "function", "function": {"name": "WebSearch", "description": "searches the web",
                                                   "parameters": deferred["input_schema"]}}
    chat_turns = [turns[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "ToolSearch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": json.dumps(definition)}]
    call = '<tool_call>{"name": "WebSearch", "arguments": {"query": "46"}}</tool_call>'

    async def calls(_client, http):
        loaded = await http.post("/messages", json={"max_tokens": 100, "tools": [search, deferred], "messages": turns})
        chat = await http.post("/chat/completions", json={"max_tokens": 100, "messages": chat_turns, "tools": [
            {"type": "function", "function": {"name": "ToolSearch", "description": "loads tools",
                                              "parameters": {"type": "object"}}}]})
        return loaded.json(), chat.json()

    (loaded, chat), session = messages_served(tokenizer, [[call], [call]], calls)
    assert loaded["stop_reason"] == "tool_use", loaded
    assert [(b["name"], b["input"]) for b in loaded["content"]] == [("WebSearch", {"query": "46"})]
    first, second = session.outputs
    assert first.prompt_ids == second.prompt_ids  # the definition where the reference stood, no other tool rendered
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["choices"][0]["message"]["content"] == call


REFERENCE_TO_NOTHING = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
    {"type": "tool_reference", "tool_name": "Nothing"}]}]}
REFUSED = {  # name -> (body, the field the message starts with)
    "no max_tokens": ({k: v for k, v in BODY.items() if k != "max_tokens"}, "max_tokens"),
    "max_tokens past the context": ({**BODY, "max_tokens": CONTEXT + 1}, "max_tokens"),
    "max_tokens 0": ({**BODY, "max_tokens": 0}, "max_tokens"),
    "no messages": ({k: v for k, v in BODY.items() if k != "messages"}, "messages"),
    "an empty messages list": ({**BODY, "messages": []}, "messages"),
    "a tool role in messages": ({**BODY, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    "an image in a system turn": ({**BODY, "messages": [CONVERSATION[0], {"role": "system", "content": [
        {"type": "image", "source": {}}]}]}, "messages[1].content[0]"),
    "a prefilled reply": ({**BODY, "messages": CONVERSATION[:2]}, "messages[1].role"),
    "an image": ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
        "messages[0].content[0]"),
    "a document": ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
        "messages[0].content[0]"),
    "an image as a tool's result": ({**BODY, "messages": [*CONVERSATION[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}]}]},
        "messages[2].content[0].content[0]"),
    "a tool_use in a user turn": ({**BODY, "messages": [{"role": "user", "content": [CONVERSATION[1]["content"][1]]}]},
                                  "messages[0].content[0]"),
    "a tool_use whose input is text": ({**BODY, "messages": [CONVERSATION[0], {"role": "assistant", "content": [
        {**CONVERSATION[1]["content"][1], "input": '{"expression": "1"}'}]}, CONVERSATION[2]]},
        "messages[1].content[0]"),
    "a tool_result without its id": ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "46"}]}]}, "messages[0].content[0].tool_use_id"),
    "is_error as text": ({**BODY, "messages": [*CONVERSATION[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "46", "is_error": "yes"}]}]},
        "messages[2].content[0].is_error"),
    "thinking enabled": ({**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "thinking adaptive, summarized": ({**BODY, "thinking": {"type": "adaptive", "display": "summarized"}},
                                      "thinking.adaptive.display:"),
    "thinking adaptive, highlights": ({**BODY, "thinking": {"type": "adaptive", "display": "highlights"}},
                                      "thinking.adaptive.display:"),
    "thinking blocks bound": ({**BODY, "thinking": {"type": "adaptive", "block_binding": {}}},
                              "thinking.adaptive.block_binding:"),
    "thinking between tools": ({**BODY, "thinking": {"type": "between_tools"}}, "thinking"),
    "tool uses cleared": ({**BODY, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                          "context_management.edits[0]"),
    "context management as a list": ({**BODY, "context_management": []}, "context_management"),
    "low effort": ({**BODY, "output_config": {"effort": "low"}}, "output_config.effort"),
    "a JSON reply format": ({**BODY, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
                            "output_config.format"),
    "output config as text": ({**BODY, "output_config": "high"}, "output_config"),
    "cache_control as text": ({**BODY, "cache_control": "ephemeral"}, "cache_control"),
    "a tool_reference to no tool of the request": ({**BODY, "messages": [*CONVERSATION[:2], REFERENCE_TO_NOTHING]},
                                                   "messages[2].content[0].content[0].tool_name"),
    "a tool_reference in a user turn": ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_reference", "tool_name": "calculator"}]}]}, "messages[0].content[0]"),
    "defer_loading as text": ({**BODY, "tools": [{**ANTHROPIC_TOOLS[0], "defer_loading": "yes"}]},
                              "tools[0].defer_loading"),
    "a server tool": ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    "a tool's bad schema": ({**BODY, "tools": [{**ANTHROPIC_TOOLS[0], "input_schema": {"properties": [1]}}]},
                            "tools[0].input_schema"),
    "any tool": ({**BODY, "tool_choice": {"type": "any"}}, "tool_choice"),
    "a named tool": ({**BODY, "tool_choice": {"type": "tool", "name": "calculator"}}, "tool_choice"),
    "no tool": ({**BODY, "tool_choice": {"type": "none"}}, "tool_choice"),
    "chat's tool_choice": ({**BODY, "tool_choice": "auto"}, "tool_choice"),
    "one tool call a turn": ({**BODY, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                             "tool_choice.disable_parallel_tool_use"),
    "system as a message list": ({**BODY, "system": [{"role": "system", "content": "x"}]}, "system[0]"),
    "stop sequences as a number": ({**BODY, "stop_sequences": [1]}, "stop_sequences"),
    "temperature hot": ({**BODY, "temperature": "hot"}, "temperature"),
    "metadata as text": ({**BODY, "metadata": "run 1"}, "metadata"),
    "stream as text": ({**BODY, "stream": "yes"}, "stream"),
    "a field this endpoint does not know": ({**BODY, "container": "c1"}, "container"),
    "chat's stop": ({**BODY, "stop": ["\n"]}, "stop"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_field_not_honoured_is_refused_naming_it_and_never_reaches_the_model(tokenizer, name):
    body, param = REFUSED[name]
    response, asked = post(tokenizer, "/messages", body)
    error = anthropic_refusal(response)
    assert response.status_code == 400 and error["type"] == "invalid_request_error" and asked == [], error
    assert error["message"].startswith(param + " "), error


def test_an_effort_is_refused_in_the_words_claude_code_reads_as_a_model_without_effort(tokenizer):
    """Claude Code asks effort "medium" of its own models; on a 400 saying the model "does not support the effort
    parameter" (Anthropic's words) it sends the call again without one. The refusal says so."""
    response, asked = post(tokenizer, "/messages", {**BODY, "output_config": {"effort": "medium"}})
    error = anthropic_refusal(response)
    assert "does not support the effort parameter" in error["message"].lower() and asked == []


def test_a_thinking_display_not_honoured_is_refused_in_anthropics_words_for_it(tokenizer):
    """"thinking.adaptive.display: Input should be ...", as Anthropic refuses a display its model does not take (Claude
    Code reads those words to send its call again without the display); the displays answered are named."""
    response, asked = post(tokenizer, "/messages", {**BODY, "thinking": {"type": "adaptive", "display": "summarized"}})
    error = anthropic_refusal(response)
    assert error["message"].startswith("thinking.adaptive.display: Input should be 'omitted' or 'updates'") and \
        asked == [], error


def test_max_tokens_past_the_context_is_refused_saying_by_how_much_in_the_words_claude_code_reads(tokenizer):
    """Claude Code asks max_tokens 128000 of its own models; refused as Anthropic words it, "input length and
    `max_tokens` exceed context limit: <prompt> + <max_tokens> > <context>", it asks again for what the context
    leaves. The prompt's length is the call's."""
    response, asked = post(tokenizer, "/messages", {**BODY, "max_tokens": CONTEXT + 1})
    error = anthropic_refusal(response)
    _, (plain,) = post(tokenizer, "/messages", BODY)
    assert f"input length and `max_tokens` exceed context limit: {len(plain['token_ids'])} + {CONTEXT + 1} > " \
           f"{CONTEXT}," in error["message"] and asked == [], error


def test_max_tokens_past_what_the_prompt_leaves_is_refused_saying_by_how_much_not_cut(tokenizer):
    """As Anthropic refuses it, whether or not max_tokens alone is past the context: Claude Code asks again for what
    the context leaves (less a margin of its own), where a cut reply would end at a max_tokens it did not ask. A
    max_tokens the prompt leaves room for is answered as asked."""
    _, (plain,) = post(tokenizer, "/messages", BODY)
    room = CONTEXT - len(plain["token_ids"])
    response, asked = post(tokenizer, "/messages", {**BODY, "max_tokens": room + 1})
    error = anthropic_refusal(response)
    assert response.status_code == 400 and error["type"] == "invalid_request_error" and asked == [], error
    assert f"input length and `max_tokens` exceed context limit: {CONTEXT - room} + {room + 1} > {CONTEXT}, " \
           f"decrease input length or `max_tokens` and try again" in error["message"], error
    response, (asked,) = post(tokenizer, "/messages", {**BODY, "max_tokens": room})
    assert response.status_code == 200 and asked["gconfig"]["max_new_tokens"] == room, response.text


def test_a_model_without_a_chat_template_refuses_messages_saying_so():
    from rlsys.model.tokenizer import build_char_tokenizer

    base = build_char_tokenizer()
    base.chat_template = None
    response, asked = post(base, "/messages", BODY)
    error = anthropic_refusal(response)
    assert response.status_code == 404 and error["type"] == "not_found_error" and asked == []
    assert "/v1/messages: call /v1/completions" in error["message"]


FULL = {**BODY, "messages": CONVERSATION, "stream": False, "tool_choice": {"type": "auto"}, "stop_sequences": ["\n\n"],
        **CLAUDE_CODE_FIELDS}
FIELDS = [(k,) for k in FULL] + [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                                 ("messages", 0, "content", 0), ("messages", 0, "content", 0, "type"),
                                 ("messages", 1, "content", 1), ("messages", 1, "content", 1, "input"),
                                 ("messages", 1, "content", 1, "id"), ("messages", 2, "content", 0, "content"),
                                 ("messages", 2, "content", 0, "tool_use_id"), ("tools", 0),
                                 ("tools", 0, "input_schema"), ("tools", 0, "defer_loading"), ("tool_choice", "type"),
                                 ("thinking", "type"), ("context_management", "edits"),
                                 ("context_management", "edits", 0), ("output_config", "effort")]


@PROPERTIES
@given(body=json_values)
def test_any_json_body_is_answered_or_refused_never_a_server_error(tokenizer, body):
    response, _ = post(tokenizer, "/messages", body)
    if response.status_code != 200:
        anthropic_refusal(response)


@PROPERTIES
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_a_valid_body_with_one_field_replaced_is_answered_or_refused_naming_that_field(tokenizer, field, value):
    answered_or_refused_naming(tokenizer, "/messages", with_field(FULL, field, value), field[0], anthropic_refusal,
                               names="message")
