"""The tool-call format: how a model turn asks for tools or gives its final answer.

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
    <answer>408</answer>

A turn may hold several calls (run in order) or one answer (which ends the episode; calls beside an
answer are ignored). Each call is a JSON object with exactly the keys "name" (a registered tool the
environment offers) and "arguments" (an object matching that tool's parameters). A call that cannot be
decoded becomes a DecodeError with the reason, in its place among the calls, so the model is told
what was wrong instead of the episode failing. Results go back as `<tool_response>...</tool_response>`.
"""

import json
import re
from dataclasses import dataclass

from rlsys.api.tool import argument_errors

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
CALL_KEYS = {"name", "arguments"}


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class DecodeError:
    text: str  # what stood between the tags (or after an unclosed one)
    reason: str


@dataclass
class ParsedTurn:
    items: list[ToolCall | DecodeError]  # in the order they appear in the turn
    answer: str | None  # the final answer, if the turn gives one

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[DecodeError]:
        return [item for item in self.items if isinstance(item, DecodeError)]


def parse_turn(text: str, tools: dict[str, dict]) -> ParsedTurn:
    """Finds the calls and the answer in a model turn; `tools` maps each offered tool name to its parameters."""
    rest = CALL.sub("", text)  # an answer tag inside a call (code that prints one) is the call's, not the answer
    answer = ANSWER.search(rest)
    if answer is not None:
        return ParsedTurn([], answer.group(1).strip())
    items: list[ToolCall | DecodeError] = [decode_call(m.group(1), tools) for m in CALL.finditer(text)]
    if CALL_OPEN in rest:
        items.append(DecodeError(rest[rest.index(CALL_OPEN) + len(CALL_OPEN):], f"{CALL_OPEN} without {CALL_CLOSE}"))
    if ANSWER_OPEN in rest:
        items.append(DecodeError(rest[rest.index(ANSWER_OPEN) + len(ANSWER_OPEN):],
                                 f"{ANSWER_OPEN} without {ANSWER_CLOSE}"))
    return ParsedTurn(items, None)


def decode_call(body: str, tools: dict[str, dict]) -> ToolCall | DecodeError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return DecodeError(body, f"not valid JSON: {e}")
    except RecursionError:  # a thousand `[` (a degenerate sample) would otherwise fail the whole episode
        return DecodeError(body, "not valid JSON: nested too deeply")
    except ValueError:  # an integer of over 4,300 digits (a degenerate sample too), which Python refuses to convert
        return DecodeError(body, "a number in it is too long (over 4,300 digits)")
    if not isinstance(call, dict):
        return DecodeError(body, f"a call must be a JSON object with keys {sorted(CALL_KEYS)}")
    if set(call) != CALL_KEYS:
        missing, extra = sorted(CALL_KEYS - set(call)), sorted(set(call) - CALL_KEYS)
        problems = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
        return DecodeError(body, "; ".join(problems))
    name, arguments = call["name"], call["arguments"]
    if not isinstance(name, str) or name not in tools:
        return DecodeError(body, f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
    if not isinstance(arguments, dict):
        return DecodeError(body, "'arguments' must be a JSON object")
    errors = argument_errors(tools[name], arguments)
    if errors:
        return DecodeError(body, f"{name}: {'; '.join(errors)}")
    return ToolCall(name, arguments)


def tool_response(text: str) -> str:
    return f"{RESPONSE_OPEN}{text}{RESPONSE_CLOSE}"


def instructions(tool_lines: list[str]) -> str:
    """What the model is told (as a system message) about the format and the tools it may call."""
    return (f'Call a tool with {CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}; the result comes back '
            f"as {RESPONSE_OPEN}...{RESPONSE_CLOSE}. Give the final answer as {ANSWER_OPEN}...{ANSWER_CLOSE}. "
            "Tools:\n" + "\n".join(tool_lines))


def no_action_hint() -> str:
    """The observation after a turn with neither a call nor an answer (a void turn)."""
    return f"No tool call and no answer found. Call a tool with {CALL_OPEN}...{CALL_CLOSE} or answer with " \
           f"{ANSWER_OPEN}...{ANSWER_CLOSE}."
