"""The code sandbox under hostile programs: each attack is stopped or contained, the result says how,
and the test process and its event loop go on (a heartbeat keeps ticking while they all run at once)."""

import asyncio
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from rlsys.tools import sandbox
from rlsys.tools.sandbox import SANDBOX_UIDS, SandboxLimits, run_python

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=2, memory_mb=512, max_processes=16, file_mb=4,
                       output_bytes=4096)
SECRET_NAME = "RLSYS_TEST_SECRET"

INFINITE_LOOP = "while True:\n    pass\n"
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
HUGE_ALLOCATION = "block = bytearray(10 * 2**30)\n"
WRITE_OUTSIDE = """
import json
results = {}
for path in PATHS:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        results[path] = "written"
    except OSError as e:
        results[path] = e.strerror
print(json.dumps(results))
"""
NETWORK = """
import json, socket
results = {}
for host in ("127.0.0.1", "10.0.0.1", "pypi.org"):
    try:
        socket.create_connection((host, PORT), timeout=2).close()
        results[host] = "connected"
    except OSError as e:
        results[host] = str(e)
print(json.dumps(results))
"""
READ_ENVIRONMENT = """
import json, os
holders = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if SECRET.encode() in f.read():
                holders.append(pid)
    except OSError:
        pass
print(json.dumps({"environ": dict(os.environ), "holders": holders, "pids": sorted(filter(str.isdigit, os.listdir("/proc")))}))
"""
OUTPUT_FLOOD = "while True:\n    print('x' * 1000)\n"
BIG_FILE = "with open('big', 'wb') as f:\n    f.write(b'0' * (64 * 2**20))\n"
SEGFAULT = "import ctypes\nctypes.string_at(0)\n"


def live_sandbox_processes() -> list[int]:
    """Processes (not yet-unreaped zombies) running as any sandbox uid."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
        state = re.search(r"^State:\s+(\S)", status, re.M).group(1)
        if SANDBOX_UIDS[0] <= uid < SANDBOX_UIDS[1] and state != "Z":
            pids.append(int(entry))
    return pids


async def wait_until_no_sandbox_processes(seconds: float = 3.0) -> list[int]:
    for _ in range(int(seconds / 0.05)):
        if not (left := live_sandbox_processes()):
            return left
        await asyncio.sleep(0.05)
    return live_sandbox_processes()


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
def writable_outside():
    """A world-writable directory outside every place the sandbox may write, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix=".sandbox-probe-", dir=ROOT))
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory)


