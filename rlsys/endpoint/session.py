"""What one episode's calls do: OpenAI chat, completion and Responses requests and Anthropic Messages requests in, the
episode's model out.

Each request becomes one request on the episode's queues (`rlsys.api.Model`): batched with everything
else by the inference worker, routed to the worker holding the episode's prefix, versioned, and resumed
after a weight update like any agent's. The prompt ids come from the episode's `Conversation` (its own
earlier ids plus the template's rendering of only the new messages); the reply's text is decoded from the
generated ids, which are kept as they are. Tool calls are parsed from that text in the call format of
rlsys/tools/call_format.py and returned as OpenAI `tool_calls`.

Every field a request sets is checked before any of it is used (rlsys/endpoint/request_checks.py).

A /v1/responses call is the chat call its `instructions` and input items make (request_checks.py translates it), so
it is prompted, continued token-exactly and recorded as that chat call would be; only its reply is shaped as a
Responses object: a `message` item with the text (and, where `include` asks, each token's logprob, as chat lists
them) and a `function_call` item per parsed tool call, `status` "incomplete" (`max_output_tokens`) where the reply was
cut by length.

A /v1/messages call (Anthropic's Messages API) is, the same way, the chat call its `system` and `messages` make (a
tool_use block a tool call, a tool_result block a tool message); its reply is shaped as a Message: a `text` block and
a `tool_use` block (its `input` the parsed arguments) per tool call, `stop_reason` "end_turn", "max_tokens",
"stop_sequence" (with the `stop_sequence` hit) or "tool_use".

`"stream": true` gets the same reply as Server-Sent Events, split once the model has answered and the call is
recorded (rlsys/endpoint/streaming.py).

Extension (as vLLM names it): `"return_token_ids": true` adds `prompt_token_ids` to the response and
`token_ids` to each choice.

A call whose client has gone by the time the model answers (its HTTP client timed out; the `openai` client then sends
the same messages again) is answered to nobody and not recorded: no sample holds a reply no client acted on, trained
with a reward it had no part in. A streamed call is checked the same way, before its first chunk is sent; a client
that goes while the chunks are sent had its reply recorded, as one that goes while an unstreamed reply is sent does.
"""

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import jinja2
from starlette.responses import Response

from rlsys.api import GenerationConfig, GenerationOutput, Model
from rlsys.endpoint.conversation import Conversation
from rlsys.endpoint.request_checks import CONTEXT_OVERFLOW, RequestError, Sampling, chat_request, completion_request, \
    messages_request, reply_budget, responses_request
from rlsys.endpoint.streaming import event_stream, failed_response_events, message_events, response_events
from rlsys.tools.call_format import CALL, parse_turn

ClientGone = Callable[[], Awaitable[bool]]  # whether the call's client has disconnected


