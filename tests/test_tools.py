"""The tool-call parser, the calculator, the tool registry, the python tool's session and the math-tools env."""

import asyncio
import json
import re
import threading
import time

import pytest

import rlsys.impl.env  # noqa: F401  (registers the environments)
from rlsys.api import TOOLS, EnvServiceAbstraction, Tool, ToolOutput, make_env, make_tool, register_tool
from rlsys.tools import sandbox
from rlsys.tools.calculator import CalculatorError, evaluate, format_number
from rlsys.tools.call_format import DecodeError, ToolCall, parse_turn
from rlsys.tools.queue_time import queued_for, within
from tests.helpers import LoopTicks

SCHEMAS = {name: TOOLS.lookup(name).parameters for name in ("calculator", "python")}


# --- the call format --------------------------------------------------------------------------------------

def test_parser_returns_calls_in_order():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> and '
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    parsed = parse_turn(text, SCHEMAS)
    assert parsed.answer is None
    assert parsed.items == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("python", {"code": "print(1)"})]


def test_parser_takes_the_answer_and_ignores_calls_beside_it():
    parsed = parse_turn('<tool_call>{"name": "calculator"}</tool_call> <answer> 42 </answer>', SCHEMAS)
    assert parsed.answer == "42" and parsed.items == []


def test_an_answer_tag_inside_a_call_is_the_call_s_not_the_turn_s_answer():
    """Code that prints the answer format is a python call to run: it was taken for the final answer (here "{x}"),
    ending the episode (and the endpoint returned the turn as plain text, the tool never called)."""
    code = "x = 6*7\nprint(f'<answer>{x}</answer>')"
    call = f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'
    parsed = parse_turn(call, SCHEMAS)
    assert parsed.answer is None and parsed.items == [ToolCall("python", {"code": code})]
    assert parse_turn(call + " <answer>42</answer>", SCHEMAS).answer == "42"  # one beside the call still ends the turn


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ('["calculator"]', "must be a JSON object"),
    ("[" * 5000, "not valid JSON: nested too deeply"),  # not a RecursionError that fails the episode
    pytest.param('{"name": "calculator", "arguments": {"expression": ' + "1" * 5000 + "}}",
                 "a number in it is too long", id="a-5000-digit-number"),  # not a ValueError that fails the episode
    ('{"name": "calculator"}', "missing ['arguments']"),
    ('{"name": "calculator", "arguments": {}, "id": 1}', "unexpected ['id']"),
    ('{"name": "shell", "arguments": {"cmd": "ls"}}', "unknown tool 'shell'; tools: calculator, python"),
    ('{"name": "calculator", "arguments": "1+1"}', "'arguments' must be a JSON object"),
    ('{"name": "calculator", "arguments": {}}', "calculator: missing argument 'expression'"),
    ('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}', "unknown argument 'x'"),
    ('{"name": "calculator", "arguments": {"expression": 12}}', "argument 'expression' must be a JSON string, got int"),
])
def test_parser_gives_a_reason_for_each_bad_call(body, reason):
    [item] = parse_turn(f"<tool_call>{body}</tool_call>", SCHEMAS).items
    assert isinstance(item, DecodeError) and reason in item.reason and item.text == body


def test_parser_reports_unclosed_tags_and_keeps_good_calls():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
            '<tool_call>{"name": "calculator", "argu')
    first, second = parse_turn(text, SCHEMAS).items
    assert first == ToolCall("calculator", {"expression": "1"})
    assert isinstance(second, DecodeError) and "without </tool_call>" in second.reason
    [item] = parse_turn("<answer>12", SCHEMAS).items
    assert "<answer> without </answer>" in item.reason
    assert parse_turn("just thinking", SCHEMAS).items == [] and parse_turn("just thinking", SCHEMAS).answer is None


# --- the calculator ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("1+2*3", "7"), ("(12+3)*4", "60"), ("10/4", "2.5"), ("6/3", "2"), ("7//2", "3"), ("-7%3", "2"),
    ("2**10", "1024"), ("2**-2", "0.25"), ("sqrt(16)", "4"), ("round(2.567, 2)", "2.57"), ("max(1, 5, 3)", "5"),
    ("factorial(20)", "2432902008176640000"), ("pi", "3.14159265359"), ("gcd(12, 18)", "6"),
    ("+".join(map(str, range(1, 101))), "5050"), ("*".join(["2"] * 60), str(2**60)),  # long runs are no nesting
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert format_number(evaluate(expression)) == value


