"""What a client may send the endpoint, checked before any of it is used.

A request body comes from code the run does not control: a user's agent, a framework's defaults. Whatever
it holds must end in an answer the client can act on, never a 500, a crash in the router, or an episode
left waiting for a reply the inference worker will never send (it sets a request outside its bounds
aside). So every field the endpoint reads is checked here, once, before the conversation or the model sees
it. A refusal is HTTP 400 in OpenAI's error shape, naming the field (`param`) and what is wrong with it; a
body over MAX_BODY_BYTES is 413, and one nested deeper than MAX_JSON_DEPTH is 400, so nothing further in
recurses through it.

The sampling settings are held to the bounds every request to the model is held to
(`rlsys.api.messages.generation_setting`, the check `Model`, the router and the inference worker run), and
the prompt and the reply's budget (`max_tokens` by whichever name the API gives it) to the episode's context as well,
once the prompt is rendered (`reply_budget`), in the words, status and error fields of the call's API. On the OpenAI
paths as vLLM's OpenAI server answers: a budget or a prompt past the whole context is refused (type "BadRequestError",
code 400, `param` the budget's name or "input_tokens"), and a budget within it (or the agent's default, where none is
asked) is cut to what the prompt leaves; but a prompt past it is refused on /v1/chat/completions and /v1/responses
with the body OpenAI sends there (code "context_length_exceeded"; on /v1/responses its message followed by chat's),
which those APIs' clients read as a context overflow (`context_overflow`). On /v1/messages as Anthropic's API
answers: a prompt past the context is
"prompt is too long: <prompt> tokens > <context> maximum", and a max_tokens past what the prompt leaves is refused
saying both numbers, which Claude Code reads to ask again for less. Sampling and reply settings the endpoint does not
honour (penalties, logit bias, min_p, a forced or forbidden tool call, at most one tool call a turn, a JSON reply
format, alternatives to each token's logprob; a completion's echoed prompt, suffix and best-of choice; the legacy
`functions`) may be sent at their neutral value, as many clients do, and are refused at any other: the reply would be
sampled as if they were unset and trained on as such. So is content other than text (an image): the model would
answer without it. Other fields the endpoint does not read are left alone: OpenAI clients send many.

`"stream": true` is answered as Server-Sent Events (rlsys/endpoint/streaming.py). `stream_options` is refused
without it, as OpenAI refuses it; of its keys `include_usage` is honoured, `include_obfuscation` refused unless
false, and any other refused.

A /v1/responses body (OpenAI's Responses API) is checked here under its own field names and translated into the
chat call it asks for: `instructions` a system message first, input items messages (consecutive function calls one
assistant turn, as the model produced them; a call's output a tool message), flat function tools in chat's shape.
`include: ["message.output_text.logprobs"]` lists each output token's logprob (with `top_logprobs` 0: no alternatives),
as chat's `logprobs` does. Every field of it either acts, is accepted at its neutral value, or is refused naming it,
unknown ones too: that API has many fields that change the answer (`previous_response_id`, `reasoning`,
`text.format`, built-in tools). The endpoint keeps nothing between calls: `store` (OpenAI's default is true) is
accepted and nothing is stored, so a later `previous_response_id` or `conversation` naming it could not be honoured
and is refused.

A /v1/messages body (Anthropic's Messages API) is translated the same way: `system` a system message first, each turn's
text one message (a system turn among them, as Claude Code sends its environment, a system message where it stands), an
assistant turn's tool_use blocks its tool calls, a user turn's tool_result blocks a tool message each, in order
(`is_error` is read as a flag and not rendered: a chat tool message has none, and the result's text says what failed; a
`tool_reference` block in it, a tool search's answer, is the referenced tool's definition, which loads it); `tools`
custom tools (`input_schema` their parameters; one with `defer_loading` is not rendered with the others, as Anthropic
shows it only where a tool_reference loads it, and may be called from then on); `max_tokens` (required, as Anthropic
requires it; past what the prompt leaves of the context it is refused saying by how much, in Anthropic's words),
`temperature`, `top_p`, `top_k`, `stop_sequences` (chat's stop strings), `stream` and `tool_choice` `{"type": "auto"}`
act, `metadata` labels.
`cache_control` (Anthropic's prompt caching, top-level or on a block) is accepted: caching changes no answer, and an
episode's calls go to the worker holding its prefix anyway. At their neutral values only, as Claude Code sends them:
`thinking` disabled or adaptive, displayed as nothing or as progress updates (the model thinks or not as its template
has it; no thinking block is returned, and it writes no updates apart from its reply; another display, or a
`block_binding`, is refused in Anthropic's words for one its model does not take), `context_management` edits that
clear thinking (none is accepted, so none is cleared), `output_config.effort` "high" (Anthropic's default; any other
is refused in Anthropic's own words for a model without effort, on which Claude Code sends its call again without
one). A last assistant turn (Anthropic continues it: a
prefill) is refused, since a chat template closes it; so are images and documents, server tools, a forced or forbidden
tool call, `disable_parallel_tool_use`, any other thinking, context edit or output config (a JSON reply format) and any
other field. Its refusals are sent in Anthropic's error shape (`RequestError.anthropic_body`), the message starting with
the field. Headers (`anthropic-version`, `anthropic-beta`) and the query (`?beta=true`) are not read: the body's fields
are what a beta asks for, and they are checked here.
"""

