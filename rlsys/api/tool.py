"""The tool contract: something the model calls by name with JSON arguments, and reads the result of."""

import abc
from dataclasses import dataclass, field
from typing import Any

from rlsys.api.registry import Registry

TOOL_STATUSES = ("ok", "error", "timeout")
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


@dataclass
class ToolOutput:
    """What one call gave back. `text` is what the model reads; `status` and `reason` are for metrics and logs."""

    text: str
    status: str = "ok"  # one of TOOL_STATUSES: "error" covers a failed call, "timeout" a call that ran out of time
    reason: str = ""
    isolation: list[str] = field(default_factory=list)  # for tools that run code: the confinement in force


class Tool(abc.ABC):
    """Implement `call`; register the class with `register_tool`.

    An environment makes one instance per tool for each independent line of an episode (a chain), so
    state a tool keeps (a Python session's variables) belongs to that chain: acquired in `start`,
    released in `stop`, which the environment calls at its close. `parameters` is the JSON schema of the
    keyword arguments `call` takes; the environment checks a call against it before calling. A tool around a
    blocking client may write its methods as plain `def`s: each call then runs on a thread of its own, under the
    environment's time limit.
    """

    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}

    async def start(self) -> None:
        """Acquire per-chain state (a process, a session). Called before the first call."""

    @abc.abstractmethod
    async def call(self, **arguments: Any) -> ToolOutput:
        ...

    async def stop(self) -> None:
        """Release what `start` acquired. Called once, at the end of the episode."""


def argument_errors(parameters: dict, arguments: dict) -> list[str]:
    """What is wrong with `arguments` for a tool with this JSON schema (required, unknown and mistyped keys)."""
    properties = parameters.get("properties", {})
    errors = [f"missing argument {name!r}" for name in parameters.get("required", []) if name not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            errors.append(f"unknown argument {name!r} (takes {sorted(properties)})")
            continue
        expected = properties[name].get("type")  # a list of types, or none, is not checked
        if isinstance(expected, str) and expected in JSON_TYPES and (
                not isinstance(value, JSON_TYPES[expected]) or (isinstance(value, bool) and expected != "boolean")):
            errors.append(f"argument {name!r} must be a JSON {expected}, got {type(value).__name__}")
    return errors


def describe_tool(name: str, tool: type[Tool] | Tool) -> str:
    """One line for the model: `name(arg, ...): description`."""
    return f"{name}({', '.join(tool.parameters.get('properties', {}))}): {tool.description}"


TOOLS: Registry[Tool] = Registry("tool", Tool)


def register_tool(name: str, cls: type[Tool]) -> None:
    TOOLS.register(name, cls)


def make_tool(name: str, args: dict[str, Any] | None = None) -> Tool:
    return TOOLS.make(name, args or {})