@pytest.mark.parametrize("expression, reason", [
    ("9**9**9", "would exceed 4096 bits"),
    ("10**5000", "would exceed 4096 bits"),
    ("2**4000*2**4000", "larger than 4096 bits"),
    ("factorial(10**6)", "limited to 450"),
    ("round(5, -10**7)", "limited to 100"),
    ("1/0", "ZeroDivisionError"),
    ("sqrt(-1)", "math domain error"),
    ("2.0**100000", "OverflowError"),
    ("1e308*10", "not finite"),
    ("(-8)**(1/3)", "not a real number"),
    ("__import__('os').system('id')", "unsupported"),
    ("().__class__.__bases__", "unsupported"),
    ("open('/etc/passwd')", "unsupported"),
    ("lambda: 1", "unsupported"),
    ("x + 1", "unsupported"),
    ("'a' * 3", "unsupported"),
    ("True + 1", "unsupported"),
    ("1 +", "not an arithmetic expression"),
    ("(" * 300 + "1" + ")" * 300, "longer than 500"),
    ("-" * 200 + "1", "nested deeper than 50"),
    ("1+(" * 60 + "1" + ")" * 60, "nested deeper than 50"),
])
def test_calculator_refuses_hostile_or_unbounded_input_quickly(expression, reason):
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=re.escape(reason)):
        evaluate(expression)
    assert time.perf_counter() - started < 0.1


def test_calculator_tool_reports_errors_as_output():
    tool = make_tool("calculator")
    assert asyncio.run(tool.call(expression="12*34")) == ToolOutput("408")
    failed = asyncio.run(tool.call(expression="9**9**9"))
    assert failed.status == "error" and failed.text.startswith("error: ") and "4096 bits" in failed.reason


# --- the registry -----------------------------------------------------------------------------------------

def test_registry_errors_name_the_registered_tools():
    with pytest.raises(KeyError, match=r"unknown tool 'calculater'. Did you mean \['calculator'\]\?.*'python'"):
        make_tool("calculater")
    with pytest.raises(ValueError, match="already registered"):
        register_tool("calculator", type("Other", (Tool,), {"call": lambda self: None}))
    with pytest.raises(TypeError, match="cannot take args"):
        make_tool("python", {"timeout": 3})
    with pytest.raises(KeyError, match="unknown tool 'shell'"):
        make_env(EnvServiceAbstraction("math-tools", {"tools": {"shell": {}}}))


# --- the python tool --------------------------------------------------------------------------------------

def test_python_session_keeps_variables_until_stopped_and_skips_failed_cells():
    async def session():
        tool = make_tool("python")
        await tool.start()
        outputs = [await tool.call(code=code) for code in
                   ["x = 20\nprint('set')", "def f(n):\n    return n + 1\nprint(f(x))", "y = 1 / 0", "print(y)",
                    "print(f(x) * 2)"]]
        await tool.stop()
        return tool, outputs

    tool, outputs = asyncio.run(session())
    assert [o.text for o in outputs[:2]] == ["set\n", "21\n"]  # earlier cells re-run silently
    assert outputs[2].status == "error" and 'File "<cell 3>", line 1' in outputs[2].text
    assert "ZeroDivisionError" in outputs[2].text and "main.py" not in outputs[2].text
    # failed cell dropped
    assert outputs[3].status == "error" and "NameError: name 'y' is not defined" in outputs[3].text
    assert (outputs[4].text, outputs[4].status, outputs[4].reason) == ("42\n", "ok", "")
    assert outputs[4].isolation[0].startswith("mode=")  # the confinement it ran under
    assert tool.cells is None  # released at stop


def test_python_session_goes_on_after_a_cell_that_exits():
    """exit() ends a cell that succeeded; replayed in later calls, it must not end them before their own cell."""
    async def session():
        tool = make_tool("python")
        await tool.start()
        outputs = [await tool.call(code=code) for code in ["x = 41\nprint(x)\nexit()", "print(x + 1)",
                                                            "import sys\nsys.exit(0)", "print(x + 2)"]]
        await tool.stop()
        return outputs

    outputs = asyncio.run(session())
    assert [(o.text, o.status) for o in outputs] == [("41\n", "ok"), ("42\n", "ok"), ("(no output)", "ok"),
                                                     ("43\n", "ok")]