class EpisodeSession:
    """One episode's endpoint side: its model over the episode's queues and its token-exact record."""

    def __init__(self, model: Model, tokenizer, defaults: GenerationConfig, max_total_tokens: int, model_name: str):
        self.model, self.tokenizer, self.defaults = model, tokenizer, defaults
        self.max_total_tokens, self.model_name = max_total_tokens, model_name
        self.conversation = Conversation(tokenizer)
        self.outputs: list[GenerationOutput] = []  # every reply the engine sent, in call order

    async def chat(self, body: dict, client_gone: ClientGone | None = None) -> dict | Response:
        self.require_chat_template("/v1/chat/completions")
        messages, tools, sampling = chat_request(body)
        output, choices, _ = await self.chat_choices(messages, tools, sampling, client_gone)
        return self.response("chat.completion", output, choices, sampling)

    async def respond(self, body: dict, client_gone: ClientGone | None = None) -> dict | Response:
        """A /v1/responses call: the chat call its input and instructions make, answered as a Responses object."""
        self.require_chat_template("/v1/responses")
        messages, tools, sampling = responses_request(body)
        try:
            output, [choice], _ = await self.chat_choices(messages, tools, sampling, client_gone)
        except RequestError as refused:
            if not (sampling.stream and refused.code == CONTEXT_OVERFLOW):
                raise
            # OpenAI streams this one refusal as a response that fails, not an HTTP error: Codex compacts its history
            # on `response.failed`'s code, and takes a 400 for an invalid request
            return failed_response_events(self.response_object(body, sampling), refused.body()["error"])
        message, length = choice["message"], choice["finish_reason"] == "length"
        status = "incomplete" if length else "completed"
        items = [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                  "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                               "logprobs": choice["logprobs"]["content"] if sampling.logprobs else []}]}
                 ] if message["content"] or not message.get("tool_calls") else []
        items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                   "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
                  for call in message.get("tool_calls") or []]
        generated = len(output.output_ids[0])
        response = {**self.response_object(body, sampling), "status": status, "output": items,
                    "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                    "usage": {"input_tokens": len(output.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": len(output.prompt_ids) + generated}}
        return response_events(response) if sampling.stream else response

    def response_object(self, body: dict, sampling: Sampling) -> dict:
        """A /v1/responses call's Responses object as it stands before any output: in progress, no usage."""
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
                "model": self.model_name, "output": [], "parallel_tool_calls": True,
                "temperature": sampling.settings.get("temperature", self.defaults.temperature),
                "top_p": sampling.settings.get("top_p", self.defaults.top_p),
                "max_output_tokens": body.get("max_output_tokens"),
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [], "usage": None}

    async def message(self, body: dict, client_gone: ClientGone | None = None) -> dict | Response:
        """A /v1/messages call (Anthropic's Messages API): the chat call its system and messages make, answered as a
        Message."""
        self.require_chat_template("/v1/messages")
        messages, tools, loaded, sampling = messages_request(body)
        output, [choice], [stop] = await self.chat_choices(messages, tools, sampling, client_gone, loaded)
        reply = choice["message"]
        content = [{"type": "text", "text": reply["content"]}] if reply["content"] else []
        content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": json.loads(call["function"]["arguments"])} for call in reply.get("tool_calls") or []]
        reason = {"length": "max_tokens", "tool_calls": "tool_use"}.get(choice["finish_reason"],
                                                                        "stop_sequence" if stop else "end_turn")
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": self.model_name,
                   "content": content, "stop_reason": reason,
                   "stop_sequence": stop if reason == "stop_sequence" else None,
                   "usage": {"input_tokens": len(output.prompt_ids), "output_tokens": len(output.output_ids[0])}}
        return message_events(message) if sampling.stream else message

    def require_chat_template(self, path: str) -> None:
        if self.tokenizer.chat_template is None:  # a base model: transformers' ValueError would be a bare 500
            raise RequestError(404, f"this is not a chat model (its tokenizer has no chat template), so it is not "
                                    f"served at {path}: call /v1/completions", "model_not_found", param="model")

    async def chat_choices(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                           client_gone: ClientGone | None, loaded: list[dict] = ()) \
            -> tuple[GenerationOutput, list[dict], list[str | None]]:
        """The engine's output for a chat call, its chat choices and the stop string each was cut at (None: none); the
        call recorded unless its client has gone. The model may call `tools`, rendered ahead of the messages, and
        `loaded`, whose definitions stand among them (a Messages call's tool search loaded them)."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in [*tools, *loaded]}
        try:
            sample, prompt_ids, split = self.conversation.prompt_for(messages, tools)
        except jinja2.TemplateError as e:  # a template may refuse an order of roles, say
            raise RequestError(400, f"the model's chat template refused these messages: {e}", param="messages") \
                from None
        output = await self.generate(prompt_ids, sampling)
        choices, replies, reasons, stops = [], [], [], []
        for i, ids in enumerate(output.output_ids):
            text, stop = self.text(ids, sampling)
            stops.append(stop)
            reply, finish, recorded = self.reply_message(text, schemas, output.stop_reasons[i])
            replies.append(reply)
            reasons.append(recorded)
            choices.append({"index": i, "message": reply, "finish_reason": finish,
                            "logprobs": {"content": self.token_logprobs(output, i)} if sampling.logprobs else None,
                            **self.token_ids(sampling, ids)})
        if not (client_gone and await client_gone()):
            self.conversation.record(messages, sample, prompt_ids, split, output, replies, reasons, tools)
        return output, choices, stops

    async def complete(self, body: dict, client_gone: ClientGone | None = None) -> dict | Response:
        prompt, sampling = completion_request(body, len(self.tokenizer))
        sample, prompt_ids, split = self.conversation.prompt_for_text(prompt)
        output = await self.generate(prompt_ids, sampling)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, clean_up_tokenization_spaces=False)
        choices, replies = [], []
        for i, ids in enumerate(output.output_ids):
            completion, _ = self.text(ids, sampling)
            replies.append({"role": "assistant", "content": completion})
            logprobs = None
            if sampling.logprobs:
                content = self.token_logprobs(output, i)
                logprobs = {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content],
                            "top_logprobs": None, "text_offset": []}
            choices.append({"index": i, "text": completion, "finish_reason": _finish(output.stop_reasons[i]),
                            "logprobs": logprobs, **self.token_ids(sampling, ids)})
        if not (client_gone and await client_gone()):
            self.conversation.record(text, sample, prompt_ids, split, output, replies, list(output.stop_reasons))
        return self.response("text_completion", output, choices, sampling)

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> GenerationOutput:
        gconfig = self.generation_config(sampling, len(prompt_ids))
        try:
            output = await self.model.generate(prompt_ids, gconfig)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this call itself is cancelled
                raise
            # the episode ended while the model generated: its model cancelled the reply this call waited for
            raise RequestError(410, "this API key's episode ended before the model answered", "episode_ended") \
                from None
        output = _cut_at_stop_strings(output, sampling.stop, self.tokenizer)
        self.outputs.append(output)
        # vLLM's "abort" (its shutdown or pause) and "error" (a request-level failure) end a generation that is no
        # answer: a server error, as vLLM's server answers "error", which the client may send again; nothing recorded.
        failed = [reason for reason in output.stop_reasons if reason not in ("stop", "length")]
        if failed:
            raise RequestError(500, f"the model's generation ended with {failed[0]!r}, not an answer: send the call "
                                    f"again", "generation_failed")
        return output

    def generation_config(self, sampling: Sampling, prompt_length: int) -> GenerationConfig:
        """The agent's settings, with what the request sets; no more new tokens than the episode's context leaves (a
        call that does not fit it refused, `reply_budget`)."""
        if prompt_length == 0:  # nothing to continue: the inference worker would set the request aside
            raise RequestError(400, "the prompt is empty: it renders to no tokens", param="prompt")
        budget = reply_budget(sampling, self.defaults.max_new_tokens, prompt_length, self.max_total_tokens)
        settings = {k: v for k, v in sampling.settings.items() if k != "max_new_tokens"}
        single = [ids[0] for ids in (self.tokenizer.encode(s, add_special_tokens=False) for s in sampling.stop)
                  if len(ids) == 1]
        return dataclasses.replace(self.defaults, **settings, max_new_tokens=budget,
                                   stop_token_ids=list(self.defaults.stop_token_ids) + single)

    def text(self, ids: list[int], sampling: Sampling) -> tuple[str, str | None]:
        """What the client reads: the generated text up to the first stop string; and that stop string (None: the
        text holds none)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop = earliest_stop(text, sampling.stop)
        return (text, None) if stop is None else (text[:text.index(stop)], stop)

    def reply_message(self, text: str, schemas: dict, stop_reason: str) -> tuple[dict, str, str]:
        """The assistant message, OpenAI's finish reason, and the sample's recorded stop reason. A turn whose
        calls cannot all be decoded (bad JSON, an unknown tool, wrong arguments) is returned as plain text,
        recorded as `decode_error` and counted: the client sees an answer and the episode ends there."""
        if not schemas:
            return {"role": "assistant", "content": text}, _finish(stop_reason), stop_reason
        parsed = parse_turn(text, schemas)
        if parsed.errors:
            self.conversation.decode_errors += len(parsed.errors)
            return {"role": "assistant", "content": text}, _finish(stop_reason), "decode_error"
        if not parsed.calls:
            return {"role": "assistant", "content": text}, _finish(stop_reason), stop_reason
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
        content = CALL.sub("", text).strip() or None
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls", "tool_calls"

    def token_logprobs(self, output: GenerationOutput, i: int) -> list[dict]:
        """Each token as its text, as OpenAI and vLLM list it (" world", not a byte-level vocabulary's "Ġworld"); a
        token that holds part of a character is the replacement character, as in vLLM."""
        tokens = self.tokenizer.batch_decode([[t] for t in output.output_ids[i]], clean_up_tokenization_spaces=False)
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, output.logprobs[i])]

    @staticmethod
    def token_ids(sampling: Sampling, ids: list[int]) -> dict:
        return {"token_ids": list(ids)} if sampling.return_token_ids else {}

    def response(self, kind: str, output: GenerationOutput, choices: list[dict], sampling: Sampling) -> dict | Response:
        """The reply: a JSON object, or its events where the call asked for a stream."""
        response = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                    "created": int(time.time()), "model": self.model_name, "choices": choices,
                    "usage": {"prompt_tokens": len(output.prompt_ids),
                              "completion_tokens": sum(len(ids) for ids in output.output_ids),
                              "total_tokens": len(output.prompt_ids) + sum(len(ids) for ids in output.output_ids)}}
        if sampling.return_token_ids:
            response["prompt_token_ids"] = list(output.prompt_ids)
        return event_stream(response, sampling.include_usage) if sampling.stream else response


