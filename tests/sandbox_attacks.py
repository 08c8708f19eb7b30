"""Hostile programs against the code sandbox, each with the test of whether it was contained.

`tests/test_sandbox.py` runs them in every confinement mode and asserts what must hold in each;
`bench/sandbox_attacks.py` prints the table of contained attacks per mode. They live with the tests, not in
the library: nothing a run does calls them. Standard library only besides the sandbox's own modules, so that it
also runs under an unprivileged user with the system's Python (`python tests/sandbox_attacks.py MODE WORKSPACE`
prints one mode's results as JSON).

An attack is contained when the program could not do what it tried: hold capabilities, change mounts,
make namespaces, trace, write a host path its user owns or a host-wide sysctl, read a dataset outside,
change a host device node or read what /proc shows the host's root only, reach the network, read the
caller's environment, hold more memory or CPU than the sandbox's limits together, or make the sandbox's own
report lie (a SIGINT to its init, a SIGXCPU read as a crash).
"""

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from rlsys.tools.confinement import Confinement, machine_confinement, unconfined, without_cgroup
from rlsys.tools.sandbox import SandboxLimits, SandboxResult, run_python

LIMITS = SandboxLimits(wall_seconds=10, cpu_seconds=2, memory_mb=128, max_processes=16, file_mb=16,
                       output_bytes=8192, workdir_mb=32, allow_unconfined=True)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# the sandbox's modules and what they import of rlsys, under rlsys/
SANDBOX_MODULES = ("cancellation", "tools/confine", "tools/confinement", "tools/queue_time", "tools/sandbox",
                   "tools/sandbox_cgroup", "tools/seccomp_filter")
# imports the sandbox from a copy of its modules only (`copy_sandbox`), without the package's dependencies
FROM_COPY = """
import sys, types
sys.path.insert(0, {directory!r})
for name in ("rlsys", "rlsys.tools"):
    module = types.ModuleType(name)
    module.__path__ = [{directory!r} + "/" + name.replace(".", "/")]
    sys.modules[name] = module
"""
# runs the attack suite in another process (another user), from a copy of the sandbox's modules only
AS_USER = FROM_COPY + """
import sandbox_attacks
sys.argv = ["sandbox_attacks", {workspace!r}]
sandbox_attacks.main()
"""

# what each mode is known not to contain (README and BENCHMARKS say so); everything else must be contained
AGGREGATE = {"forked-memory-3x80MiB", "forked-cpu-4x1.5s"}  # limits per process only, without a cgroup
EXPECTED_GAPS = {
    "bwrap+cgroup": set(),
    "bwrap": AGGREGATE,  # run by root too: RLIMIT_NPROC binds the unprivileged uid the sandbox runs as
    "unconfined": {"capabilities", "unmount", "remount-read-write", "namespaces-ptrace-keyctl", "write-owned-host-path",
                   "read-dataset", "network", "memfd-flood", "dev-shm-flood", "write-outside-scratch",
                   "sysv-shm-256MiB"} | AGGREGATE
    | ({"fork-bomb", "open-host-sysctls-for-writing", "chmod-host-device-nodes", "read-root-only-proc"}
       if os.geteuid() == 0 else set()),
}

SYSCALLS = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(result):
    return "ok" if result == 0 else "errno %d" % ctypes.get_errno()
def outcomes_of(paths, action):
    outcomes = {}
    for path in paths:
        try:
            action(path)
            outcomes[path] = "ok"
        except OSError as e:
            outcomes[path] = e.strerror
    return outcomes
"""
CAPABILITIES = """
status = open("/proc/self/status").read()
print(json.dumps({line.split(":")[0]: line.split()[1] for line in status.splitlines() if line.startswith("Cap")}))
"""
UNMOUNT = """
print(json.dumps({path: attempt(libc.umount2(path.encode(), 2)) for path in ("/tmp", "/proc", "/usr")}))
"""
REMOUNT = """
MS_REMOUNT, MS_BIND = 0x20, 0x1000
print(json.dumps({path: attempt(libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND, None))
                  for path in ("/", "/usr")}))
"""
NAMESPACES = """
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
print(json.dumps({"unshare-user": attempt(libc.unshare(CLONE_NEWUSER)),
                  "unshare-mount": attempt(libc.unshare(CLONE_NEWNS)),
                  "ptrace-traceme": attempt(libc.ptrace(0, 0, None, None)),
                  "keyctl": attempt(libc.syscall(250, 0, 0, 0, 0))}))
"""
WRITE_HOST = """
import json
try:
    with open(TARGET, "w") as f:
        f.write("escaped")
    print(json.dumps("written"))