import json
from dataclasses import dataclass

from rlsys.api.messages import InvalidMessage, generation_setting

MAX_BODY_BYTES = 2**20
MAX_JSON_DEPTH = 64  # deeper than any tool schema; the chat template and json.dumps recurse through what they get
MAX_STOP_STRINGS = 16  # each is searched for after every generated token
MAX_STOP_CHARS = 256
ROLES = {"system", "developer", "user", "assistant", "tool"}
# Request fields that are GenerationConfig fields of the same name (max_tokens is apart: it has two names, and
# the context bounds it too).
SAME_NAMED_SETTINGS = ("n", "temperature", "top_p", "top_k", "seed")  # top_k: vLLM's extension
# /v1/responses fields that act (or, as `metadata` and `user`, label the call and change nothing), and those accepted
# at their neutral value only -> (neutral values, why no other is); a field in neither is refused.
RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "store", "metadata",
                    "user", "safety_identifier", "prompt_cache_key", "include"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one extra output of `include` returned
RESPONSES_NEUTRAL = {
    "previous_response_id": ((None,), "this endpoint keeps no responses between calls (nothing is stored); send the "
                                      "whole conversation as input"),
    "conversation": ((None,), "this endpoint keeps no conversations; send the whole conversation as input"),
    "truncation": (("disabled",), "the conversation is never truncated; a call past the context is refused"),
    "top_logprobs": ((0,), "alternatives to each token's logprob are not listed"),
    "text": (({"format": {"type": "text"}},), "replies are sampled unconstrained"),
    "reasoning": (({},), "no reasoning effort or summary is applied"),
    "background": ((False,), "calls are answered while their client waits"),
    "service_tier": (("auto", "default"), "calls are served on one tier"),
}
# /v1/messages fields that act (`metadata` labels the call; `cache_control` asks Anthropic to cache the prompt, which
# changes no answer); `thinking`, `context_management` and `output_config` are accepted at their neutral values
# (_refuse_unhonoured_messages), any other field refused.
MESSAGES_FIELDS = {"model", "max_tokens", "system", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k",
                   "stop_sequences", "stream", "metadata", "cache_control", "thinking", "context_management",
                   "output_config"}
# How adaptive thinking may be shown, where the model thinks as it decides (as its chat template has it) and no thinking
# block is returned: as nothing (Claude Code's "omitted"), or as the short progress updates the model writes between
# tool calls ("updates", the anthropic client's beta), which it writes none of apart from its reply.
THINKING_DISPLAYS = (None, "omitted", "updates")
CLEAR_THINKING = "clear_thinking_20251015"  # the context edit that clears nothing here: no thinking block is accepted
RESPONSES_ROLES = {"system", "developer", "user", "assistant"}
# An API's tool shape, as a refusal describes it, and where in a tool its parameters schema is.
TOOL_SHAPES = {
    "chat": ('{"type": "function", "function": {"name": a non-empty string, "parameters": a JSON schema}}',
             "function.parameters"),
    "responses": ('{"type": "function", "name": a non-empty string, "parameters": a JSON schema} (this endpoint runs '
                  'no built-in tools)', "parameters"),
    "messages": ('{"name": a non-empty string, "input_schema": a JSON schema} (a custom tool: this endpoint runs no '
                 'server tools)', "input_schema"),
}
# Settings no engine here applies -> the value that asks for nothing (as OpenAI's and vLLM's defaults do).
NEUTRAL_SETTINGS = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0,
                    "top_logprobs": 0}

CONTEXT_OVERFLOW = "context_length_exceeded"  # OpenAI's error code for a prompt past the model's context

# Anthropic's error types by status; its others are 4xx invalid_request_error and 5xx api_error.
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error"}