def test_python_session_goes_on_after_a_cell_that_ends_its_process_with_os_exit():
    """os._exit(0) ends a cell that succeeded without unwinding; replayed, it ended every later call of the session
    before its own cell ran, each a silent '(no output)' with status ok. A forked child's os._exit still exits."""
    async def session():
        tool = make_tool("python")
        await tool.start()
        outputs = [await tool.call(code=code) for code in [
            "import os\nx = 41\nprint(x, flush=True)\nos._exit(0)", "print(x + 1)",
            "import multiprocessing, os\nchild = multiprocessing.get_context('fork').Process(target=os._exit, "
            "args=(3,))\nchild.start()\nchild.join()\nprint(child.exitcode)", "print(x + 2)"]]
        await tool.stop()
        return outputs

    outputs = asyncio.run(session())
    assert [(o.text, o.status) for o in outputs] == [("41\n", "ok"), ("42\n", "ok"), ("3\n", "ok"), ("43\n", "ok")]


def test_python_cells_can_pickle_what_they_define_and_hand_it_to_a_process_pool():
    """Cells ran in a dict named __main__ while sys.modules['__main__'] was the driver: pickling a class or function a
    cell defined failed ('attribute lookup P on __main__ failed'), and with it multiprocessing.Pool.map."""
    async def session():
        tool = make_tool("python")
        await tool.start()
        outputs = [await tool.call(code=code) for code in [
            "import pickle\nclass P:\n    pass\nprint(type(pickle.loads(pickle.dumps(P()))).__name__)",
            "from multiprocessing import Pool\ndef square(x):\n    return x * x\nwith Pool(2) as pool:\n"
            "    print(pool.map(square, [1, 2, 3]))", "print(square(4), pickle.dumps(P) != b'')"]]
        await tool.stop()
        return outputs

    outputs = asyncio.run(session())
    assert [(o.text, o.status) for o in outputs] == [("P\n", "ok"), ("[1, 4, 9]\n", "ok"), ("16 True\n", "ok")]


def test_python_tool_reports_limits_and_truncates_output():
    async def calls():
        hasty = make_tool("python", {"limits": {"wall_seconds": 1.5}, "persistent": False})
        terse = make_tool("python", {"max_output_chars": 20})
        await hasty.start()
        await terse.start()
        return await hasty.call(code="import time\ntime.sleep(10)"), await terse.call(code="print('y' * 100)")

    timeout, long = asyncio.run(calls())
    assert timeout.status == "timeout" and timeout.text == "[wall time limit of 1.5s exceeded; killed]"
    assert (long.text, long.status) == ("y" * 20 + "...(truncated)", "ok")


# --- the environment's handling of tools ------------------------------------------------------------------