def test_hostile_programs_are_stopped_or_contained_while_the_loop_runs(monkeypatch, tmp_path, writable_outside):
    secret = secrets.token_hex(16)
    monkeypatch.setenv(SECRET_NAME, secret)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # so we can see every work dir is removed
    monkeypatch.setattr(sandbox, "MAX_CONCURRENT", 16)  # all at once: the worst case for the event loop
    targets = [str(writable_outside / "escaped.txt"), "/etc/rlsys-sandbox-escape", "../escaped.txt",
               str(ROOT / "rlsys-sandbox-escape")]

    async def attack():
        connections = []
        server = await asyncio.start_server(lambda r, w: connections.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        programs = {
            "infinite_loop": INFINITE_LOOP, "fork_bomb": FORK_BOMB, "huge_allocation": HUGE_ALLOCATION,
            "write_outside": WRITE_OUTSIDE.replace("PATHS", repr(targets)),
            "network": NETWORK.replace("PORT", str(port)), "read_environment": READ_ENVIRONMENT.replace(
                "SECRET", repr(secret)), "output_flood": OUTPUT_FLOOD, "big_file": BIG_FILE, "segfault": SEGFAULT,
        }
        heartbeat = Heartbeat()
        beating = asyncio.create_task(heartbeat.run())
        results = await asyncio.gather(*(run_python(code, LIMITS) for code in programs.values()))
        beating.cancel()
        server.close()
        after = await run_python("print(6 * 7)", LIMITS)
        return dict(zip(programs, results)), heartbeat, connections, after, await wait_until_no_sandbox_processes()

    results, heartbeat, connections, after, leftovers = asyncio.run(attack())
    isolation = results["write_outside"].isolation
    print({name: (r.status, r.reason, round(r.seconds, 2)) for name, r in results.items()})
    print("isolation:", isolation, "notes:", results["write_outside"].notes, "longest gap:", heartbeat.longest_gap)

    assert results["infinite_loop"].status in ("cpu_limit", "timeout")
    assert results["fork_bomb"].status in ("cpu_limit", "timeout")
    assert results["huge_allocation"].status == "memory_limit" and "MemoryError" in results["huge_allocation"].stderr
    assert results["output_flood"].status == "output_limit" and results["output_flood"].truncated
    assert len(results["output_flood"].stdout.encode()) <= LIMITS.output_bytes
    assert results["big_file"].status == "file_size_limit", results["big_file"]
    assert results["segfault"].status == "crashed" and results["segfault"].exit_code == -11
    assert "SIGSEGV" in results["segfault"].reason
    for name, result in results.items():
        assert result.seconds < LIMITS.wall_seconds + 3, name  # every one ended within its limits
        assert "rlimits" in result.isolation and "scrubbed-environment" in result.isolation

    environment = json.loads(results["read_environment"].stdout)
    assert SECRET_NAME not in environment["environ"] and secret not in results["read_environment"].stdout
    assert environment["holders"] == []

    if "mount-namespace" not in isolation:
        pytest.skip(f"no namespaces on this machine ({results['write_outside'].notes}); limits were checked")
    assert "read-only-filesystem" in isolation and "network-namespace" in isolation and "pid-namespace" in isolation
    assert all(outcome != "written" for outcome in json.loads(results["write_outside"].stdout).values())
    assert not (writable_outside / "escaped.txt").exists() and not (ROOT / "rlsys-sandbox-escape").exists()
    assert not Path("/etc/rlsys-sandbox-escape").exists()
    assert all(outcome != "connected" for outcome in json.loads(results["network"].stdout).values())
    assert connections == []
    assert environment["pids"] == ["1", "2"]  # its own init and itself: nothing of the host is visible

    assert leftovers == []  # the fork bomb's processes died with it
    assert heartbeat.longest_gap < 1.0 and heartbeat.ticks > 50
    assert after.status == "ok" and after.stdout == "42\n"  # the sandbox still works after all that
    assert list(tmp_path.iterdir()) == []  # every run's work directory was removed


def test_a_cancelled_run_leaves_no_process(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    async def cancel_midway():
        run = asyncio.create_task(run_python("import time\ntime.sleep(60)\n", SandboxLimits(wall_seconds=30)))
        await asyncio.sleep(1.0)
        started = live_sandbox_processes()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return started, await wait_until_no_sandbox_processes()

    started, leftovers = asyncio.run(cancel_midway())
    if started:  # only a run under its own uid can be told apart from the test's processes
        assert leftovers == []
    assert list(tmp_path.iterdir()) == []


def test_sleeping_program_hits_the_wall_clock_and_children_die_with_it():
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\ntime.sleep(60)\n"
    result = asyncio.run(run_python(code, SandboxLimits(wall_seconds=1.5)))
    assert result.status == "timeout" and "1.5s" in result.reason
    assert asyncio.run(wait_until_no_sandbox_processes()) == []


def test_program_output_exit_code_and_errors_come_back():
    ok = asyncio.run(run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"))
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == ("ok", 0, "out\n", "err\n")
    failed = asyncio.run(run_python("raise ValueError('bad input')\n"))
    assert failed.status == "error" and failed.exit_code == 1 and failed.reason == "ValueError: bad input"
    exited = asyncio.run(run_python("import sys\nsys.exit(3)\n"))
    assert exited.status == "error" and exited.exit_code == 3


def test_without_isolation_the_limits_still_hold_and_the_result_says_what_is_missing():
    result = asyncio.run(run_python(INFINITE_LOOP, SandboxLimits(wall_seconds=5, cpu_seconds=1), isolate=False))
    assert result.status == "cpu_limit"
    assert "network-namespace" not in result.isolation and "rlimits" in result.isolation
    assert "isolation disabled by the caller" in result.notes