class RequestError(Exception):
    """A request the endpoint refuses, or a call it could not answer (a 5xx): an HTTP status and OpenAI's error
    body. Its `error_type` is OpenAI's type for the status unless given (vLLM's refusals carry their own)."""

    def __init__(self, status: int, message: str, code: str | int | None = "invalid_request_error",
                 param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.error_type = error_type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's error shape, as /v1/messages answers it: no param, so the message names the field."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def _invalid(param: str, reason: str) -> RequestError:
    return RequestError(400, f"{param} {reason}", "invalid_value", param)


def _vllm_refusal(message: str, param: str, value: int, code: str | int = 400) -> RequestError:
    """A refusal as vLLM's OpenAI server answers a request its checks refuse (a VLLMValidationError, which its
    create_error_response words with the parameter and value, its type "BadRequestError" and its code the status,
    unless `code` is given)."""
    return RequestError(400, f"{message} (parameter={param}, value={value})", code, param, "BadRequestError")


def too_large() -> RequestError:
    return RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes", "request_too_large")


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the model and of the reply."""

    settings: dict  # the GenerationConfig fields the request sets
    stop: list[str]  # the reply ends before the first of these
    logprobs: bool  # each choice lists its tokens' logprobs
    return_token_ids: bool  # the extension: the prompt's and each choice's token ids
    stream: bool  # the reply is sent as Server-Sent Events
    include_usage: bool  # a streamed reply ends with a chunk of usage
    budget_param: str  # the request's name for the reply's budget (`settings["max_new_tokens"]`), which a refusal names
    api: str  # the API called ("chat", "completions", "responses", "messages"), whose words a refusal is in


def json_body(raw: bytes) -> dict:
    """The body as a JSON object, or RequestError(400) saying why it is not one."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _refuse_deep_or_unencodable(body)
    return body


def _refuse_deep_or_unencodable(value) -> None:
    """Walked without recursion, so the check itself cannot overflow the stack. JSON may escape a lone UTF-16
    surrogate ("\\ud800"): no tokenizer takes the string it makes, so it is refused here."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((key, depth) for key in value)
            stack.extend((child, depth + 1) for child in value.values())
        elif isinstance(value, list):
            stack.extend((child, depth + 1) for child in value)
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise RequestError(400, "the request body holds a string that is not valid Unicode (a lone "
                                        "surrogate)") from None


def chat_request(body: dict) -> tuple[list[dict], list[dict], Sampling]:
    """The messages, the tools and the sampling of a /v1/chat/completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        _message(message, f"messages[{i}]")
    tools = _tools(body.get("tools"))
    _tool_choice(body, tools)
    for legacy, neutral in (("functions", (None, [])), ("function_call", (None, "auto", "none"))):
        if body.get(legacy) not in neutral:
            raise _invalid(legacy, 'is not supported (the legacy form of "tools" and "tool_choice"): send "tools"')
    return messages, tools, _sampling(body, completion=False)


def responses_request(body: dict) -> tuple[list[dict], list[dict], Sampling]:
    """The chat messages, chat tools and sampling a /v1/responses body asks for."""
    for name, value in body.items():
        if value is None or name in RESPONSES_FIELDS:
            continue
        if name not in RESPONSES_NEUTRAL:
            raise _invalid(name, "is not supported by this endpoint's /v1/responses; leave it out")
        neutral, reason = RESPONSES_NEUTRAL[name]
        if value not in neutral or type(value) is not type(neutral[0]):  # false is not the neutral 0
            raise _invalid(name, f"is not supported: {reason}; send {json.dumps(neutral[0])} or leave it out")
    _flag(body, "store")  # accepted either way: nothing is kept (the module's docstring)
    instructions = body.get("instructions")
    if not isinstance(instructions, (str, type(None))):
        raise _invalid("instructions", "must be a string or null")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input_messages(body.get("input"))
    # Flat function tools (`{"type": "function", "name", "description", "parameters"}`) in chat's shape. `strict`
    # (the Agents SDK's default) is not sampled constrained, as chat's is not: a call is checked against the schema
    # and one that does not fit is returned as text and counted a decode error (rlsys/endpoint/session.py).
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in _tools(body.get("tools"), "responses")]
    _tool_choice(body, tools)
    settings = {name: _setting(name, body[name], name) for name in ("temperature", "top_p")
                if body.get(name) is not None}
    _max_new_tokens(body, "max_output_tokens", settings)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is not None:  # chat's option, not this API's
        raise _invalid("stream_options.include_usage", "is not a Responses stream option: the usage comes with "
                                                       "response.completed")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(item == LOGPROBS_INCLUDE for item in include)):
        raise _invalid("include", f'is not supported but for "{LOGPROBS_INCLUDE}" (each output token\'s logprob): no '
                                  f'other extra output (encrypted reasoning, sources) is returned; send '
                                  f'["{LOGPROBS_INCLUDE}"], [] or leave it out')
    stream, _ = _stream(body)
    return messages, tools, Sampling(settings, [], LOGPROBS_INCLUDE in (include or []), False, stream, False,
                                     "max_output_tokens", "responses")


