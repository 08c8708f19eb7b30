"""Runs model-written Python in a confined child process; every outcome comes back as a SandboxResult.

`await run_python(code, limits)` never raises for anything the code does: timeouts, crashes, memory
errors and output floods are statuses. It never blocks the event loop: the child is an asyncio
subprocess, and a timed-out child is SIGKILLed with its whole process group, its PID namespace and
its cgroup. How the run is confined, and what this machine allows, is in `rlsys/tools/confinement.py`;
the init that runs inside is `rlsys/tools/confine.py`. The result's `mode` and `isolation` say what
was in force and `notes` why anything is missing; where no confinement can be had the run is refused
unless `allow_unconfined`.
"""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.tools.confinement import (SANDBOX_UID, WORKDIR, Confinement, UsernsPipes, bwrap_command, launch_options,
                                     machine_confinement, refusal)
from rlsys.tools.queue_time import queued_for
from rlsys.tools.sandbox_cgroup import SandboxCgroup
from rlsys.tools.seccomp_filter import deny_filter

INIT_SOURCE = Path(__file__).with_name("confine.py").read_text(encoding="utf-8")
MAX_CONCURRENT = max(2, os.cpu_count() or 2)  # runs at once per event loop; the rest queue (not charged wall time)
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one thread each: threads count as processes
REPORT_WAIT = 5.0  # seconds to reap a killed launcher
CPU_POLL = 0.05  # seconds between reads of the cgroup's CPU time
CGROUP_EXTRA_PIDS = 2  # bubblewrap's monitor and the init, besides the program's own processes
# the launch makes the sandbox the OOM killer's first pick, whatever the trainer's own score (inherited by all it
# starts; where /proc refuses, it goes on without), and joins the cgroup (every controller's tree, if any) before it
# execs bubblewrap or the init
LAUNCH = ('{ echo 1000 > /proc/self/oom_score_adj; } 2>/dev/null; '
          'for f in $RLSYS_CGROUP_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"')

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit", "output_limit", "crashed",
            "sandbox_error", "refused")