except OSError as e:
    print(json.dumps(e.strerror))
"""
READ_FILE = """
import json
try:
    print(json.dumps(open(PATH).read()))
except OSError as e:
    print(json.dumps(e.strerror))
"""
NETWORK = """
import json, socket
results = {}
for host in ("127.0.0.1", "10.0.0.1"):
    try:
        socket.create_connection((host, PORT), timeout=2).close()
        results[host] = "connected"
    except OSError as e:
        results[host] = str(e)
print(json.dumps(results))
"""
# host-wide sysctls (core_pattern runs a program as the host's root); opened for writing, nothing written
HOST_SYSCTLS = """
paths = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches")
print(json.dumps(outcomes_of(paths, lambda path: os.close(os.open(path, os.O_WRONLY)))))
"""
# the host's device nodes (bubblewrap binds them into the sandbox's /dev): chmod to the mode each already has, so
# that even where it succeeds nothing changes; success means the program could as well make /dev/null 000
# (every other user's process then fails to open it)
CHMOD_DEVICE_NODES = """
paths = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
print(json.dumps(outcomes_of(paths, lambda path: os.chmod(path, os.stat(path).st_mode & 0o7777))))
"""
# what /proc shows the host's root only: files of mode 0400, and the keys /proc/keys lists to their owner
ROOT_ONLY_PROC = """
outcomes = outcomes_of(("/proc/timer_list", "/proc/slabinfo", "/proc/vmallocinfo"),
                       lambda path: os.close(os.open(path, os.O_RDONLY)))
try:
    outcomes["/proc/keys"] = "ok" if open("/proc/keys").read().splitlines() else "no keys listed"
except OSError as e:
    outcomes["/proc/keys"] = e.strerror
print(json.dumps(outcomes))
"""
ENVIRONMENT = """
import json, os
found = any(SECRET in v for v in os.environ.values())
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        found |= SECRET.encode() in open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        pass
print(json.dumps(found))
"""
# three children of 80 MiB each, all held at once: each tells the parent when its memory is touched
FORKED_MEMORY = """
import os, sys, time
read, write = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        block = b"x" * (80 * 2**20)
        os.write(write, b"1")
        time.sleep(3)
        os._exit(0)
os.close(write)
held = 0
deadline = time.time() + 3
while held < 3 and time.time() < deadline and os.read(read, 1):
    held += 1
print(held, flush=True)
"""
# four burners of 1.5 s each: under a 2 s per-process limit, 6 s together; each says how far it got
# every 0.1 s of CPU, so what they used together is known however the run ended
FORKED_CPU = """
import os, time
for _ in range(4):
    if os.fork() == 0:
        start, said = time.process_time(), 0
        while said < 15:
            if time.process_time() - start >= (said + 1) * 0.1:
                said += 1
                os.write(1, b"+")
        os._exit(0)
for _ in range(4):
    os.wait()
"""


# keeps every memfd open and its pages written: 16 MiB each (the file-size limit), up to 512 MiB
MEMFD_FLOOD = """
import os
held, fds = 0, []
try:
    while held < 512:
        fd = os.memfd_create("flood")
        fds.append(fd)
        for _ in range(16):
            os.write(fd, b"x" * 2**20)
            held += 1
except OSError as e:
    print("stopped:", e.strerror, flush=True)