def _input_messages(items) -> list[dict]:
    """A Responses `input` as chat messages."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _invalid("input", "must be a non-empty string or list of input items")
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in RESPONSES_ROLES:
                raise _invalid(f"{where}.role", f"must be one of {sorted(RESPONSES_ROLES)}")
            messages.append({"role": item["role"], "content": _input_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise _invalid(where, "must be a function call whose call_id, name and arguments are strings")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
            messages[-1].setdefault("tool_calls", []).append(call)  # one turn's calls, and its text, are one turn
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _invalid(f"{where}.call_id", "must be a string")
            output = _input_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise _invalid(where, f'must be a message, a function_call or a function_call_output item (got type '
                                  f'{kind!r}): this endpoint keeps no items and runs no built-in tools')
    return messages


def _input_text(content, where: str, kinds: tuple[str, ...] = ("input_text", "output_text"),
                tools: dict[str, dict] | None = None, loaded: list[str] | None = None) -> str:
    """Content as its text: a string, or a list of text parts of `kinds` (the Responses API's parts by default; the
    Messages API's are `text` blocks). In a tool result (`tools` the request's tools by name) a `tool_reference` block
    is the named tool's definition, on a line of its own, and its name is added to `loaded`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
            raise _invalid(f"{where}[{j}]", "must be a content part object whose text is a string")
        if part.get("type") not in kinds:  # an image, a file: the model would answer without it
            raise _invalid(f"{where}[{j}]", f'must be a part of type {" or ".join(kinds)}: this model reads text only '
                                            f'(got type {part.get("type")!r})')
        if part["type"] == "tool_reference":
            texts.append(("\n" if texts else "") + _tool_definition(part, f"{where}[{j}]", tools, loaded))
        else:
            texts.append(part.get("text", ""))
    return "".join(texts)


def _tool_definition(reference: dict, where: str, tools: dict[str, dict], loaded: list[str]) -> str:
    """A tool_reference (Claude Code's ToolSearch answers with them) loads a deferred tool: Anthropic shows the model
    its definition where the reference stands in the conversation, the tools ahead of it unchanged (so is a cached
    prompt), and the model may call it from then on. Here that definition is the tool as the chat template is given
    tools, as JSON."""
    name = reference.get("tool_name")
    if not isinstance(name, str) or name not in tools:
        raise _invalid(f"{where}.tool_name", f"must name one of this request's tools (got {name!r})")
    loaded.append(name)
    return json.dumps(tools[name], ensure_ascii=False)


