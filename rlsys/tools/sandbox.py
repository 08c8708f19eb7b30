"""Runs model-written Python in a confined child process; every outcome comes back as a SandboxResult.

`await run_python(code, limits)` never raises for anything the code does: timeouts, crashes, memory
errors and output floods are statuses. It never blocks the event loop: the child is an asyncio
subprocess, and a timed-out child is SIGKILLed with its whole process group (in namespace modes the
kernel then also kills everything left in its PID namespace). How the child confines itself, and
what it falls back to where the machine allows less, is in `rlsys/tools/confine.py`; the result's
`isolation` lists what was in force and `notes` why anything is missing.
"""

import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

CONFINE = str(Path(__file__).with_name("confine.py"))
HIDDEN_DIRS = ["/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run"]  # may hold secrets, sockets, others' files
SANDBOX_UIDS = (1 << 30, 1 << 31)  # a fresh unprivileged uid per run, far above any real account
MAX_CONCURRENT = max(2, os.cpu_count() or 2)  # runs at once per event loop; the rest queue (not charged wall time)
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one thread each: threads count as processes
REPORT_WAIT = 5.0  # seconds to reap a killed launcher

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit", "output_limit", "crashed",
            "sandbox_error")


@dataclass
class SandboxLimits:
    """What one run may use."""

    wall_seconds: float = 5.0
    """Wall-clock limit, counted from the launch (the confinement's own setup, about 0.1 s, included)."""
    cpu_seconds: int = 5
    """CPU-time limit (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS); Python raises MemoryError beyond it."""
    max_processes: int = 16
    """Processes and threads (RLIMIT_NPROC, counted for the sandbox's own uid)."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 16384
    """stdout + stderr kept; a program that writes more is killed (status output_limit)."""
    workdir_mb: int = 64
    """Size of the private writable /tmp (namespace modes)."""
    nice: int = 10
    """Scheduling niceness added, so sandboxed code yields the CPU to the trainer."""


@dataclass
class SandboxResult:
    """How one run ended. `status` is one of STATUSES; `reason` says why in words."""

    status: str
    exit_code: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    truncated: bool  # output was cut at SandboxLimits.output_bytes
    reason: str
    seconds: float
    isolation: list[str] = field(default_factory=list)  # confinement that was in force
    notes: list[str] = field(default_factory=list)  # why some confinement was not available


async def run_python(code: str, limits: SandboxLimits | None = None, isolate: bool = True) -> SandboxResult:
    """Runs `code` as a Python program in a fresh sandbox. `isolate=False` keeps only the limits."""
    async with _slots():
        return await _run(code, limits or SandboxLimits(), isolate)


_semaphores: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _slots() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _semaphores:
        _semaphores[loop] = asyncio.Semaphore(MAX_CONCURRENT)
    return _semaphores[loop]


async def _run(code: str, limits: SandboxLimits, isolate: bool) -> SandboxResult:
    loop = asyncio.get_running_loop()
    started = loop.time()
    workdir = tempfile.mkdtemp(prefix="rlsys-sandbox-")
    report_read, report_write = os.pipe()
    process = None
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        config = launcher_config(Path(workdir, "main.py"), limits, isolate)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", CONFINE, str(report_write), json.dumps(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(report_write,), start_new_session=True, env={"PATH": PROGRAM_ENV["PATH"]}, cwd=workdir)
        os.close(report_write)
        report_write = None
        output = CappedOutput(limits.output_bytes, on_overflow=lambda: kill_group(process))
        try:
            await asyncio.wait_for(_finish(process, output), limits.wall_seconds)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
        kill_group(process)  # stragglers outside a PID namespace, or the whole tree on timeout
        await asyncio.wait_for(process.wait(), REPORT_WAIT)
        report = read_report(report_read)
        return classify(report, output, timed_out, limits, loop.time() - started)
    except Exception as e:  # noqa: BLE001 (the caller gets a result, never an exception)
        return SandboxResult("sandbox_error", None, "", "", False, f"{type(e).__name__}: {e}",
                             loop.time() - started)
    finally:
        if process is not None and process.returncode is None:  # cancelled: leave nothing running
            kill_group(process)
        for fd in (report_read, report_write):
            if fd is not None:
                os.close(fd)
        await asyncio.to_thread(shutil.rmtree, workdir, True)


def launcher_config(code_path: Path, limits: SandboxLimits, isolate: bool) -> dict:
    mib = 1 << 20
    return {
        "code_path": str(code_path), "python": sys.executable, "isolate": isolate,
        "uid": random.randrange(*SANDBOX_UIDS), "env": PROGRAM_ENV,
        "hide": HIDDEN_DIRS, "expose": interpreter_dirs(),
        "limits": {"cpu_seconds": limits.cpu_seconds, "memory_bytes": limits.memory_mb * mib,
                   "max_processes": limits.max_processes, "file_bytes": limits.file_mb * mib,
                   "open_files": limits.open_files, "workdir_bytes": limits.workdir_mb * mib, "nice": limits.nice},
    }


def interpreter_dirs() -> list[str]:
    """Where this interpreter and its packages live; bound back in if a hidden directory covers them."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    return sorted({os.path.realpath(d) for d in dirs})


