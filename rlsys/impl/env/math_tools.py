"""`math-tools`: a math problem the model may work on with tools before it answers.

One instance serves one episode, which may hold several independent chains (a group's samples): an
action is `(chain, turn_text)`. Each chain gets its own tool instances, started at its first call and
stopped at `close`, so per-chain state (a Python session) never leaks between chains or episodes.
`step` parses the turn (format in `rlsys/tools/call_format.py`): a final answer is checked with
math-verify in the shared verifier pool and ends the chain with reward 1 or 0; otherwise the calls
run in order and their results are the observation. Whatever a tool does (raise, hang, return junk)
ends as an error response with a recorded reason, never as an exception out of `step`. A tool whose `call`, `start`
or `stop` is a plain `def` (a blocking client) runs it on a thread of its own (rlsys/blocking_calls.py), so its time
limit holds and the worker's other episodes go on while it blocks.
"""

import asyncio
import logging
from collections import Counter
from collections.abc import Hashable
from typing import Any

from rlsys.api import TOOLS, EnvironmentService, Tool, ToolOutput, make_tool, register_environment
from rlsys.api.tool import describe_tool
from rlsys.blocking_calls import async_form
from rlsys.impl.env.math_verifier import shared_pool
from rlsys.tools.call_format import ToolCall, instructions, no_action_hint, parse_turn, tool_response
from rlsys.tools.queue_time import within

log = logging.getLogger(__name__)

DEFAULT_TOOLS = {"calculator": {}, "python": {}}
STEP_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "decode_errors", "void_turns", "answered", "verify_failed")