class RecordingTool(Tool):
    """Counts starts and stops; `mode` makes it misbehave."""

    description = "test tool"
    parameters = {"type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]}
    started = stopped = 0

    async def start(self):
        RecordingTool.started += 1
        self.calls = 0

    async def call(self, mode):
        self.calls += 1
        if mode == "raise":
            raise RuntimeError("tool broke")
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "junk":
            return 42
        if mode == "junk-text":
            return ToolOutput(42)
        return ToolOutput(f"call {self.calls}")

    async def stop(self):
        RecordingTool.stopped += 1


register_tool("recording-test-tool", RecordingTool)


def call(mode: str) -> str:
    return f'<tool_call>{{"name": "recording-test-tool", "arguments": {{"mode": "{mode}"}}}}</tool_call>'


def test_env_gives_each_chain_its_own_tool_state_and_releases_it_at_close():
    RecordingTool.started = RecordingTool.stopped = 0
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"recording-test-tool": {}}, "tool_timeout": 0.5}))

    async def episode():
        instructions, info = await env.reset(options={"prompt": "1+1", "answer": "2"})
        steps = [await env.step((chain, call(mode))) for chain, mode in
                 [(0, "ok"), (0, "ok"), (1, "ok"), (1, "raise"), (1, "hang"), (0, "junk"),
                                           (0, "junk-text")]]
        stopped_before_close = RecordingTool.stopped
        await env.close()
        return instructions, info, steps, stopped_before_close

    instructions, info, steps, stopped_before_close = asyncio.run(episode())
    assert info == {"tools": ["recording-test-tool"]} and "recording-test-tool(mode): test tool" in instructions
    observations = [s[0] for s in steps]
    assert observations[:3] == ["<tool_response>call 1</tool_response>", "<tool_response>call 2</tool_response>",
                                "<tool_response>call 1</tool_response>"]  # chain 1 has its own count
    assert observations[3] == ("<tool_response>error: recording-test-tool failed: RuntimeError: tool broke"
                               "</tool_response>")
    assert observations[4] == "<tool_response>error: recording-test-tool did not finish in 0.5s</tool_response>"
    assert "returned int, not ToolOutput" in observations[5]
    assert observations[6] == ("<tool_response>error: recording-test-tool returned a ToolOutput whose text is int, "
                               "not str</tool_response>")  # not a TypeError out of step, failing the episode
    assert [s[4]["tool_errors"] for s in steps] == [0, 0, 0, 1, 1, 1, 1]
    assert [s[4]["tool_timeouts"] for s in steps] == [0, 0, 0, 0, 1, 0, 0]
    assert all(s[1:4] == (0.0, False, False) for s in steps)
    assert (RecordingTool.started, stopped_before_close, RecordingTool.stopped) == (2, 0, 2)


def test_a_tool_s_methods_are_made_async_once_when_the_tool_is_made_not_at_each_call(monkeypatch):
    """Each call read its tool's method and made its async form again (with its thread's label): work repeated on
    every call of an episode. The forms are made with the tool now: start, call and stop once for each tool."""
    from rlsys.impl.env import math_tools

    made = []
    monkeypatch.setattr(math_tools, "async_form", lambda method, label: made.append(label) or method)
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"recording-test-tool": {}}}))

    async def episode():
        await env.reset(options={"prompt": "1+1", "answer": "2"})
        steps = [await env.step((chain, call("ok"))) for chain in (0, 0, 0, 1, 1)]
        await env.close()
        return steps

    assert [s[0] for s in asyncio.run(episode())][2:4] == ["<tool_response>call 3</tool_response>",
                                                          "<tool_response>call 1</tool_response>"]
    assert sorted(made) == sorted(["RecordingTool.start", "RecordingTool.call", "RecordingTool.stop"] * 2)


class SlowStartTool(RecordingTool):
    """Its first start overruns any tool_timeout, after acquiring what its stop releases."""

    async def start(self):
        await super().start()
        if RecordingTool.started == 1:
            await asyncio.sleep(3600)


register_tool("slow-start-test-tool", SlowStartTool)


def test_a_tool_whose_start_overruns_is_stopped_then_and_started_again_at_the_next_call():
    RecordingTool.started = RecordingTool.stopped = 0
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"slow-start-test-tool": {}}, "tool_timeout": 0.5}))
    slow_call = call("ok").replace("recording-test-tool", "slow-start-test-tool")

    async def episode():
        await env.reset(options={"prompt": "1+1", "answer": "2"})
        first = await env.step((0, slow_call))
        stopped_after_first = RecordingTool.stopped
        second = await env.step((0, slow_call))
        await env.close()
        return first, stopped_after_first, second

    first, stopped_after_first, second = asyncio.run(episode())
    assert first[0] == "<tool_response>error: slow-start-test-tool did not start in 0.5s</tool_response>"
    assert first[4]["tool_timeouts"] == 1 and stopped_after_first == 1
    assert second[0] == "<tool_response>call 1</tool_response>"
    assert (RecordingTool.started, RecordingTool.stopped) == (2, 2)