async def _finish(process: asyncio.subprocess.Process, output: "CappedOutput") -> None:
    await asyncio.gather(output.drain(process.stdout, "stdout"), output.drain(process.stderr, "stderr"))
    await process.wait()


class CappedOutput:
    """Keeps the first `limit` bytes of stdout + stderr; past that it calls `on_overflow` once and discards."""

    def __init__(self, limit: int, on_overflow):
        self.limit, self.on_overflow = limit, on_overflow
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.total = 0

    @property
    def overflowed(self) -> bool:
        return self.total > self.limit

    async def drain(self, stream: asyncio.StreamReader, name: str) -> None:
        while chunk := await stream.read(65536):
            room = max(0, self.limit - self.total)
            self.kept[name] += chunk[:room]
            was_over, self.total = self.overflowed, self.total + len(chunk)
            if self.overflowed and not was_over:
                self.on_overflow()

    def text(self, name: str) -> str:
        return self.kept[name].decode("utf-8", errors="replace")


def kill_group(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher leads its own session and group
    except ProcessLookupError:  # already gone
        pass


def read_report(fd: int) -> dict:
    """The launcher's JSON lines, merged; read without blocking (every writer is gone by now)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    report = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except json.JSONDecodeError:
            pass
    return report


def classify(report: dict, output: CappedOutput, timed_out: bool, limits: SandboxLimits,
             seconds: float) -> SandboxResult:
    stdout, stderr = output.text("stdout"), output.text("stderr")
    exit_code = -report["signal"] if "signal" in report else report.get("exit")
    status, reason = outcome(report, output, timed_out, limits, stderr)
    return SandboxResult(status, exit_code, stdout, stderr, output.overflowed, reason, seconds,
                         report.get("isolation", []) + ["scrubbed-environment", "process-group-kill"],
                         report.get("notes", []))


def outcome(report: dict, output: CappedOutput, timed_out: bool, limits: SandboxLimits,
            stderr: str) -> tuple[str, str]:
    if timed_out:
        return "timeout", f"wall time limit of {limits.wall_seconds:g}s exceeded; killed"
    if output.overflowed:
        return "output_limit", f"output exceeded {limits.output_bytes} bytes; killed"
    if "error" in report:
        return "sandbox_error", report["error"]
    if "signal" in report:
        return signal_outcome(report["signal"], limits)
    if "exit" not in report:
        return "sandbox_error", "the sandbox launcher died without a report"
    if report["exit"] == 0:
        return "ok", ""
    last_line = stderr.strip().rsplit("\n", 1)[-1]
    if last_line.startswith("MemoryError"):
        return "memory_limit", f"MemoryError (memory limit {limits.memory_mb} MiB)"
    if "File too large" in last_line:
        return "file_size_limit", f"{last_line} (file size limit {limits.file_mb} MiB)"
    return "error", last_line or f"exit code {report['exit']}"


def signal_outcome(number: int, limits: SandboxLimits) -> tuple[str, str]:
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    if number == signal.SIGXCPU:
        return "cpu_limit", f"CPU time limit of {limits.cpu_seconds}s exceeded (SIGXCPU)"
    if number == signal.SIGXFSZ:
        return "file_size_limit", f"file size limit of {limits.file_mb} MiB exceeded (SIGXFSZ)"
    return "crashed", f"killed by {name}"
