"""Replies as Server-Sent Events, as OpenAI streams them (`"stream": true`).

The engine replies whole: the inference worker returns a request's complete generation through the episode's
queues. So a streamed call is generated, recorded and answered by the same code as the call unstreamed, and only
then is its reply split into chunks, all sent at once. The client reassembles the same reply, the training record
is the same, and anything refused before the model answers (a bad field, an ended episode) is still an HTTP error
status with OpenAI's error body: no byte of the stream has been sent by then.

A chat choice comes as a chunk with `{"role": "assistant", "content": ""}`, then one with its whole content, then
one with its whole tool calls (each with its `index`, `id`, `type` and `function`), then one with an empty delta and
its finish reason; a completion choice as one chunk with its text and finish reason. A chat choice's logprobs and
token ids ride on its last chunk before the finish, a completion choice's on its chunk. With
`stream_options.include_usage` the last chunk has no choices and the call's usage, and every other chunk `"usage":
null`. The chunks share the reply's id, created and model; the first carries the extension's `prompt_token_ids`.
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
    # Encoded as Starlette's JSONResponse encodes the unstreamed reply.
    events = [f"data: {json.dumps(c, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"
              for c in chunks]
    return Response("".join(events) + "data: [DONE]\n\n", media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"})


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