def messages_request(body: dict) -> tuple[list[dict], list[dict], list[dict], Sampling]:
    """The chat messages, the chat tools rendered ahead of them, the deferred tools a tool_reference loaded (in chat's
    shape: the model may call them too) and the sampling a /v1/messages body (Anthropic's Messages API) asks for."""
    for name, value in body.items():
        if value is not None and name not in MESSAGES_FIELDS:
            raise _invalid(name, "is not supported by this endpoint's /v1/messages; leave it out")
    if body.get("max_tokens") is None:
        raise _invalid("max_tokens", "is required: the Messages API asks every call for its reply's budget")
    for name in ("metadata", "cache_control", "context_management", "output_config"):
        if not isinstance(body.get(name), (dict, type(None))):
            raise _invalid(name, "must be an object or null")
    _refuse_unhonoured_messages(body)
    declared = _tools(body.get("tools"), "messages")
    # A tool whose loading is deferred is not shown to the model with the others: a tool_reference in a tool result
    # (a tool search's answer) shows its definition there and loads it (_tool_definition).
    deferred = {t["name"] for i, t in enumerate(declared) if _flag(t, "defer_loading", f"tools[{i}].defer_loading")}
    definitions = {t["name"]: {"type": "function", "function": {
        **{k: t[k] for k in ("name", "description") if k in t},
        **({"parameters": t["input_schema"]} if "input_schema" in t else {})}} for t in declared}
    system = body.get("system")
    system = _input_text(system, "system", ("text",)) if system is not None else ""
    messages = [{"role": "system", "content": system}] if system else []
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _invalid("messages", "must be a non-empty list of message objects")
    referenced = []
    for i, turn in enumerate(turns):
        messages += _anthropic_turn(turn, f"messages[{i}]", definitions, referenced)
    if turns[-1].get("role") == "assistant":  # Anthropic continues a last assistant turn; a chat template closes it
        raise _invalid(f"messages[{len(turns) - 1}].role", "must be user or system: a prefilled assistant reply is not "
                                                            "continued by this endpoint")
    tools = [definitions[t["name"]] for t in declared if t["name"] not in deferred]
    loaded = [definitions[name] for name in dict.fromkeys(referenced) if name in deferred]  # once each, in order
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _invalid("tool_choice", 'must be {"type": "auto"} or null')
        _tool_choice({"tool_choice": choice["type"]}, tools)  # "auto" acts; a forced or forbidden call is refused
        if _flag(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use") and tools:
            raise _invalid("tool_choice.disable_parallel_tool_use", "true is not supported: the model may call several "
                                                                    "tools in a turn; send false or leave it out")
    settings = {name: _setting(name, body[name], name) for name in ("temperature", "top_p", "top_k")
                if body.get(name) is not None}
    _max_new_tokens(body, "max_tokens", settings)
    stream, _ = _stream(body)
    return messages, tools, loaded, Sampling(settings, _stop_strings(body, "stop_sequences"), False, False, stream,
                                             False, "max_tokens", "messages")


def _refuse_unhonoured_messages(body: dict) -> None:
    """`thinking`, `context_management` and `output_config` at any value but one that asks nothing of this model."""
    _thinking(body.get("thinking"))
    edits = (body.get("context_management") or {}).get("edits")
    if not isinstance(edits, (list, type(None))):
        raise _invalid("context_management.edits", "must be a list of context edits or null")
    for i, edit in enumerate(edits or []):
        if not (isinstance(edit, dict) and edit.get("type") == CLEAR_THINKING):
            raise _invalid(f"context_management.edits[{i}]", f"is not supported but as a {CLEAR_THINKING} edit "
                                                             f"(which clears nothing: no thinking block is accepted): "
                                                             f"the model is prompted with the conversation as sent, no "
                                                             f"tool result cleared")
    for key, value in (body.get("output_config") or {}).items():
        if key == "effort" and value not in (None, "high"):
            # Anthropic's words for a model without effort: Claude Code (and so the Agent SDK) reads them and sends
            # its request again without the effort, as it does to Anthropic's own such models.
            raise _invalid("output_config.effort", 'is not supported but as "high" (Anthropic\'s default, which asks '
                                                   'nothing of it): this model does not support the effort parameter; '
                                                   'send "high" or leave it out')
        if key != "effort" and value is not None:  # `format`: a JSON reply; `task_budget`
            raise _invalid(f"output_config.{key}", "is not supported: replies are sampled unconstrained, with no "
                                                   "budget but max_tokens; leave it out")


def _thinking(thinking) -> None:
    """Thinking disabled or adaptive, shown as THINKING_DISPLAYS allow; any other refused, a display or key of adaptive
    thinking in Anthropic's words for one its model does not take (Claude Code reads them and sends its call again
    without it)."""
    if thinking in (None, {"type": "disabled"}):
        return
    if not (isinstance(thinking, dict) and thinking.get("type") == "adaptive"):
        raise _invalid("thinking", 'is not supported but as {"type": "disabled"} or {"type": "adaptive"} (the model '
                                   'thinks or not as its chat template has it): no budget is applied and no thinking '
                                   'block is returned; leave it out or send one')
    for key, value in thinking.items():
        if key == "display" and value not in THINKING_DISPLAYS:
            raise RequestError(400, "thinking.adaptive.display: Input should be 'omitted' or 'updates' (no thinking "
                                    "block is returned: the model thinks or not as its chat template has it)",
                               "invalid_value", "thinking.adaptive.display")
        if key not in ("type", "display") and value is not None:  # block_binding: no thinking block is accepted
            raise RequestError(400, f"thinking.adaptive.{key}: Extra inputs are not permitted",
                               "invalid_value", f"thinking.adaptive.{key}")


def _anthropic_turn(turn, where: str, tools: dict[str, dict], loaded: list[str]) -> list[dict]:
    """A Messages API turn as chat messages: an assistant turn's text and tool_use blocks one assistant message; a user
    turn's tool_result blocks a tool message each and its text a user message, in their order. The names of the tools
    its tool results reference (`tools` the request's, by name) are added to `loaded`."""
    if not isinstance(turn, dict):
        raise _invalid(where, "must be a message object")
    role, content = turn.get("role"), turn.get("content")
    if role not in ("user", "assistant", "system"):
        raise _invalid(f"{where}.role", "must be one of ['assistant', 'system', 'user']")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":  # a system turn among the messages (Claude Code's): text only, a chat system message there
        return [{"role": role, "content": _input_text(content, f"{where}.content", ("text",))}]
    if not isinstance(content, list):
        raise _invalid(f"{where}.content", "must be a string or a list of content blocks")
    messages, kinds = [], ("text", "tool_use") if role == "assistant" else ("text", "tool_result")
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds:  # an image, a document: the model would answer without it
            raise _invalid(at, f"must be a {' or '.join(kinds)} block in a {role} turn: this model reads text only "
                               f"(got type {kind!r})")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _invalid(f"{at}.text", "must be a string")
            text = block["text"]
            if messages and messages[-1]["role"] == role:  # a turn's text blocks are one message
                messages[-1]["content"] = (messages[-1]["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise _invalid(at, "must be a tool_use block whose id and name are strings and input an object")
            call = {"id": block["id"], "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}
            if not messages:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            if not isinstance(block.get("tool_use_id"), str):
                raise _invalid(f"{at}.tool_use_id", "must be a string")
            # A chat tool message has no error flag: the model reads that a call failed from the result's text.
            _flag(block, "is_error", f"{at}.is_error")
            output = block.get("content")
            output = _input_text(output, f"{at}.content", ("text", "tool_reference"), tools, loaded) \
                if output is not None else ""
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
    return messages or [{"role": role, "content": ""}]  # an empty reply comes back as no blocks: still its turn


def completion_request(body: dict, vocab_size: int) -> tuple[str | list[int], Sampling]:
    """The prompt (text, or token ids below `vocab_size`) and the sampling of a /v1/completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(type(t) is int and 0 <= t < vocab_size for t in prompt)
    if not (isinstance(prompt, str) or ids) or not prompt:
        raise _invalid("prompt", f"must be a non-empty string or list of token ids below {vocab_size} (one prompt "
                                 f"per call)")
    if _flag(body, "echo"):
        raise _invalid("echo", "is not supported: a choice's text is the completion alone; send false or leave it out")
    if body.get("suffix") not in (None, ""):
        raise _invalid("suffix", "is not supported: the model continues the prompt, it does not fill in before a "
                                 "suffix; send null or leave it out")
    sampling = _sampling(body, completion=True)
    n, best_of = sampling.settings.get("n", 1), body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != n):
        raise _invalid("best_of", f"is not supported: every sample is returned, none chosen among more; send n ({n}) "
                                  f"or leave it out")
    return prompt, sampling


def _sampling(body: dict, completion: bool) -> Sampling:
    _refuse_unhonoured(body)
    settings = {name: _setting(name, body[name], name) for name in SAME_NAMED_SETTINGS if body.get(name) is not None}
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _max_new_tokens(body, param, settings)
    stop = _stop_strings(body, "stop")
    return Sampling(settings, stop, _logprobs(body, completion), _flag(body, "return_token_ids"), *_stream(body), param,
                    "completions" if completion else "chat")


def _stop_strings(body: dict, param: str) -> list[str]:
    stop = body.get(param)
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise _invalid(param, f"must be a string or a list of at most {MAX_STOP_STRINGS} strings, each of at most "
                              f"{MAX_STOP_CHARS} characters")
    return stop


def _max_new_tokens(body: dict, param: str, settings: dict) -> None:
    """`body[param]`, the reply's budget, into `settings` as max_new_tokens; bounded by the context in reply_budget."""
    if body.get(param) is not None:
        settings["max_new_tokens"] = _setting("max_new_tokens", body[param], param)


def reply_budget(sampling: Sampling, default: int, prompt_length: int, context: int) -> int:
    """The most new tokens the call's reply takes: what it asks (`default` where it asks nothing), within the context
    its `prompt_length` tokens leave; or the call refused, in the words of its API.

    On the OpenAI paths as vLLM's OpenAI server answers, in the order it checks: a budget past the whole context is
    refused, then a prompt past it (`context_overflow`: a chat or Responses call's with OpenAI's own body for it); a
    budget within it is cut to what the prompt leaves, and a prompt that leaves nothing is refused as vLLM refuses the
    budget of 0 it leaves. On /v1/messages as Anthropic's API answers: a prompt past the context is "prompt is too
    long", and a prompt and max_tokens that together are past it are refused saying both numbers, nothing cut: Claude
    Code reads them and asks again for what the context leaves, less a margin of its own (or, where that is under its
    floor of output tokens, ends the call)."""
    asked, param = sampling.settings.get("max_new_tokens"), sampling.budget_param
    budget = default if asked is None else asked
    if sampling.api == "messages":  # no `param` in its refusals: the message starts with the field at fault, if one
        if prompt_length > context:
            raise context_overflow(sampling.api, prompt_length, context)
        if prompt_length + budget > context:
            raise _invalid(param, f"is more than the context leaves: input length and `{param}` exceed context limit: "
                                  f"{prompt_length} + {budget} > {context}, decrease input length or `{param}` and "
                                  f"try again")
        return budget
    if asked is not None and asked > context:
        raise _vllm_refusal(f"{param}={asked} cannot be greater than max_model_len={context}. Please request fewer "
                            f"output tokens.", param, asked)
    if prompt_length > context:
        raise context_overflow(sampling.api, prompt_length, context)
    budget = min(budget, context - prompt_length)
    if budget < 1:  # vLLM's sampling check, under the name it gives the budget whatever the request's
        raise _vllm_refusal(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
    return budget


def context_overflow(api: str, prompt_length: int, context: int) -> RequestError:
    """A prompt of `prompt_length` tokens past the `context`, refused in the words and fields by which the clients of
    `api` tell a context overflow from any bad request (and so can shorten their history and call again).

    /v1/chat/completions: OpenAI's body for its current models; LangChain's ChatOpenAI reads its message (the openai
    client words an error from the message alone). /v1/responses: OpenAI's Responses API's body, its message OpenAI's
    Responses sentence and then its chat one: ChatOpenAI reads the chat one from a 400 and "exceeds the context window"
    from a failed stream, which is how a streamed call is answered (`EpisodeSession.respond`); LiteLLM reads OpenAI's
    code in the body, sent indented as OpenAI sends it (rlsys/endpoint/server.py). /v1/completions: vLLM's words, with
    OpenAI's code where vLLM puts the status (LiteLLM reads "This model's maximum context length is"). /v1/messages:
    Anthropic's "prompt is too long", whose numbers Claude Code reads."""
    if api == "messages":
        return RequestError(400, f"prompt is too long: {prompt_length} tokens > {context} maximum")
    if api == "chat":
        return RequestError(400, f"Input tokens exceed the configured limit of {context} tokens. Your messages "
                                 f"resulted in {prompt_length} tokens. Please reduce the length of the messages.",
                            CONTEXT_OVERFLOW, "messages")
    if api == "responses":
        return RequestError(400, f"Your input exceeds the context window of this model. Input tokens exceed the "
                                 f"configured limit of {context} tokens. Your input resulted in {prompt_length} "
                                 f"tokens. Please adjust your input and try again.", CONTEXT_OVERFLOW, "input")
    return _vllm_refusal(f"This model's maximum context length is {context} tokens. However, your prompt contains "
                         f"{prompt_length} input tokens, which exceeds this limit even without any output tokens. "
                         f"Please reduce the length of the input prompt.", "input_tokens", prompt_length,
                         CONTEXT_OVERFLOW)


def _tool_choice(body: dict, tools: list[dict]) -> None:
    if body.get("tool_choice") not in (None, "auto") and not (body["tool_choice"] == "none" and not tools):
        raise _invalid("tool_choice", '"auto" (or null) is the only choice supported: the model decides whether to '
                                      'call a tool; forcing or forbidding a call is not')
    _flag(body, "parallel_tool_calls")  # true, false or null
    if body.get("parallel_tool_calls") is False and tools:
        raise _invalid("parallel_tool_calls", "false is not supported: the model may call several tools in a turn; "
                                              "send true or leave it out")


def _stream(body: dict) -> tuple[bool, bool]:
    """Whether the reply is streamed, and whether the stream ends with usage."""
    stream, options = _flag(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise _invalid("stream_options", "must be an object or null")
    for key in options:
        if key not in ("include_usage", "include_obfuscation"):
            raise _invalid(f"stream_options.{key}", "is not supported: the stream options are include_usage and "
                                                   "include_obfuscation")
    # Obfuscation pads each chunk against a network observer inferring its text from its size: the endpoint's
    # clients are on this host, and no chunk here is padded.
    if _flag(options, "include_obfuscation", "stream_options.include_obfuscation"):
        raise _invalid("stream_options.include_obfuscation", "is not supported: chunks are not padded; send false "
                                                              "or leave it out")
    return True, _flag(options, "include_usage", "stream_options.include_usage")


def _refuse_unhonoured(body: dict) -> None:
    for name, neutral in NEUTRAL_SETTINGS.items():
        value = body.get(name)
        if value is not None and (type(value) not in (int, float) or value != neutral):
            raise _invalid(name, f"is not supported: send {neutral} or leave it out (got {value!r})")
    if body.get("logit_bias") not in (None, {}):
        raise _invalid("logit_bias", "is not supported: send {} or leave it out")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _invalid("response_format", 'is not supported: send {"type": "text"} or leave it out (replies are '
                                          'sampled unconstrained)')


def _setting(name: str, value, param: str):
    try:
        return generation_setting(name, value, param)
    except InvalidMessage as e:
        raise RequestError(400, str(e), "invalid_value", param) from None


def _logprobs(body: dict, completion: bool) -> bool:
    """Chat asks with true/false; completions with how many alternatives to list beside each token's own logprob,
    and no engine here returns alternatives: 0 (as `top_logprobs` must be, NEUTRAL_SETTINGS)."""
    if not completion:
        return _flag(body, "logprobs")
    value = body.get("logprobs")
    if value is not None and (type(value) is not int or value != 0):
        raise _invalid("logprobs", f"must be 0 (each token's own logprob; alternatives are not listed) or null, "
                                   f"got {value!r}")
    return value is not None


def _flag(body: dict, key: str, param: str | None = None) -> bool:
    """`body[key]` as true, false or null (false); `param` names it in a refusal (the key itself by default)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _invalid(param or key, "must be true, false or null")
    return bool(value)


def _message(message, where: str) -> None:
    """Everything `rlsys.endpoint.conversation` reads of a message: its role, text, tool calls and call id."""
    if not isinstance(message, dict):
        raise _invalid(where, "must be a message object")
    if not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        raise _invalid(f"{where}.role", f"must be one of {sorted(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise _invalid(f"{where}.content[{j}]", "must be a content part object whose text is a string")
            if part.get("type", "text") != "text":  # an image, audio, a file: the model would answer without it
                raise _invalid(f"{where}.content[{j}]", f'must be a text part: this model reads text only (got type '
                                                        f'{part["type"]!r})')
    elif content is not None and not isinstance(content, str):
        raise _invalid(f"{where}.content", "must be a string, a list of content parts or null")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise _invalid(f"{where}.tool_calls", "must be a list of tool calls or null")
    for j, call in enumerate(calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), (str, dict, type(None)))):
            raise _invalid(f"{where}.tool_calls[{j}]", 'must be {"function": {"name": a string, "arguments": a JSON '
                                                       'string}}')
    if not isinstance(message.get("tool_call_id"), (str, type(None))):
        raise _invalid(f"{where}.tool_call_id", "must be a string or null")


def _tools(tools, api: str = "chat") -> list[dict]:
    """Function tools whose parameters schema is what tool calls are checked against (rlsys.api.tool), in the shape
    of `api`: chat's `{"type": "function", "function": {...}}`, the Responses API's flat `{"type": "function", "name",
    "parameters"}`, or the Messages API's `{"name", "input_schema"}` (its type "custom" or absent)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list of function tools or null")
    shape, schema = TOOL_SHAPES[api]
    for i, tool in enumerate(tools):
        if api == "chat":
            function = tool.get("function") if isinstance(tool, dict) else None
        elif api == "responses":  # its other types are OpenAI's built-in tools
            function = tool if isinstance(tool, dict) and tool.get("type") == "function" else None
        else:  # a custom tool; Anthropic's server tools (bash, web search) carry a type of their own
            function = tool if isinstance(tool, dict) and tool.get("type", "custom") == "custom" else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise _invalid(f"tools[{i}]", f"must be {shape}")
        parameters = function.get(schema.split(".")[-1])
        if parameters is None:
            continue
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
        required = parameters.get("required", []) if isinstance(parameters, dict) else None
        if not (isinstance(properties, dict) and all(isinstance(p, dict) for p in properties.values())
                and isinstance(required, list) and all(isinstance(name, str) for name in required)):
            raise _invalid(f"tools[{i}].{schema}", "must be a JSON schema object: properties an object of objects, "
                                                  "required a list of names")
    return tools
