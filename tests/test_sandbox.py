"""The code sandbox under hostile programs, in every mode the code can choose, as root and as an
unprivileged user: each attack of `tests/sandbox_attacks.py` is contained unless the mode is known
not to contain it (and says so), the result says which mode and isolation were in force, the event
loop keeps running, and nothing is left behind (processes, zombies, cgroups, work directories)."""

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from rlsys.tools.confinement import SandboxUnavailable, machine_confinement, preflight
from rlsys.tools.python_interpreter import PythonTool
from rlsys.tools.sandbox import SandboxLimits, run_python
from tests.sandbox_attacks import (EXPECTED_GAPS, FROM_COPY, confinements, copy_sandbox, prepare, run_as,
                                    run_attacks)

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=2, memory_mb=512, max_processes=16, file_mb=4,
                       output_bytes=4096, allow_unconfined=True)
AS_ROOT = os.geteuid() == 0


def gaps_of(report: dict, mode: str) -> set[str]:
    return {name for name, outcome in report.items() if not outcome["contained"]} - EXPECTED_GAPS[mode]


def zombies_of(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def processes_with_argument(argument: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if argument.encode() in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def sandbox_cgroups() -> list[Path]:
    """Cgroups this test process made and did not remove."""
    return [p for p in Path("/sys/fs/cgroup").glob(f"**/rlsys-sandbox-{os.getpid()}-*") if p.is_dir()]


class Heartbeat:
    """Ticks every 20 ms; the longest gap between ticks shows whether anything blocked the event loop."""

    def __init__(self):
        self.longest_gap, self.ticks = 0.0, 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.02)
            now = loop.time()
            self.longest_gap, last, self.ticks = max(self.longest_gap, now - last), now, self.ticks + 1


@pytest.fixture
def workspace():
    """Outside the sandbox, readable and writable by anyone: the sandbox, not permissions, must stop reads and
    writes."""
    directory = Path(tempfile.mkdtemp(prefix="rlsys-attack-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("mode", ["machine", "bwrap", "unconfined"])
def test_attacks_are_contained_in_each_mode_as_far_as_the_mode_claims(mode, workspace):
    modes = confinements()
    if mode == "machine":
        mode = machine_confinement().mode
    if mode not in modes:
        pytest.skip(f"mode {mode} cannot run here: {machine_confinement().notes}")
    secret = secrets.token_hex(16)
    prepare(workspace / "attack", secret)

    async def attack():
        heartbeat = Heartbeat()
        beating = asyncio.create_task(heartbeat.run())
        report = await run_attacks(modes[mode], workspace / "attack", secret)
        beating.cancel()
        return report, heartbeat

    report, heartbeat = asyncio.run(attack())
    print(mode, {name: (o["contained"], o["status"], o["reason"][:60]) for name, o in report.items()})
    assert gaps_of(report, mode) == set(), report
    assert {o["mode"] for o in report.values() if o["status"] != "not run"} == {mode}
    assert heartbeat.longest_gap < 1.0 and heartbeat.ticks > 50  # the loop ran throughout
    assert zombies_of(os.getpid()) == [] and sandbox_cgroups() == []
    assert list(Path("/dev/shm").glob("rlsys-attack-*")) == []


VSOCK = """
import errno, socket
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    print("made")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


@pytest.mark.parametrize("mode", ["machine", "bwrap"])
def test_no_vsock_socket_is_made_past_the_network_namespace(mode):
    """The network namespace has no interface, but vsock is no part of it: from any namespace, a socket of that family
    talks to the hypervisor's host (CID 2). Nothing is connected to here; the seccomp filter must refuse the socket."""
    modes = confinements()
    mode = machine_confinement().mode if mode == "machine" else mode
    if mode not in modes or not modes[mode].namespaces:
        pytest.skip(f"mode {mode} cannot run here: {machine_confinement().notes}")
    result = asyncio.run(run_python(VSOCK, LIMITS, modes[mode]))
    assert (result.status, result.stdout) == ("ok", "EPERM\n"), result


@pytest.mark.skipif(not AS_ROOT or not shutil.which("setpriv"), reason="needs root to become another user")
def test_as_an_unprivileged_user_the_sandbox_holds_or_refuses(workspace):
    """The non-root path for real: the suite runs as `nobody`, with the system's Python (the one a user can read)."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 for the unprivileged user")
    result = run_as(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all"], python, workspace, "nobody")
    print(result["mode"], result["notes"], {n: (o["contained"], o["status"]) for n, o in result["results"].items()})
    assert result["uid"] != 0
    assert result["mode"] in ("bwrap", "bwrap+cgroup"), result["notes"]  # user namespaces work here
    if result["mode"] == "bwrap":
        assert any("no cgroup" in note for note in result["notes"])  # said at start
    assert gaps_of(result["results"], result["mode"]) == set(), result["results"]
    assert not (workspace / "attack" / "owned" / "escaped.txt").exists()


@pytest.mark.skipif(not AS_ROOT or not shutil.which("setpriv"), reason="needs root to drop CAP_SYS_ADMIN")
def test_as_root_without_cap_sys_admin_the_sandbox_holds(workspace):
    """A container's root: no CAP_SYS_ADMIN, so bubblewrap must make its user namespace to confine."""
    result = run_as(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"], sys.executable, workspace)
    print(result["mode"], result["notes"], {n: (o["contained"], o["status"]) for n, o in result["results"].items()})
    assert result["mode"] in ("bwrap", "bwrap+cgroup"), result["notes"]
    assert gaps_of(result["results"], result["mode"]) == set(), result["results"]


@pytest.mark.skipif(not AS_ROOT, reason="the uid drop is root's path")
@pytest.mark.parametrize("uid", [None, 54321])
def test_run_by_root_the_sandbox_runs_as_an_unprivileged_uid_outside(uid, monkeypatch):
    """Run by root, the sandbox's uid must map to an unprivileged one outside (nobody, or RLSYS_SANDBOX_UID), with no
    supplementary group and no capability: seen from outside, on a process the program started."""
    if uid is not None:
        monkeypatch.setenv("RLSYS_SANDBOX_UID", str(uid))
    machine_confinement.cache_clear()
    try:
        confinement = machine_confinement()
        if not confinement.namespaces:
            pytest.skip(f"no sandbox on this machine: {confinement.notes}")
        expected = uid or 65534
        marker = f"{secrets.randbelow(10**6) + 100}.75"
        code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(60)\n"

        async def look_from_outside():
            run = asyncio.create_task(run_python(code, SandboxLimits(wall_seconds=30), confinement))
            for _ in range(200):
                await asyncio.sleep(0.05)
                if processes_with_argument(marker):
                    break
            status = {line.split(":")[0]: line.split(":", 1)[1].split()
                      for line in Path(f"/proc/{processes_with_argument(marker)[0]}/status").read_text().splitlines()}
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return status

        status = asyncio.run(look_from_outside())
        assert status["Uid"] == [str(expected)] * 4 and status["Gid"] == [str(expected)] * 4, status
        assert status["Groups"] == [] and status["NoNewPrivs"] == ["1"], status
        assert all(int(status[c][0], 16) == 0 for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), status
        result = asyncio.run(run_python("open('written', 'w').write('x')\nprint(open('written').read())\n",
                                        SandboxLimits(), confinement))
        assert result.status == "ok" and result.stdout == "x\n", result  # the scratch is the program's to write
        assert f"outside-uid-{expected}" in result.isolation and confinement.outside_uid == expected  # said
    finally:
        machine_confinement.cache_clear()


def test_without_bubblewrap_the_run_stops_at_start_unless_unconfined_is_allowed(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bwrap (or where it cannot make namespaces)
    machine_confinement.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed.*sandbox.allow_unconfined=true"):
            preflight(allow_unconfined=False)
        with pytest.raises(SandboxUnavailable):
            PythonTool()
        refused = asyncio.run(run_python("print('ran')", SandboxLimits()))
        assert refused.status == "refused" and refused.stdout == "" and "bubblewrap" in refused.reason
        assert preflight(allow_unconfined=True).mode == "unconfined"
        allowed = asyncio.run(run_python("print('ran')", SandboxLimits(allow_unconfined=True)))
        assert allowed.status == "ok" and allowed.mode == "unconfined" and "pid-namespace" not in allowed.isolation
    finally:
        machine_confinement.cache_clear()


def test_the_tools_experiment_without_a_sandbox_is_a_config_error_not_a_traceback(monkeypatch, tmp_path):
    """The command line prints a ConfigError as `error: ...` (exit 2); SandboxUnavailable went through it as a
    traceback. So did RLSYS_SANDBOX_UID that is no number, as int()'s own message."""
    from rlsys.cli import ConfigError, parse_config

    monkeypatch.setenv("PATH", str(tmp_path))
    machine_confinement.cache_clear()
    try:
        with pytest.raises(ConfigError, match="bubblewrap is not installed.*sandbox.allow_unconfined=true"):
            parse_config(["experiment=async-ppo-math-tools"])
        assert parse_config(["experiment=async-ppo-math-tools", "sandbox.allow_unconfined=true"]).tools == [
            "calculator", "python"]
        if os.geteuid() == 0:  # the uid outside is chosen only for root
            monkeypatch.undo()
            monkeypatch.setenv("RLSYS_SANDBOX_UID", "nobody")
            machine_confinement.cache_clear()
            with pytest.raises(ConfigError, match="RLSYS_SANDBOX_UID='nobody' is not a uid: give a number"):
                parse_config(["experiment=async-ppo-math-tools"])
    finally:
        machine_confinement.cache_clear()


def test_every_tool_result_carries_the_isolation_in_force():
    async def call():
        tool = PythonTool(limits={"wall_seconds": 5})
        await tool.start()
        return await tool.call(code="print(1 + 1)")

    output = asyncio.run(call())
    assert output.text == "2\n" and output.isolation[0] == f"mode={machine_confinement().mode}"
    assert set(machine_confinement().isolation) <= set(output.isolation)


def test_limits_output_and_crashes_are_classified():
    programs = {"huge_allocation": "block = bytearray(10 * 2**30)\n",
                "output_flood": "while True:\n    print('x' * 1000)\n",
                "big_file": "with open('big', 'wb') as f:\n    f.write(b'0' * (64 * 2**20))\n",
                "segfault": "import ctypes\nctypes.string_at(0)\n"}

    async def run_all():
        return await asyncio.gather(*(run_python(code, LIMITS) for code in programs.values()))

    results = dict(zip(programs, asyncio.run(run_all())))
    assert results["huge_allocation"].status == "memory_limit" and "MemoryError" in results["huge_allocation"].stderr
    assert results["output_flood"].status == "output_limit" and results["output_flood"].truncated
    assert len(results["output_flood"].stdout.encode()) <= LIMITS.output_bytes
    assert results["big_file"].status == "file_size_limit", results["big_file"]
    assert results["segfault"].status == "crashed" and results["segfault"].exit_code == -11
    assert "SIGSEGV" in results["segfault"].reason


def test_a_cancelled_run_leaves_no_process(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    marker = f"{secrets.randbelow(10**6) + 100}.25"
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(60)\n"

    async def cancel_midway():
        run = asyncio.create_task(run_python(code, SandboxLimits(wall_seconds=30)))
        for _ in range(200):  # until the program's child runs
            await asyncio.sleep(0.05)
            if processes_with_argument(marker):
                break
        started = processes_with_argument(marker)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        for _ in range(60):
            if not processes_with_argument(marker):
                break
            await asyncio.sleep(0.05)
        return started, processes_with_argument(marker)

    started, leftovers = asyncio.run(cancel_midway())
    assert started and leftovers == []
    assert list(tmp_path.iterdir()) == [] and sandbox_cgroups() == [] and zombies_of(os.getpid()) == []


def test_a_run_cancelled_while_its_cgroup_is_made_leaves_no_cgroup(monkeypatch):
    """The cgroup is made in a thread, which a cancelled run cannot stop: the run must still remove what it makes."""
    if not machine_confinement().cgroup:
        pytest.skip(f"no cgroup here ({machine_confinement().notes})")
    from rlsys.tools.sandbox_cgroup import SandboxCgroup

    create, making, made, go_on = SandboxCgroup.create, threading.Event(), threading.Event(), threading.Event()

    def held_back(*args):  # made only once the run has been cancelled
        making.set()
        go_on.wait()
        try:
            return create(*args)
        finally:
            made.set()

    monkeypatch.setattr(SandboxCgroup, "create", held_back)

    async def cancel_while_making():
        run = asyncio.create_task(run_python("print(1)", SandboxLimits()))
        await asyncio.to_thread(making.wait)
        run.cancel()
        await asyncio.sleep(0)
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await run
        await asyncio.to_thread(made.wait)

    asyncio.run(cancel_while_making())
    assert sandbox_cgroups() == []


def test_sleeping_program_hits_the_wall_clock_and_children_die_with_it():
    marker = f"{secrets.randbelow(10**6) + 100}.5"
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\ntime.sleep(60)\n"
    result = asyncio.run(run_python(code, SandboxLimits(wall_seconds=1.5)))
    assert result.status == "timeout" and "1.5s" in result.reason
    assert processes_with_argument(marker) == [] and sandbox_cgroups() == []


def test_program_output_exit_code_and_errors_come_back():
    ok = asyncio.run(run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"))
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == ("ok", 0, "out\n", "err\n")
    failed = asyncio.run(run_python("raise ValueError('bad input')\n"))
    assert failed.status == "error" and failed.exit_code == 1 and failed.reason == "ValueError: bad input"
    exited = asyncio.run(run_python("import sys\nsys.exit(3)\n"))
    assert exited.status == "error" and exited.exit_code == 3


def test_the_seccomp_filter_is_refused_where_it_has_no_table(monkeypatch):
    from rlsys.tools import seccomp_filter

    monkeypatch.setattr(seccomp_filter.os, "uname", lambda: os.uname_result(("Linux", "h", "r", "v", "riscv64")))
    with pytest.raises(OSError, match="no system-call table for riscv64"):
        seccomp_filter.deny_filter(True)


def test_an_interpreter_in_a_venv_under_tmp_runs_confined():
    """The sandbox mounts a private /tmp; an interpreter that lives under /tmp (a venv there) must still be
    visible inside it, bound read-only over the private one. In /tmp itself, not pytest's tmp_path: TMPDIR may move
    that elsewhere."""
    if machine_confinement().mode == "unconfined":  # probed here, not at collection: it starts bubblewrap
        pytest.skip(f"no sandbox on this machine: {machine_confinement().notes}")
    venv = Path(tempfile.mkdtemp(prefix="rlsys-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True)
        code = ("import asyncio, sys\nfrom rlsys.tools.sandbox import run_python\n"
                "r = asyncio.run(run_python('import sys; print(sys.prefix)'))\n"
                "print(r.status, r.stdout.strip(), r.isolation, r.stderr, r.reason)\n")

        def run_in_venv() -> str:
            return subprocess.run([str(venv / "bin" / "python3"), "-c", code], capture_output=True, text=True,
                                  cwd=ROOT, timeout=120).stdout

        if AS_ROOT:  # mkdtemp's 0700, root's: the unprivileged uid the program runs as cannot read it, and is told so
            out = run_in_venv()
            assert out.startswith("sandbox_error") and f"{venv}/bin/python3 (run by root" in out, out
        venv.chmod(0o755)  # as `python -m venv` makes it
        out = run_in_venv()
        assert out.split()[:2] == ["ok", str(venv)], out
    finally:
        shutil.rmtree(venv, ignore_errors=True)


# Holds loopback TCP connections whose bytes nobody reads: the kernel keeps them in socket buffers
TCP_BUFFERS = """
import socket
held, connections = 0, []
listener = socket.create_server(("127.0.0.1", 0))
try:
    for _ in range(28):
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        connections += [client, server]
        for end in (client, server):
            end.setblocking(False)
            while True:
                try:
                    held += end.send(b"x" * 65536)
                except BlockingIOError:
                    break
except OSError as e:
    print(e)
print(held >> 20)
"""


def test_socket_buffers_count_against_the_memory_limit():
    """Bytes sent on connections nobody reads are kernel memory of the sandbox's: a cgroup v1 counts TCP buffers
    only under a limit of their own, without which 28 connections held about three times the memory limit."""
    if not machine_confinement().cgroup:
        pytest.skip(f"no cgroup here: memory limits hold per process only ({machine_confinement().notes})")
    limits = SandboxLimits(wall_seconds=20, memory_mb=64)
    result = asyncio.run(run_python(TCP_BUFFERS, limits))
    assert result.status in ("ok", "memory_limit"), result
    if result.status == "ok":
        # within the limit, give or take the few pages the kernel lets each socket take under memory pressure
        assert int(result.stdout.split()[-1]) <= limits.memory_mb * 1.25, result.stdout


# Run from a trainer under a real-time policy (SCHED_RR 1), in every mode: the policy the program runs under
REAL_TIME_TRAINER = """
import asyncio, os, sys
from rlsys.tools.sandbox import SandboxLimits, run_python
from tests.sandbox_attacks import confinements
try:
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
except PermissionError:
    sys.exit("no CAP_SYS_NICE")
code = "import os\\nprint(os.sched_getscheduler(0), os.nice(0))\\n"
for mode, confinement in confinements().items():
    result = asyncio.run(run_python(code, SandboxLimits(allow_unconfined=True), confinement))
    print(mode, result.status, result.stdout.strip())
"""


def test_the_program_does_not_inherit_a_real_time_policy_from_the_trainer():
    """Inherited through fork and exec, a real-time policy put model code above every ordinary process on the machine
    (the trainer's own threads included), where its nice value does not count."""
    done = subprocess.run([sys.executable, "-c", REAL_TIME_TRAINER], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    if "no CAP_SYS_NICE" in done.stderr:
        pytest.skip("needs CAP_SYS_NICE to run the trainer under a real-time policy")
    runs = [line.split(maxsplit=2) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and runs, done.stderr
    assert {status for _, status, _ in runs} == {"ok"}, done.stdout
    assert {policy_and_nice for _, _, policy_and_nice in runs} == {f"{os.SCHED_OTHER} 10"}, done.stdout


IGNORES_SIGXCPU = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
KILLS_ITSELF = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"


@pytest.mark.parametrize("mode", ["machine", "bwrap", "unconfined"])
def test_a_program_that_ignores_sigxcpu_is_stopped_as_over_its_cpu_limit(mode):
    """Without a cgroup, RLIMIT_CPU's hard limit (a second past the soft one) SIGKILLs a program that ignores SIGXCPU:
    that is the CPU limit, not a crash, while a SIGKILL the program sends itself early is still a crash."""
    modes = confinements()
    mode = machine_confinement().mode if mode == "machine" else mode
    if mode not in modes:
        pytest.skip(f"mode {mode} cannot run here: {machine_confinement().notes}")
    limits = SandboxLimits(wall_seconds=20, cpu_seconds=1, allow_unconfined=True)
    over = asyncio.run(run_python(IGNORES_SIGXCPU, limits, modes[mode]))
    assert over.status == "cpu_limit" and "CPU time limit of 1s exceeded" in over.reason, over
    killed = asyncio.run(run_python(KILLS_ITSELF, limits, modes[mode]))
    assert (killed.status, killed.exit_code, killed.reason) == ("crashed", -9, "killed by SIGKILL"), killed


# A caller with 40 threads, as a trainer has: unconfined, a non-root user's RLIMIT_NPROC counts all of its tasks
THREADED_CALLER = """
import asyncio, threading
from rlsys.tools.confinement import unconfined
from rlsys.tools.sandbox import SandboxLimits, run_python
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(40)]
for thread in threads:
    thread.start()
code = "import subprocess\\nprint(subprocess.run(['true']).returncode)\\n"
result = asyncio.run(run_python(code, SandboxLimits(max_processes=4, allow_unconfined=True), unconfined("chosen")))
stop.set()
print(result.status, result.stdout.strip(), result.reason)
"""


def run_as_nobody(workspace: Path, script: str) -> str:
    """`script`'s output, run as nobody by the system's Python, importing the sandbox from a copy in `workspace`."""
    python = "/usr/bin/python3"
    if not AS_ROOT or not shutil.which("setpriv") or not os.access(python, os.X_OK):
        pytest.skip("needs root, setpriv and a system python3 to run as an unprivileged user")
    copy_sandbox(workspace)
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", python, "-I", "-c",
                           FROM_COPY.format(directory=str(workspace)) + script], capture_output=True,
                          text=True, timeout=60, cwd=workspace, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_unconfined_a_threaded_non_root_caller_leaves_the_program_its_processes(workspace):
    """RLIMIT_NPROC counts threads; the init counted the caller's processes only, so a caller with more threads than
    max_processes left a limit below what it already ran: the init's own fork failed, every run a sandbox_error."""
    assert run_as_nobody(workspace, THREADED_CALLER).strip() == "ok 0"


# Unconfined, run by nobody, the program locks up what it made in its work directory
LOCKED_SCRATCH = """
import asyncio, os, tempfile
from rlsys.tools.confinement import unconfined
from rlsys.tools.sandbox import SandboxLimits, run_python
tempfile.tempdir = tempfile.mkdtemp(prefix="rlsys-scratch-")
print(tempfile.tempdir)
code = "import os\\nos.makedirs('d/e')\\nopen('d/e/f', 'w').close()\\nos.chmod('d/e', 0)\\nos.chmod('d', 0o500)\\n"
result = asyncio.run(run_python(code, SandboxLimits(allow_unconfined=True), unconfined("chosen")))
print(result.status, os.listdir(tempfile.tempdir))
"""


def test_unconfined_the_work_directory_goes_whatever_permissions_the_program_left(workspace):
    """Run by a non-root user, a directory the program made unreadable or unwritable stopped the work directory's
    removal: one left behind in the caller's TMPDIR for every such run."""
    output = run_as_nobody(workspace, LOCKED_SCRATCH).split("\n", 1)
    shutil.rmtree(output[0])
    assert output[1].strip() == "ok []", output


OOM_SCORE = ("import subprocess\n"
             "print(subprocess.run(['cat', '/proc/self/oom_score_adj'], capture_output=True).stdout)\n")


def test_the_sandbox_is_the_oom_killer_s_first_pick_not_the_trainer():
    """The trainer's OOM score was inherited: where memory runs out as a whole (mode `bwrap` bounds memory per process
    only; or a container's score, the same for all its processes), the kernel killed the largest, the trainer."""
    results = {mode: asyncio.run(run_python(OOM_SCORE, LIMITS, confinement))
               for mode, confinement in confinements().items()}
    assert {mode: (r.status, r.stdout) for mode, r in results.items()} == {
        mode: ("ok", "b'1000\\n'\n") for mode in results}, results
    assert Path("/proc/self/oom_score_adj").read_text() != "1000\n"  # the caller's own is left as it was


# Run from a trainer that blocks SIGALRM and SIGXCPU and ignores SIGTSTP, in every mode: what the program starts with
SIGNAL_MASKING_TRAINER = """
import asyncio, signal
from rlsys.tools.sandbox import SandboxLimits, run_python
from tests.sandbox_attacks import confinements
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGXCPU})
signal.signal(signal.SIGTSTP, signal.SIG_IGN)
code = ("import signal\\nprint(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), "
        "int(signal.getsignal(signal.SIGTSTP)))\\n")
for mode, confinement in confinements().items():
    result = asyncio.run(run_python(code, SandboxLimits(allow_unconfined=True), confinement))
    print(mode, result.status, result.stdout.strip())
"""


def test_the_program_does_not_inherit_the_trainer_s_blocked_or_ignored_signals():
    """Blocked and ignored signals survive fork and exec: the program started with SIGALRM blocked (an alarm-based
    timeout in model code never fired) and SIGXCPU blocked (the CPU limit's first signal never came)."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_MASKING_TRAINER], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    runs = [line.split(maxsplit=2) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and runs, done.stderr
    assert {(status, started) for _, status, started in runs} == {("ok", f"[] {int(signal.SIG_DFL)}")}, done.stdout
