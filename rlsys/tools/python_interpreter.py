"""The `python` tool: runs model-written code in the sandbox and shows the model what it printed.

With `persistent=True` (the default) the tool is a session: variables and functions defined by one
call are there in the next call of the same chain. The sandbox keeps no process between calls, so a
call re-runs the chain's earlier successful cells first, their output suppressed, then the new one
(the replay technique of tool-integrated reasoning setups). Replays count against the call's limits,
and side effects (files, randomness) happen again. The list of cells is the tool's per-chain state:
created in `start`, dropped in `stop`.
"""

from rlsys.api.tool import Tool, ToolOutput, register_tool
from rlsys.tools.confinement import preflight
from rlsys.tools.sandbox import SandboxLimits, SandboxResult, run_python

# Runs the cells in one namespace; only the last one's output is shown. Tracebacks name the cell and
# show its source lines, and leave out this driver's own frame.
SESSION_DRIVER = '''\
import contextlib, io, linecache, os, sys, traceback, types
CELLS = {cells!r}
sys.modules["__main__"] = main = types.ModuleType("__main__")  # the cells' own: what they define pickles by name
namespace = main.__dict__
real_exit, driver = os._exit, os.getpid()
def replayed_exit(code):  # a replayed cell that called os._exit ends itself, not the session (a fork's child exits)
    if os.getpid() != driver:
        real_exit(code)
    raise SystemExit(code)
for index, source in enumerate(CELLS):
    filename = f"<cell {{index + 1}}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    quiet = index < len(CELLS) - 1
    os._exit = replayed_exit if quiet else real_exit
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink if quiet else sys.stdout), \\
                contextlib.redirect_stderr(sink if quiet else sys.stderr):
            exec(compile(source, filename, "exec"), namespace)
    except SystemExit:
        if not quiet:  # a replayed cell that exited succeeded (code 0): its exit ends that cell, not the session
            raise
    except BaseException as e:
        print("".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)), end="", file=sys.stderr)
        sys.exit(1)
'''

TIMEOUT_STATUSES = ("timeout", "cpu_limit")


class PythonTool(Tool):
    description = "runs a Python program and returns what it prints"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, limits: SandboxLimits | dict | None = None, persistent: bool = True,
                 max_output_chars: int = 1024):
        self.limits = SandboxLimits(**limits) if isinstance(limits, dict) else limits or SandboxLimits()
        self.persistent, self.max_output_chars = persistent, max_output_chars
        preflight(self.limits.allow_unconfined)  # no confinement and not allowed to run without: say so now
        self.cells: list[str] | None = None
        self.last_result: SandboxResult | None = None  # for logs and tests: isolation, exit code, timing

    async def start(self) -> None:
        self.cells = []

    async def call(self, code: str) -> ToolOutput:
        if self.cells is None:
            raise RuntimeError("PythonTool.call before start()")
        cells = [*self.cells, code] if self.persistent else [code]
        result = await run_python(SESSION_DRIVER.format(cells=cells), self.limits)
        self.last_result = result
        if self.persistent and result.status == "ok":
            self.cells.append(code)
        return ToolOutput(self.observation(result), tool_status(result.status), result.reason,
                          [f"mode={result.mode}", *result.isolation])

    async def stop(self) -> None:
        self.cells = None

    def observation(self, result: SandboxResult) -> str:
        """stdout, then stderr, cut to max_output_chars; a limit that stopped the program is said in brackets."""
        text = result.stdout + result.stderr
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + "...(truncated)"
        if result.status not in ("ok", "error"):
            text = "\n".join(filter(None, [text.rstrip("\n"), f"[{result.reason}]"]))
        return text if text.strip() else "(no output)"


def tool_status(sandbox_status: str) -> str:
    if sandbox_status == "ok":
        return "ok"
    return "timeout" if sandbox_status in TIMEOUT_STATUSES else "error"


register_tool("python", PythonTool)