def earliest_stop(text: str, stops: list[str]) -> str | None:
    """The stop string that appears first in `text` (where the client's text ends), if any does."""
    return min((stop for stop in stops if stop and stop in text), key=text.index, default=None)


def _finish(stop_reason: str) -> str:
    return "length" if stop_reason == "length" else "stop"


def _cut_at_stop_strings(output: GenerationOutput, stops: list[str], tokenizer) -> GenerationOutput:
    """Each sample cut right after the first token that completes a stop string (the engine stops on single
    stop tokens itself). The cut ids are the ones kept and trained on; the reply's text leaves the stop out."""
    stops = [s for s in stops if s]
    if not stops:
        return output
    cut = dataclasses.replace(output, output_ids=list(output.output_ids), logprobs=list(output.logprobs),
                              versions=list(output.versions), stop_reasons=list(output.stop_reasons))

    def stopped(ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    for i, ids in enumerate(output.output_ids):
        if not stopped(ids):
            continue
        # The shortest prefix that holds a stop string, by bisection: a longer prefix's text extends a shorter one's
        # (but for a character still incomplete at its end), so a prefix that holds one is followed by others that
        # do. One decode a step: decoding every prefix cost the event loop seconds on a few thousand tokens.
        low, high = 0, len(ids)  # ids[:low] holds none, ids[:high] holds one
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if stopped(ids[:middle]) else (middle, high)
        cut.output_ids[i], cut.logprobs[i] = ids[:high], output.logprobs[i][:high]
        cut.versions[i] = output.versions[i][:high]
        cut.stop_reasons[i] = "stop"
    return cut