@dataclass
class SandboxLimits:
    """What one run may use."""

    wall_seconds: float = 5.0
    """Wall-clock limit, counted from the launch (the confinement's own setup, about 0.1 s, included)."""
    cpu_seconds: int = 5
    """CPU time of all the run's processes together (cgroup); also each process's RLIMIT_CPU (SIGXCPU)."""
    memory_mb: int = 1024
    """Memory of all the run's processes together, shmem and tmpfs included (cgroup); also each
    process's address space (RLIMIT_AS: Python raises MemoryError beyond it)."""
    max_processes: int = 16
    """Processes and threads (pids cgroup; RLIMIT_NPROC as well)."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 16384
    """stdout + stderr kept; a program that writes more is killed (status output_limit)."""
    workdir_mb: int = 64
    """Size of the private writable /tmp, and of the private /dev/shm (each; bubblewrap modes)."""
    nice: int = 10
    """Scheduling niceness added, so sandboxed code yields the CPU to the trainer."""
    allow_unconfined: bool = False
    """Run model code even where no confinement can be had (no bubblewrap or no user namespaces), with
    per-process limits only; false refuses such runs, and the run stops at start."""

    def __post_init__(self):
        # here, so that the run stops at start: past it every call of the python tool would fail the same way
        for name in ("cpu_seconds", "memory_mb", "max_processes", "file_mb", "open_files", "output_bytes",
                     "workdir_mb", "nice"):
            if type(getattr(self, name)) is not int:  # rlimits, byte counts and nice take integers only
                raise ValueError(f"sandbox.{name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_processes", "file_mb", "open_files",
                     "output_bytes", "workdir_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.nice <= 19:  # below 0 raises the priority, which the sandbox's unprivileged init may not
            raise ValueError(f"sandbox.nice must be in [0, 19], got {self.nice}")


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
    mode: str = ""  # "bwrap+cgroup", "bwrap" or "unconfined" (rlsys.tools.confinement)


async def run_python(code: str, limits: SandboxLimits | None = None,
                     confinement: Confinement | None = None) -> SandboxResult:
    """Runs `code` as a Python program in a fresh sandbox, confined as `confinement` says (default: the best
    this machine gives, see `rlsys.tools.confinement`). Refuses (status "refused") to run it unconfined
    unless `limits.allow_unconfined`."""
    limits = limits or SandboxLimits()
    if confinement is None:
        confinement = await asyncio.to_thread(machine_confinement)
    if confinement.mode == "unconfined" and not limits.allow_unconfined:
        return SandboxResult("refused", None, "", "", False, refusal(confinement), 0.0, [], list(confinement.notes),
                             confinement.mode)
    async with queued_for(_slots()):  # a call's time limit (`within`) does not count the wait
        return await _run(code, limits, confinement)


_semaphores: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _slots() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _semaphores:
        _semaphores[loop] = asyncio.Semaphore(MAX_CONCURRENT)
    return _semaphores[loop]


class Run:
    """One run's processes and what was seen of them: the command, the cgroup, the CPU watch."""

    def __init__(self, limits: SandboxLimits, confinement: Confinement):
        self.limits, self.confinement = limits, confinement
        self.process: asyncio.subprocess.Process | None = None
        self.cgroup: SandboxCgroup | None = None
        self.cpu_exceeded = False
        self.fds: list[int] = []
        self.workdir: str | None = None
        # run by root: how bubblewrap's user namespace gets mapped to an unprivileged uid outside
        self.pipes = UsernsPipes(confinement.namespaces and confinement.outside_uid is not None)

    def command(self, code: str, report_write: int) -> tuple[list[str], dict, str]:
        """argv, environment and working directory of the launch."""
        mib, limits = 1 << 20, self.limits
        init_limits = {"cpu_seconds": limits.cpu_seconds, "memory_bytes": limits.memory_mb * mib,
                       "max_processes": limits.max_processes, "file_bytes": limits.file_mb * mib,
                       "open_files": limits.open_files, "nice": limits.nice}
        namespaces = self.confinement.namespaces
        if namespaces:
            code_fd, seccomp_fd = self.memfd("code", code.encode()), self.memfd(
                "seccomp", deny_filter(deny_memfd=not self.confinement.cgroup))
            prefix = bwrap_command({"workdir_bytes": limits.workdir_mb * mib, "shm_bytes": limits.workdir_mb * mib},
                                   seccomp_fd, code_fd, self.pipes)
            workdir, cwd = WORKDIR, "/"
        else:
            self.workdir = workdir = cwd = tempfile.mkdtemp(prefix="rlsys-sandbox-")
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            prefix = []
        config = {"python": sys.executable, "env": PROGRAM_ENV, "limits": init_limits, "workdir": workdir,
                  "namespaces": namespaces, "drop_to": SANDBOX_UID if self.pipes.used else None}
        argv = prefix + [sys.executable, "-I", "-S", "-c", INIT_SOURCE, str(report_write), json.dumps(config)]
        # join the cgroup first, so that everything the launch starts is in it
        env = {"PATH": PROGRAM_ENV["PATH"],
               "RLSYS_CGROUP_PROCS": " ".join(self.cgroup.procs_files) if self.cgroup is not None else ""}
        return ["/bin/sh", "-c", LAUNCH, "sh", *argv], env, cwd

    def memfd(self, name: str, data: bytes) -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    async def map_user_namespace(self) -> None:
        """Run by root: once bubblewrap says its child's pid, maps that child's user namespace to the unprivileged
        uid and lets it go on."""
        if self.pipes.used:
            self.pipes.map_ids(await read_to_end(self.pipes.info), self.confinement.outside_uid)

    async def watch_cpu(self) -> None:
        """Ends the run once its processes together have used `cpu_seconds` (the cgroup counts them all)."""
        while True:
            await asyncio.sleep(CPU_POLL)
            if self.cgroup.cpu_seconds() > self.limits.cpu_seconds:
                self.cpu_exceeded = True
                self.kill()
                return

    def kill(self) -> None:
        """Without blocking the loop: the process group, and one pass over the cgroup (cleanup makes sure)."""
        if self.process is not None:
            kill_group(self.process)
        if self.cgroup is not None:
            self.cgroup.signal_all()

    def cleanup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        for fd in self.fds:
            os.close(fd)
        self.pipes.close()
        if self.workdir is not None:
            remove_scratch(self.workdir)