class BlockingTool(Tool):
    """A tool written with plain `def`s around a blocking client: `call` blocks until `release` is set."""

    description = "blocking test tool"
    parameters = {"type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]}
    release = threading.Event()
    threads: list[str] = []

    def start(self):
        BlockingTool.threads.append(threading.current_thread().name)

    def call(self, mode):
        if mode == "block":
            BlockingTool.release.wait(3600)  # a blocking call: the loop it ran on could do nothing else meanwhile
        return ToolOutput(f"{mode} on {threading.current_thread().name}")

    def stop(self):
        BlockingTool.threads.append(threading.current_thread().name)


register_tool("blocking-test-tool", BlockingTool)


def test_a_tool_with_synchronous_methods_runs_them_off_the_loop_and_one_that_blocks_times_out():
    """A tool's `def call` ran on the event loop: one that blocked froze every episode of the worker past its
    tool_timeout, and what a `def` returned (no coroutine) was a tool error on every call. It runs on a thread of its
    own now: a blocked call is reported to the model as timed out at tool_timeout while the loop goes on."""
    BlockingTool.release.clear()
    BlockingTool.threads = []
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"blocking-test-tool": {}}, "tool_timeout": 0.5}))
    blocking_call = call("MODE").replace("recording-test-tool", "blocking-test-tool")

    async def episode():
        await env.reset(options={"prompt": "1+1", "answer": "2"})
        async with LoopTicks() as ticks:
            blocked = await env.step((0, blocking_call.replace("MODE", "block")))
        quick = await env.step((0, blocking_call.replace("MODE", "quick")))
        await env.close()
        return blocked, ticks.count, quick

    blocked, ticks, quick = asyncio.run(episode())
    BlockingTool.release.set()
    assert blocked[0] == "<tool_response>error: blocking-test-tool did not finish in 0.5s</tool_response>"
    assert blocked[4]["tool_timeouts"] == 1 and ticks >= 5
    assert quick[0] == "<tool_response>quick on BlockingTool.call</tool_response>" and quick[4]["tool_errors"] == 0
    assert BlockingTool.threads == ["BlockingTool.start", "BlockingTool.stop"]


def test_a_python_call_queued_for_a_sandbox_slot_is_not_timed_out_for_the_wait(monkeypatch):
    """One slot: a chain's call that hangs holds it until the env's limit; another chain's quick call, queued behind
    it all that time, runs once it is free and is not reported as timed out (the wait was not its run). The hang
    sleeps rather than spins, and the limit is 4 s: a spinning hang took one of CI's two cores while the quick call's
    sandbox started (about 0.3 s alone), and under load that start once overran a 2 s limit."""
    monkeypatch.setattr(sandbox, "MAX_CONCURRENT", 1)
    env = make_env(EnvServiceAbstraction("math-tools", {"tool_timeout": 4.0}))
    python_call = '<tool_call>{{"name": "python", "arguments": {{"code": "{}"}}}}</tool_call>'.format

    async def episode():
        await env.reset(options={"prompt": "6*7", "answer": "42"})
        hang = asyncio.ensure_future(env.step((0, python_call("import time; time.sleep(600)"))))
        while not (sandbox._semaphores.get(asyncio.get_running_loop()) or asyncio.Semaphore()).locked():
            await asyncio.sleep(0.01)  # the hanging call holds the slot
        quick = await env.step((1, python_call("print(6*7)")))
        hung = await hang
        await env.close()
        return hung, quick

    hung, quick = asyncio.run(episode())
    assert hung[0] == "<tool_response>error: python did not finish in 4s</tool_response>"
    assert hung[4]["tool_timeouts"] == 1
    assert quick[0] == "<tool_response>42\n</tool_response>" and quick[4]["tool_timeouts"] == 0


def test_within_counts_a_call_s_run_not_its_queued_waits():
    async def main():
        lock = asyncio.Semaphore(1)

        async def hold(seconds):
            async with queued_for(lock):
                await asyncio.sleep(seconds)
            return seconds

        holder = asyncio.ensure_future(hold(0.6))
        await asyncio.sleep(0)
        queued_then_quick = await within(hold(0.1), 0.3)  # 0.6 s queued, 0.1 s run
        with pytest.raises(asyncio.TimeoutError):
            await within(hold(0.6), 0.3)  # its own run overruns
        return queued_then_quick, await holder, lock.locked()

    assert asyncio.run(main()) == (0.1, 0.6, False)  # the timed-out call let the lock go


