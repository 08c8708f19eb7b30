"""One endpoint episode's token-exact record: what the model saw and produced, call by call.

An OpenAI client sends the whole conversation with every call. Re-tokenizing it would train on tokens
the model never produced (text to tokens is not reversible: separators, tool-call JSON, stripped
reasoning). Instead every sample keeps the exact ids: its prompt, then per call the ids the engine
generated (loss mask 1, their versions and logprobs) and the chat template's rendering of only the
messages the client added since (loss mask 0). A call continues the sample whose messages are a prefix of
the ones it sends (compared as messages: role, text, tool calls with their arguments parsed) under the same
tools, so only the new messages are rendered (a template renders the tools ahead of the messages: a call that adds
or changes one cannot append to what the model saw without it). A call that continues no sample (the client
dropped a turn, stripped reasoning, rewrote a message or changed the tools; or the chat template renders earlier
messages anew once others follow) starts a new sample from the template's rendering of the whole conversation: the
episode is split there, and counted (`history_splits`) once the call is recorded. With `n` > 1 a call forks its
sample into n.
"""

import json
from dataclasses import dataclass, field

from rlsys.api import GenerationOutput, Trajectory
from rlsys.api.trajectory import Transcript
from rlsys.model.tokenizer import messages_after_ids, template_roles
from rlsys.tools.call_format import CALL_CLOSE, CALL_OPEN, tool_response


@dataclass
class Sample:
    """One training sample: its token record and the messages (normalized) it holds."""

    transcript: Transcript
    messages: list  # normalized messages, the last one the model's own turn once a call returned
    turn_ends: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    final_text: str = ""  # the model's last turn as the client got it
    # /v1/completions samples: the text their ids hold, the prompt and the completion whole, with any stop string
    # and special token the model generated (None: a chat sample)
    text: str | None = None
    tools: str = "[]"  # a chat sample's tools, as the template rendered them (JSON)


def normalized(message: dict) -> tuple:
    """What must match for a client's message to be the one the model saw: role, text, tool calls (name and
    parsed arguments, so a client that re-serializes JSON still matches) and the call a tool result answers."""
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: only text reaches a text model
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments")), sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message.get("role"), content, calls, message.get("tool_call_id") or ""


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or JSON no tool takes: a 5,000-digit number, 10,000 `[`
            return arguments
    return arguments


def template_messages(tokenizer, messages: list[dict]) -> list[dict]:
    """Messages as any chat template takes them: tool results become user messages wrapped in
    <tool_response> (Qwen's convention, as the tool-calling agent does), assistant tool calls are written
    in the call format the model produces (rlsys/tools/call_format.py), a developer message is a system message
    to a template without that role (rlsys.model.tokenizer.template_roles)."""
    rendered = []
    for message in messages:
        role, content, calls, _ = normalized(message)
        if role == "tool":
            rendered.append({"role": "user", "content": tool_response(content)})
            continue
        text = content + "".join(f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_CLOSE}'
                                 for name, arguments in calls)
        rendered.append({"role": role, "content": text})
    return template_roles(tokenizer, rendered)


