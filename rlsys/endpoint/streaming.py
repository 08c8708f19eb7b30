"""Replies as Server-Sent Events, as OpenAI (and, for /v1/messages, Anthropic) streams them (`"stream": true`).

The engine replies whole: the inference worker returns a request's complete generation through the episode's
queues. So a streamed call is generated, recorded and answered by the same code as the call unstreamed, and only
then is its reply split into chunks, all sent at once. The client reassembles the same reply, the training record
is the same, and anything refused before the model answers (a bad field, an ended episode) is still an HTTP error
status with OpenAI's error body: no byte of the stream has been sent by then (but for a Responses call past the
context, below).

A chat choice comes as a chunk with `{"role": "assistant", "content": ""}`, then one with its whole content, then
one with its whole tool calls (each with its `index`, `id`, `type` and `function`), then one with an empty delta and
its finish reason; a completion choice as one chunk with its text and finish reason. A chat choice's logprobs and
token ids ride on its last chunk before the finish, a completion choice's on its chunk. With
`stream_options.include_usage` the last chunk has no choices and the call's usage, and every other chunk `"usage":
null`. The chunks share the reply's id, created and model; the first carries the extension's `prompt_token_ids`.

A /v1/responses reply is sent as that API's typed events (`event: <type>` and `data: <json>`, numbered by
`sequence_number`, no `[DONE]`): `response.created` and `response.in_progress` with the response as it stands before
any output, then per output item `response.output_item.added`, its content (a message's text as one
`response.content_part.added`, `response.output_text.delta`, `response.output_text.done`, `response.content_part.done`,
the delta and the done with the text's logprobs where `include` asks for them; a function call's arguments as one
`response.function_call_arguments.delta` and `.done`), `response.output_item.done`, and last `response.completed`
(or `response.incomplete`, cut by `max_output_tokens`) with the whole response. A streamed call whose prompt is past
the context is not an HTTP error, as OpenAI streams it: its model takes the call and fails it, so the stream starts
(`response.created`, `response.in_progress`) and ends with an `error` event and `response.failed` (Codex reads a
context overflow from `response.failed`'s code; the openai client raises the `error` event).

A /v1/messages reply (Anthropic's Messages API) is sent as that API's events (`event: <type>`, `data: <json>`):
`message_start` with the message before any content (usage: its input tokens), then per content block
`content_block_start`, one `content_block_delta` (a text block's whole text as a `text_delta`, a tool_use block's
whole input as one `input_json_delta`) and `content_block_stop`, then `message_delta` with the stop reason, stop
sequence and usage, and `message_stop`.
"""

import json
from collections.abc import Iterator

from starlette.responses import Response


def event_stream(response: dict, include_usage: bool) -> Response:
    """`response` (a reply as the unstreamed call gets it) as the events of a stream."""
    head = {key: response[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if response["object"] == "chat.completion" else "text_completion"
    choices = _chat_chunks if response["object"] == "chat.completion" else _completion_chunks
    chunks = [{**head, "choices": [choice]} for choice in choices(response["choices"])]
    if "prompt_token_ids" in response:
        chunks[0]["prompt_token_ids"] = response["prompt_token_ids"]
    if include_usage:
        chunks = [{**chunk, "usage": None} for chunk in chunks] + [{**head, "choices": [], "usage": response["usage"]}]
    return _sse([f"data: {_json(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"])


def response_events(response: dict) -> Response:
    """`response` (a Responses object as the unstreamed call gets it) as the events of a Responses stream."""
    started = {**response, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    events = [("response.created", {"response": started}), ("response.in_progress", {"response": started})]
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            events.append(("response.output_item.added", {"output_index": index,
                                                          "item": {**item, "status": "in_progress", "content": []}}))
            for j, part in enumerate(item["content"]):
                at = {**where, "content_index": j}
                events += [("response.content_part.added", {**at, "part": {**part, "text": "", "logprobs": []}}),
                           ("response.output_text.delta", {**at, "delta": part["text"], "logprobs": part["logprobs"]}),
                           ("response.output_text.done", {**at, "text": part["text"], "logprobs": part["logprobs"]}),
                           ("response.content_part.done", {**at, "part": part})]
        else:  # a function call
            events += [("response.output_item.added", {"output_index": index,
                                                       "item": {**item, "status": "in_progress", "arguments": ""}}),
                       ("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}),
                       ("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                   "arguments": item["arguments"]})]
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append((f"response.{response['status']}", {"response": response}))
    return _numbered_events(events)


def failed_response_events(started: dict, error: dict) -> Response:
    """A Responses call that fails once started, as OpenAI streams it: `response.created` and `response.in_progress`
    with the response `started` (in progress, no output), an `error` event with `error` (OpenAI's error body), and
    `response.failed`, its response's error the code and message."""
    failed = {**started, "status": "failed", "error": {"code": error["code"], "message": error["message"]}}
    return _numbered_events([("response.created", {"response": started}),
                             ("response.in_progress", {"response": started}), ("error", {"error": error}),
                             ("response.failed", {"response": failed})])


def _numbered_events(events: list[tuple[str, dict]]) -> Response:
    """Typed events as the Responses API streams them, numbered by `sequence_number`."""
    return _sse([f"event: {kind}\ndata: {_json({'type': kind, 'sequence_number': i, **data})}\n\n"
                 for i, (kind, data) in enumerate(events)])


def message_events(message: dict) -> Response:
    """`message` (a Messages API reply as the unstreamed call gets it) as the events of an Anthropic stream."""
    started = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {**message["usage"], "output_tokens": 0}}
    events = [("message_start", {"message": started})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:  # a tool_use block: its input as JSON text
            start, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": _json(block["input"])}
        events += [("content_block_start", {"index": index, "content_block": start}),
                   ("content_block_delta", {"index": index, "delta": delta}),
                   ("content_block_stop", {"index": index})]
    events += [("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                            "stop_sequence": message["stop_sequence"]}, "usage": message["usage"]}),
               ("message_stop", {})]
    return _sse([f"event: {kind}\ndata: {_json({'type': kind, **data})}\n\n" for kind, data in events])


def _json(value) -> str:
    """Encoded as Starlette's JSONResponse encodes the unstreamed reply."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _sse(events: list[str]) -> Response:
    return Response("".join(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chat_chunks(choices: list[dict]) -> Iterator[dict]:
    for choice in choices:
        message = choice["message"]
        deltas = [{"role": "assistant", "content": ""}]
        if message["content"]:
            deltas.append({"content": message["content"]})
        if message.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]})
        for delta in deltas[:-1]:
            yield {"index": choice["index"], "delta": delta, "logprobs": None, "finish_reason": None}
        yield {**_extras(choice), "index": choice["index"], "delta": deltas[-1], "finish_reason": None}
        yield {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}


def _completion_chunks(choices: list[dict]) -> Iterator[dict]:
    for choice in choices:
        yield {**_extras(choice), "index": choice["index"], "text": choice["text"],
               "finish_reason": choice["finish_reason"]}


def _extras(choice: dict) -> dict:
    """The choice's logprobs and (the extension) token ids."""
    return {key: choice[key] for key in ("logprobs", "token_ids") if key in choice}