print(held, flush=True)
"""
SHM_FLOOD = """
import os
held = 0
try:
    for index in range(32):
        with open(f"/dev/shm/rlsys-attack-{os.getpid()}-{index}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * 2**20)
                f.flush()
                held += 1
except OSError as e:
    print("stopped:", e.strerror, flush=True)
print(held, flush=True)
"""
# bubblewrap's own tmpfs (/ and /dev, where it makes mount points) has no size limit: only the scratch is writable
WRITE_OUTSIDE_SCRATCH = """
import json
outcomes = {}
for path in ("/escaped", "/dev/escaped", "/etc/escaped", "/usr/escaped"):
    try:
        with open(path, "wb") as f:
            f.write(b"x" * 2**20)
        outcomes[path] = "ok"
    except OSError as e:
        outcomes[path] = e.strerror
print(json.dumps(outcomes))
"""
SYSV_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0, 256 * 2**20, 0o1000 | 0o600)
if segment < 0:
    print("denied", ctypes.get_errno(), flush=True)
else:
    address = libc.shmat(segment, None, 0)
    libc.shmctl(segment, 0, None)  # IPC_RMID once detached: nothing is left behind
    ctypes.memset(address, 1, 256 * 2**20)
    print("held", flush=True)
"""
SIGINT_TO_INIT = ("import os, signal\nos.kill(os.getppid(), signal.SIGINT)\n"
                  "import time; time.sleep(0.3)\nprint('alive')\n")
SIGINT_TO_SELF = ("import os, signal\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                  "os.kill(os.getpid(), signal.SIGINT)\n")
SIGXCPU = """
import resource
resource.setrlimit(resource.RLIMIT_CPU, (1, 2))
while True:
    pass
"""
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


@dataclass
class Attack:
    name: str
    code: str
    contained: Callable[[SandboxResult], bool]
    harms_host: bool = False  # unconfined, it would change the caller's own filesystems: not run
    needs_process_limit: bool = False  # without one it would flood the machine with processes: not run
    wall_seconds: float = LIMITS.wall_seconds


def last_json(result: SandboxResult):
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def last_int(result: SandboxResult) -> int:
    lines = result.stdout.strip().splitlines()
    return int(lines[-1]) if lines and lines[-1].isdigit() else 0


def all_failed(result: SandboxResult) -> bool:
    outcomes = last_json(result)
    return bool(outcomes) and all(outcome != "ok" for outcome in outcomes.values())


def attacks(workspace: Path, port: int, secret: str) -> list[Attack]:
    """The attack list; `workspace` holds a dataset file and a directory the caller owns, outside the sandbox."""
    dataset, target = workspace / "dataset.jsonl", workspace / "owned" / "escaped.txt"
    return [
        Attack("capabilities", SYSCALLS + CAPABILITIES,
               lambda r: r.status == "ok" and int(last_json(r)["CapEff"], 16) == 0),
        Attack("unmount", SYSCALLS + UNMOUNT, all_failed, harms_host=True),
        Attack("remount-read-write", SYSCALLS + REMOUNT, all_failed, harms_host=True),
        Attack("namespaces-ptrace-keyctl", SYSCALLS + NAMESPACES, all_failed),
        Attack("write-owned-host-path", WRITE_HOST.replace("TARGET", repr(str(target))),
               lambda r: r.status == "ok" and last_json(r) != "written" and not target.exists()),
        Attack("read-dataset", READ_FILE.replace("PATH", repr(str(dataset))),
               lambda r: r.status == "ok" and secret not in r.stdout),
        Attack("network", NETWORK.replace("PORT", str(port)),
               lambda r: r.status == "ok" and "connected" not in last_json(r).values()),
        Attack("open-host-sysctls-for-writing", SYSCALLS + HOST_SYSCTLS, all_failed),
        Attack("chmod-host-device-nodes", SYSCALLS + CHMOD_DEVICE_NODES, all_failed),
        Attack("read-root-only-proc", SYSCALLS + ROOT_ONLY_PROC, all_failed),
        Attack("read-caller-environment", ENVIRONMENT.replace("SECRET", repr(secret)),
               lambda r: r.status == "ok" and last_json(r) is False),
        Attack("forked-memory-3x80MiB", FORKED_MEMORY, lambda r: last_int(r) < 3),
        Attack("forked-cpu-4x1.5s", FORKED_CPU,  # 0.1 s each may be used but not yet said
               lambda r: r.status == "cpu_limit" and r.stdout.count("+") * 0.1 <= LIMITS.cpu_seconds + 0.4,
               wall_seconds=60),  # the CPU limit, not the wall clock, must stop them, however loaded the machine
        Attack("memfd-flood", MEMFD_FLOOD, lambda r: last_int(r) <= LIMITS.memory_mb),
        Attack("dev-shm-flood", SHM_FLOOD, lambda r: last_int(r) <= LIMITS.memory_mb),
        Attack("write-outside-scratch", WRITE_OUTSIDE_SCRATCH, all_failed, harms_host=True),
        Attack("sysv-shm-256MiB", SYSV_SHM, lambda r: "held" not in r.stdout),
        Attack("fork-bomb", FORK_BOMB, lambda r: r.status in ("cpu_limit", "timeout", "memory_limit"),
               needs_process_limit=True, wall_seconds=4),
        Attack("sigint-to-init", SIGINT_TO_INIT, lambda r: r.status == "ok" and r.stdout == "alive\n"),
        Attack("sigint-to-self", SIGINT_TO_SELF, lambda r: r.status == "crashed" and r.exit_code == -2),
        Attack("sigxcpu", SIGXCPU, lambda r: r.status == "cpu_limit" and r.exit_code == -24),
    ]


def confinements() -> dict[str, Confinement]:
    """Every mode the code can choose that this machine can run: the machine's own, and the lesser ones."""
    best = machine_confinement()
    modes = {best.mode: best}
    if best.namespaces:
        modes["bwrap"] = without_cgroup("no cgroup (chosen by the caller)")
    modes["unconfined"] = unconfined("chosen by the caller")
    return modes


def prepare(workspace: Path, secret: str) -> None:
    """A dataset file anyone may read and a directory anyone may write (so the sandbox, not permissions, stops it)."""
    workspace.mkdir(parents=True, exist_ok=True)
    workspace.chmod(0o755)
    (workspace / "dataset.jsonl").write_text(json.dumps({"question": "1+1", "answer": secret}) + "\n")
    (workspace / "dataset.jsonl").chmod(0o644)
    (workspace / "owned").mkdir()
    (workspace / "owned").chmod(0o777)


async def run_attacks(confinement: Confinement, workspace: Path, secret: str) -> dict[str, dict]:
    """Runs every attack, at most four at once (the memory ones need the machine's memory); returns
    name -> {contained, status, reason, stdout}."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    os.environ["RLSYS_ATTACK_SECRET"] = secret  # the caller's environment holds it
    slots = asyncio.Semaphore(4)

    async def one(attack: Attack) -> SandboxResult:
        async with slots:
            return await run_python(attack.code, replace(LIMITS, wall_seconds=attack.wall_seconds), confinement)

    try:
        chosen = [a for a in attacks(workspace, port, secret) if not skip_reason(a, confinement)]
        results = await asyncio.gather(*(one(attack) for attack in chosen))
    finally:
        server.close()
        del os.environ["RLSYS_ATTACK_SECRET"]
        for leftover in Path("/dev/shm").glob("rlsys-attack-*"):  # unconfined floods write the host's /dev/shm
            leftover.unlink(missing_ok=True)
    skipped = {a.name: {"contained": False, "status": "not run", "reason": skip_reason(a, confinement), "stdout": "",
                        "mode": confinement.mode}
               for a in attacks(workspace, port, secret) if skip_reason(a, confinement)}
    return skipped | {attack.name: {"contained": safely(attack.contained, result), "status": result.status,
                          "reason": result.reason, "stdout": result.stdout[-300:], "mode": result.mode}
            for attack, result in zip(chosen, results)}


def skip_reason(attack: Attack, confinement: Confinement) -> str:
    if attack.harms_host and not confinement.namespaces:
        return "not run: it would change the caller's own filesystems"
    if attack.needs_process_limit and "process-limit" not in confinement.isolation:
        return "not run: no process limit in this mode, it would flood the machine"
    return ""


def safely(check: Callable[[SandboxResult], bool], result: SandboxResult) -> bool:
    try:
        return bool(check(result))
    except (ValueError, TypeError, KeyError, AttributeError):  # output not what the attack prints: not contained
        return False


def copy_sandbox(directory: Path) -> None:
    """The sandbox's modules and this file under `directory`, readable by anyone (import them with FROM_COPY)."""
    (directory / "rlsys" / "tools").mkdir(parents=True)
    for name in SANDBOX_MODULES:
        shutil.copy(PACKAGE_ROOT / "rlsys" / f"{name}.py", directory / "rlsys" / f"{name}.py")
    shutil.copy(__file__, directory / "sandbox_attacks.py")
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def run_as(prefix: list[str], python: str, directory: Path, user: str = "root") -> dict:
    """Runs the attack suite under `prefix` (setpriv ...) with `python`, from a copy of the sandbox modules;
    its workspace belongs to `user`."""
    copy_sandbox(directory)
    (directory / "attack").mkdir()
    os.chown(directory / "attack", pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
    script = AS_USER.format(directory=str(directory), workspace=str(directory / "attack"))
    done = subprocess.run([*prefix, python, "-I", "-c", script], capture_output=True, text=True, timeout=150,
                          cwd=directory, env={"PATH": os.environ["PATH"]})
    if done.returncode != 0:
        raise RuntimeError(f"the attack suite failed under {prefix}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main() -> None:
    """`python tests/sandbox_attacks.py [MODE] WORKSPACE`: one mode's results as JSON (default: the machine's)."""
    import secrets
    mode, workspace = (sys.argv[1], Path(sys.argv[2])) if len(sys.argv) > 2 else (None, Path(sys.argv[1]))
    confinement = confinements()[mode] if mode else machine_confinement()
    secret = secrets.token_hex(16)
    prepare(workspace, secret)
    print(json.dumps({"mode": confinement.mode, "notes": list(confinement.notes), "uid": os.getuid(),
                      "results": asyncio.run(run_attacks(confinement, workspace, secret))}))


if __name__ == "__main__":
    main()