class Conversation:
    """The samples of one episode (one API key)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.samples: list[Sample] = []
        self.history_splits = 0
        self.decode_errors = 0
        self.calls = 0

    def prompt_for(self, messages: list[dict], tools: list[dict] | None) -> tuple[Sample | None, list[int], bool]:
        """The sample a call continues (None: a new one), the prompt ids to generate from, and whether the call splits
        the episode (it continues none of the samples there are). The split is counted when the call is recorded: a
        call refused, or answered to nobody, left no sample."""
        keys, tools_key = [normalized(m) for m in messages], _tools_key(tools)
        for sample in sorted(self.samples, key=lambda s: -len(s.messages)):
            n = len(sample.messages)
            if sample.text is None and n < len(keys) and keys[:n] == sample.messages and sample.tools == tools_key:
                try:
                    return sample, sample.transcript.token_ids + self.new_message_ids(sample, messages[n:]), False
                except ValueError:  # a template that renders earlier turns anew once one follows: no ids to append
                    break
        text = self.tokenizer.apply_chat_template(template_messages(self.tokenizer, messages), tools=tools or None,
                                                  add_generation_prompt=True, tokenize=False)
        return None, self.tokenizer(text, add_special_tokens=False)["input_ids"], bool(self.samples)

    def prompt_for_text(self, prompt: str | list[int]) -> tuple[Sample | None, list[int], bool]:
        """/v1/completions: a prompt continues the completion sample it extends, as ids or as text (then only
        the new text is tokenized); otherwise it starts a new one. Extending as text means extending all the text
        the sample's ids hold: a completion cut at a stop string, or ended with eos, was returned without them, and
        a client that sends them back (ReAct's "Observation:", a template's end of turn) must not be continued from
        ids that hold them already (the model saw them twice); one that sends something else in their place starts
        a new sample."""
        completions = sorted((s for s in self.samples if s.text is not None),
                             key=lambda s: -len(s.transcript.token_ids))
        for sample in completions:
            ids = sample.transcript.token_ids
            if isinstance(prompt, list) and prompt[:len(ids)] == ids:
                return sample, list(prompt), False
            if isinstance(prompt, str) and prompt.startswith(sample.text):
                text_ids = self.tokenizer(prompt[len(sample.text):], add_special_tokens=False)["input_ids"]
                return sample, ids + text_ids, False
        if isinstance(prompt, list):
            return None, list(prompt), bool(self.samples)
        return None, self.tokenizer(prompt, add_special_tokens=False)["input_ids"], bool(self.samples)

    def new_message_ids(self, sample: Sample, messages: list[dict]) -> list[int]:
        """eos if the model's last turn did not end with one (it was cut), then the template's rendering of
        only the new messages and the assistant's prompt."""
        return messages_after_ids(self.tokenizer, sample.transcript.token_ids,
                                  template_messages(self.tokenizer, messages))

    def record(self, messages: list[dict] | str, sample: Sample | None, prompt_ids: list[int], split: bool,
               output: GenerationOutput, replies: list[dict], finish_reasons: list[str],
               tools: list[dict] | None = None) -> None:
        """The call's choices (`messages` is a completion's prompt text, `tools` a chat call's tools): each continues
        (a copy of) the sample, which the call consumed; `split` as `prompt_for` gave it."""
        self.calls += 1
        self.history_splits += split
        if sample is not None:  # by identity: a concurrent call that continued it too may have consumed it already
            self.samples = [s for s in self.samples if s is not sample]
        text = messages if isinstance(messages, str) else None
        keys = [] if text is not None else [normalized(m) for m in messages]
        tools_key = _tools_key(tools)
        for i, reply in enumerate(replies):
            if sample is None:
                transcript = Transcript.of_prompt(prompt_ids)
                turn_ends = []
            else:
                transcript = Transcript(*(list(getattr(sample.transcript, f)) for f in
                                          ("token_ids", "loss_mask", "logprobs", "versions")))
                transcript.add_observation(prompt_ids[len(transcript.token_ids):])
                turn_ends = list(sample.turn_ends)
            transcript.add_generated(_choice(output, i))
            held = None if text is None else text + self.tokenizer.decode(
                output.output_ids[i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            new = Sample(transcript, keys + [normalized(reply)], turn_ends + [len(transcript.token_ids)],
                         (sample.finish_reasons if sample else []) + [finish_reasons[i]], reply.get("content") or "",
                         held, tools_key)
            self.samples.append(new)

    def trajectories(self, reward: float, group_id: str) -> list[Trajectory]:
        """Every sample with a model turn in it, each with the episode's reward at its last turn."""
        metrics = {"calls": float(self.calls), "history_splits": float(self.history_splits),
                   "decode_errors": float(self.decode_errors), "samples": float(len(self.samples))}
        out = []
        for s in self.samples:
            t = s.transcript
            out.append(Trajectory(token_ids=t.token_ids, loss_mask=t.loss_mask, logprobs=t.logprobs,
                                  versions=t.versions, turn_ends=s.turn_ends,
                                  turn_rewards=[0.0] * (len(s.turn_ends) - 1) + [reward], reward=reward,
                                  group_id=group_id, stop_reason=s.finish_reasons[-1],
                                  metrics={**metrics, "turns": float(len(s.turn_ends))}))
        return out

    @property
    def final_text(self) -> str:
        """The model's last answer (of the newest sample): what an environment scores."""
        return self.samples[-1].final_text if self.samples else ""


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def _choice(output: GenerationOutput, i: int) -> GenerationOutput:
    return GenerationOutput(output.qid, output.prompt_ids, [output.output_ids[i]], [output.logprobs[i]],
                            [output.versions[i]], [output.stop_reasons[i]])