def test_env_scores_answers_and_hints_after_a_turn_without_action():
    env = make_env(EnvServiceAbstraction("math-tools"))

    async def episode():
        await env.reset(options={"prompt": "12+34=", "answer": "46"})
        results = [await env.step((0, text)) for text in ["hmm", "<answer>45</answer>", "<answer>46</answer>"]]
        await env.close()
        return results

    void, wrong, right = asyncio.run(episode())
    assert void[0].startswith("No tool call and no answer found") and void[4]["void_turns"] == 1 and not void[2]
    assert wrong[1:3] == (0.0, True) and wrong[4]["answered"] == 1
    assert right[1:3] == (1.0, True) and right[4]["verify_status"] == "ok"


def test_env_runs_at_most_max_calls_per_turn():
    env = make_env(EnvServiceAbstraction("math-tools", {"max_calls_per_turn": 2}))
    calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'

    async def episode():
        await env.reset(options={"answer": "2"})
        return await env.step((0, calc * 3))

    observation, _, _, _, info = asyncio.run(episode())
    assert observation.split("\n") == ["<tool_response>2</tool_response>"] * 2 + [
        "<tool_response>error: at most 2 calls per turn; not run</tool_response>"]
    assert (info["tool_calls"], info["tool_errors"]) == (3, 1)


def test_env_cuts_every_response_to_max_response_chars_errors_that_quote_the_call_too():
    env = make_env(EnvServiceAbstraction("math-tools", {"tools": {"calculator": {}}, "max_response_chars": 100}))
    long_name = '<tool_call>{"name": "' + "x" * 5000 + '", "arguments": {}}</tool_call>'
    long_argument = '<tool_call>{"name": "calculator", "arguments": {"' + "e" * 5000 + '": 1}}</tool_call>'

    async def episode():
        await env.reset(options={"answer": "2"})
        return [(await env.step((0, text)))[0] for text in (long_name, long_argument)]

    for observation in asyncio.run(episode()):
        assert observation.startswith("<tool_response>error: ")
        assert observation.endswith("...(truncated)</tool_response>")
        assert len(observation) == len("<tool_response>") + 100 + len("...(truncated)</tool_response>")


# --- the experiment ---------------------------------------------------------------------------------------

def test_experiment_is_picked_by_name_and_its_fields_reach_the_agent_and_env():
    from rlsys.cli import parse_config

    config = parse_config(["experiment=async-ppo-math-tools", "num_turns=2", "max_total_tokens=200",
                           "tools=[calculator,python]", "sandbox.wall_seconds=2.5", "python_persistent=false",
                           "inference.max_model_len=150", "model.path=/models/x"])
    assert config.agent.name == "tool-calling" and config.env.name == "math-tools"
    assert config.agent.args["num_turns"] == 2 and config.agent.args["max_total_tokens"] == 150  # capped by the engine
    python = config.env.args["tools"]["python"]
    assert python["limits"]["wall_seconds"] == 2.5 and python["persistent"] is False
    assert config.env.args["tools"]["calculator"] == {}
    env = make_env(config.env)
    assert make_tool("python", python).limits.wall_seconds == 2.5 and list(env.tool_args) == ["calculator", "python"]


@pytest.mark.parametrize("setting", ["sandbox.nice=-5", "sandbox.cpu_seconds=0", "sandbox.memory_mb=0",
                                     "sandbox.wall_seconds=-1", "sandbox.output_bytes=0"])
def test_a_sandbox_limit_no_program_could_run_under_stops_the_run_at_start(setting):
    """Accepted, each made every call of the python tool fail alike (a setup error, or a limit hit at once)."""
    from rlsys.cli import ConfigError, parse_config

    with pytest.raises(ConfigError, match=re.escape(setting.split("=")[0])):
        parse_config(["experiment=async-ppo-math-tools", setting])


@pytest.mark.parametrize("limits, field", [({"cpu_seconds": 2.5}, "cpu_seconds"), ({"memory_mb": 256.5}, "memory_mb"),
                                           ({"nice": 5.0}, "nice"), ({"workdir_mb": 8.5}, "workdir_mb"),
                                           ({"open_files": True}, "open_files")])
def test_a_python_tool_whose_limits_are_not_whole_numbers_is_refused_naming_the_field(limits, field):
    """The env's tool arguments do not pass the command line's type checks: a float went on to fail every call
    (setrlimit and nice take integers: sandbox_error), a bool was read as a limit of 1 open file."""
    with pytest.raises(ValueError, match=re.escape(f"sandbox.{field} must be a whole number, got {limits[field]!r}")):
        make_tool("python", {"limits": limits})