def remove_scratch(path: str) -> None:
    """Removes an unconfined run's work directory, whatever permissions the program left in it: run by a non-root
    user, a directory it had made unreadable or unwritable could not be emptied, and was left behind."""
    directories = [path]
    while directories:
        directory = directories.pop()
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)
            with os.scandir(directory) as entries:
                directories += [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
    shutil.rmtree(path, True)


async def _run(code: str, limits: SandboxLimits, confinement: Confinement) -> SandboxResult:
    loop = asyncio.get_running_loop()
    started = loop.time()
    run = Run(limits, confinement)
    report_read, report_write = os.pipe()
    watcher = None
    try:
        if confinement.cgroup:
            creating = asyncio.ensure_future(asyncio.to_thread(SandboxCgroup.create, limits.memory_mb << 20,
                                                               limits.max_processes + CGROUP_EXTRA_PIDS))
            try:
                run.cgroup = await asyncio.shield(creating)
            except asyncio.CancelledError:  # the thread makes it all the same: held, so that cleanup removes it
                with contextlib.suppress(OSError):
                    run.cgroup = await creating
                raise
        argv, env, cwd = run.command(code, report_write)
        run.process = process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(report_write, *run.fds, *run.pipes.passed), start_new_session=True, env=env, cwd=cwd,
            **launch_options(confinement.outside_uid if run.pipes.used else None))
        os.close(report_write)
        report_write = None
        run.pipes.launched()
        if run.cgroup is not None:
            watcher = asyncio.create_task(run.watch_cpu())
        output = CappedOutput(limits.output_bytes, on_overflow=run.kill)
        try:
            await asyncio.wait_for(_finish(run, process, output), limits.wall_seconds)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
        run.kill()  # stragglers outside a PID namespace, or the whole tree on timeout
        await asyncio.wait_for(process.wait(), REPORT_WAIT)
        report = read_report(report_read)
        oom_kills = run.cgroup.oom_kills() if run.cgroup is not None else 0
        return classify(report, output, Ending(timed_out, run.cpu_exceeded, oom_kills), limits, confinement,
                        loop.time() - started)
    except Exception as e:  # noqa: BLE001 (the caller gets a result, never an exception)
        return SandboxResult("sandbox_error", None, "", "", False, f"{type(e).__name__}: {e}",
                             loop.time() - started, list(confinement.isolation), list(confinement.notes),
                             confinement.mode)
    finally:
        if watcher is not None:
            watcher.cancel()
        if run.process is not None and run.process.returncode is None:  # cancelled: leave nothing running
            run.kill()
        for fd in (report_read, report_write):
            if fd is not None:
                os.close(fd)
        await asyncio.to_thread(run.cleanup)


async def _finish(run: Run, process: asyncio.subprocess.Process, output: "CappedOutput") -> None:
    await asyncio.gather(run.map_user_namespace(), output.drain(process.stdout, "stdout"),
                         output.drain(process.stderr, "stderr"))
    await process.wait()


async def read_to_end(fd: int) -> bytes:
    """Reads a pipe until its writers are gone, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            readable = loop.create_future()
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            continue
        if not chunk:
            return data
        data += chunk


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


@dataclass
class Ending:
    """What the parent saw end the run, besides the report: its own kills and the cgroup's OOM kills."""

    timed_out: bool
    cpu_exceeded: bool
    oom_kills: int


def classify(report: dict, output: CappedOutput, ending: Ending, limits: SandboxLimits, confinement: Confinement,
             seconds: float) -> SandboxResult:
    stdout, stderr = output.text("stdout"), output.text("stderr")
    exit_code = -report["signal"] if "signal" in report else report.get("exit")
    status, reason = outcome(report, output, ending, limits, stderr)
    return SandboxResult(status, exit_code, stdout, stderr, output.overflowed, reason, seconds,
                         list(confinement.isolation) + ["scrubbed-environment", "process-group-kill"],
                         list(confinement.notes), confinement.mode)


def outcome(report: dict, output: CappedOutput, ending: Ending, limits: SandboxLimits,
            stderr: str) -> tuple[str, str]:
    if ending.timed_out:
        return "timeout", f"wall time limit of {limits.wall_seconds:g}s exceeded; killed"
    if ending.cpu_exceeded:
        return "cpu_limit", (f"CPU time limit of {limits.cpu_seconds}s exceeded by the sandbox's processes "
                             "together; killed")
    if output.overflowed:
        return "output_limit", f"output exceeded {limits.output_bytes} bytes; killed"
    if ending.oom_kills:
        return "memory_limit", (f"the sandbox's processes together exceeded {limits.memory_mb} MiB; "
                                f"{ending.oom_kills} killed")
    if "error" in report:
        return "sandbox_error", report["error"]
    if "signal" in report:
        return signal_outcome(report["signal"], limits, report.get("cpu_seconds", 0.0))
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


def signal_outcome(number: int, limits: SandboxLimits, cpu_seconds: float) -> tuple[str, str]:
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    if number == signal.SIGXCPU:
        return "cpu_limit", f"CPU time limit of {limits.cpu_seconds}s exceeded (SIGXCPU)"
    if number == signal.SIGKILL and cpu_seconds >= limits.cpu_seconds:  # RLIMIT_CPU's hard limit: SIGXCPU was ignored
        return "cpu_limit", f"CPU time limit of {limits.cpu_seconds}s exceeded (SIGKILL; the program ignored SIGXCPU)"
    if number == signal.SIGXFSZ:
        return "file_size_limit", f"file size limit of {limits.file_mb} MiB exceeded (SIGXFSZ)"
    return "crashed", f"killed by {name}"