class MathToolsEnv(EnvironmentService):
    def __init__(self, tools: dict[str, dict] | None = None, tool_timeout: float = 30.0, max_calls_per_turn: int = 4,
                 max_response_chars: int = 2048, verify_timeout: float = 5.0, verifier_workers: int | None = None):
        self.tool_args = dict(DEFAULT_TOOLS if tools is None else tools)
        self.schemas = {name: TOOLS.lookup(name).parameters for name in self.tool_args}  # unknown names fail here
        self.tool_timeout = tool_timeout  # a backstop: the python tool's sandbox has its own, shorter limits
        self.max_calls_per_turn = max_calls_per_turn
        self.max_response_chars = max_response_chars
        self.verify_timeout, self.verifier_workers = verify_timeout, verifier_workers
        self.reference: str | None = None
        self.chains: dict[Hashable, dict[str, AsyncTool]] = {}

    async def warm_up(self) -> None:
        await asyncio.to_thread(shared_pool(self.verifier_workers).wait_ready)

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """The observation is the instructions for the model: the call format and the tools offered."""
        if not options or "answer" not in options:
            raise KeyError(f"math-tools needs options['answer'] (the reference); got {options!r}")
        self.reference = str(options["answer"])
        lines = [describe_tool(name, TOOLS.lookup(name)) for name in self.tool_args]
        return instructions(lines), {"tools": list(self.tool_args)}

    async def step(self, action: tuple[Hashable, str]) -> tuple[str | None, float, bool, bool, dict[str, Any]]:
        """`action` is (chain, the model's turn as text). Info counts what happened, keyed by STEP_COUNTS."""
        if self.reference is None:
            raise RuntimeError("step() before reset(): no reference answer to check against")
        chain, text = action
        parsed = parse_turn(text, self.schemas)
        counts = Counter({key: 0 for key in STEP_COUNTS})
        if parsed.answer is not None:
            [verdict] = await shared_pool(self.verifier_workers).score([parsed.answer], self.reference,
                                                                       self.verify_timeout)
            counts["answered"] = 1
            counts["verify_failed"] = int(verdict.status in ("timeout", "error"))  # scored 0; counted as math's are
            info = {**counts, "verify_status": verdict.status, "verify_reason": verdict.reason}
            return None, float(verdict.correct), True, False, info
        if not parsed.items:
            counts["void_turns"] = 1
            return no_action_hint(), 0.0, False, False, dict(counts)
        responses = []
        for index, item in enumerate(parsed.items):
            if not isinstance(item, ToolCall):
                counts["decode_errors"] += 1
                responses.append(self.clip(f"error: {item.reason}"))  # it may quote the model's call at length
                continue
            counts["tool_calls"] += 1
            if counts["tool_calls"] > self.max_calls_per_turn:
                output = ToolOutput(f"error: at most {self.max_calls_per_turn} calls per turn; not run", "error")
            else:
                output = await self.run_tool(chain, item)
            counts["tool_errors"] += output.status != "ok"
            counts["tool_timeouts"] += output.status == "timeout"
            responses.append(self.clip(output.text))
        return "\n".join(map(tool_response, responses)), 0.0, False, False, dict(counts)

    async def run_tool(self, chain: Hashable, call: ToolCall) -> ToolOutput:
        doing = "start"
        try:
            tool = await self.tool(chain, call.name)
            doing = "finish"
            output = await within(tool.call(**call.arguments), self.tool_timeout)  # a slot's wait: free
        except asyncio.TimeoutError:
            reason = f"{call.name} did not {doing} in {self.tool_timeout:g}s"
            return ToolOutput(f"error: {reason}", "timeout", reason)
        except Exception as e:  # noqa: BLE001 (a broken tool is the model's observation, not the episode's end)
            log.warning("tool %s failed", call.name, exc_info=True)
            reason = f"{call.name} failed: {type(e).__name__}: {e}"
            return ToolOutput(f"error: {reason}", "error", reason)
        if isinstance(output, str):
            return ToolOutput(output)
        if not isinstance(output, ToolOutput):
            reason = f"{call.name} returned {type(output).__name__}, not ToolOutput"
            return ToolOutput(f"error: {reason}", "error", reason)
        if not isinstance(output.text, str):  # the model reads it: anything else failed the step (len() of an int)
            reason = f"{call.name} returned a ToolOutput whose text is {type(output.text).__name__}, not str"
            return ToolOutput(f"error: {reason}", "error", reason)
        return output

    async def tool(self, chain: Hashable, name: str) -> "AsyncTool":
        """The chain's instance of a tool, made and started at the chain's first call of it."""
        tools = self.chains.setdefault(chain, {})
        if name not in tools:
            tool = AsyncTool(make_tool(name, self.tool_args[name]))
            try:
                await asyncio.wait_for(tool.start(), self.tool_timeout)
            except BaseException:  # close() would not see it: what a start that overran or failed acquired goes now
                await self.stop([tool])
                raise
            tools[name] = tool
        return tools[name]

    def clip(self, text: str) -> str:
        return text if len(text) <= self.max_response_chars else text[:self.max_response_chars] + "...(truncated)"

    async def close(self) -> None:
        """Stops every tool of every chain; a tool that fails to stop is logged, the others still stop."""
        tools = [tool for chain in self.chains.values() for tool in chain.values()]
        self.chains = {}
        await self.stop(tools)

    async def stop(self, tools: list["AsyncTool"]) -> None:
        results = await asyncio.gather(*(asyncio.wait_for(t.stop(), self.tool_timeout) for t in tools),
                                       return_exceptions=True)
        for tool, result in zip(tools, results):
            if isinstance(result, BaseException):
                log.warning("stopping tool %s failed: %r", tool.kind, result)


class AsyncTool:
    """A tool's start, call and stop as async methods, each read once, when the tool is made: a `def` runs on a
    thread of its own, named for the tool's class and the method (rlsys/blocking_calls.py)."""

    def __init__(self, tool: Tool):
        self.kind = type(tool).__name__
        self.start, self.call, self.stop = (async_form(getattr(tool, name), f"{self.kind}.{name}")
                                            for name in ("start", "call", "stop"))


register_environment("math-tools", MathToolsEnv)
