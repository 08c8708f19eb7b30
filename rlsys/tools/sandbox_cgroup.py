"""A cgroup per sandbox run, so memory, process and CPU limits hold for the sandbox as a whole rather
than for each of its processes (three forked children of 80 MiB each would pass a per-process 128 MiB
limit together).

Both layouts are handled: cgroup v2 (one unified tree) and v1 (a tree per controller, as on hybrid
machines that mount v2 at /sys/fs/cgroup/unified without controllers). The run's cgroup is made
inside the caller's own, so any limit the caller is under still applies (v2: in the root cgroup where
the caller's own cannot have children with controllers; not tested here, our machines are v1). Memory counts swap
where the kernel allows (memsw / swap.max) and shmem: tmpfs, /dev/shm and memfd pages are charged to it. Socket
buffers count too (v1: apart, under a limit of the same size).
CPU is not throttled but counted; the parent reads `cpu_seconds()` and ends the run past its limit.
Where no cgroup can be made (a non-root user without delegation), `SandboxCgroup.create` raises
OSError and the sandbox says so and keeps per-process limits.
"""

import itertools
import os
import signal
import time

ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("memory", "pids", "cpuacct")
_names = itertools.count()


class SandboxCgroup:
    def __init__(self, dirs: dict[str, str], version: int):
        self.dirs, self.version = dirs, version  # controller -> directory (v2: one directory for all)

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> "SandboxCgroup":
        """Makes and limits a fresh cgroup; OSError says why it could not."""
        name = f"rlsys-sandbox-{os.getpid()}-{next(_names)}"
        own = own_cgroups()
        if os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
            cgroup = cls({"": make_dir(os.path.join(v2_parent(own[""]), name))}, 2)
        else:
            missing = [c for c in V1_CONTROLLERS if c not in own or not os.path.isdir(os.path.join(ROOT, c))]
            if missing:
                raise OSError(f"no cgroup v1 hierarchy for {', '.join(missing)} under {ROOT}")
            cgroup = cls({}, 1)
            for controller in V1_CONTROLLERS:
                try:
                    own_dir = own[controller].lstrip("/")
                    cgroup.dirs[controller] = make_dir(os.path.join(ROOT, controller, own_dir, name))
                except OSError:
                    cgroup.remove()
                    raise
        try:
            cgroup.limit(memory_bytes, max_pids)
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def file(self, controller: str, name: str) -> str:
        return os.path.join(self.dirs["" if self.version == 2 else controller], name)

    def limit(self, memory_bytes: int, max_pids: int) -> None:
        if self.version == 2:
            write(self.file("memory", "memory.max"), memory_bytes)
            if os.path.exists(self.file("memory", "memory.swap.max")):
                write(self.file("memory", "memory.swap.max"), 0)
        else:
            write(self.file("memory", "memory.limit_in_bytes"), memory_bytes)
            if os.path.exists(self.file("memory", "memory.memsw.limit_in_bytes")):  # memory + swap
                write(self.file("memory", "memory.memsw.limit_in_bytes"), memory_bytes)
            # v1 counts socket buffers apart, and only under a limit of their own: without one, a few loopback
            # connections held hundreds of MiB of kernel memory past memory_bytes (v2 counts them in memory.max)
            if os.path.exists(self.file("memory", "memory.kmem.tcp.limit_in_bytes")):
                write(self.file("memory", "memory.kmem.tcp.limit_in_bytes"), memory_bytes)
        write(self.file("pids", "pids.max"), max_pids)

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (every controller's tree in v1)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def cpu_seconds(self) -> float:
        """CPU time used by every process the run has had, ended ones included."""
        if self.version == 2:
            return keyed(self.file("cpu", "cpu.stat"))["usage_usec"] / 1e6
        return int(read(self.file("cpuacct", "cpuacct.usage"))) / 1e9

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return keyed(self.file("memory", name)).get("oom_kill", 0)

    def pids(self) -> set[int]:
        found = set()
        for path in self.procs_files:
            try:
                found |= {int(line) for line in read(path).split()}
            except OSError:
                pass
        return found

    def signal_all(self) -> bool:
        """SIGKILLs every process in the cgroup once, without waiting; False if there was none."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return bool(pids)

    def kill(self) -> None:
        """SIGKILLs every process in the cgroup until none is left (a fork may race one round); blocks."""
        for _ in range(100):
            if not self.signal_all():
                return
            time.sleep(0.01)

    def remove(self) -> None:
        """Kills what is left and removes the directories (a cgroup with processes cannot be removed)."""
        self.kill()
        for path in self.dirs.values():
            for _ in range(100):  # a killed process leaves the cgroup a moment after it dies
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and its v2 cgroup under the key ''."""
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                found[controller] = path
    return found


def v2_parent(own: str) -> str:
    """Our own cgroup if it can hand controllers to children; else the root (a v2 cgroup that holds
    processes cannot, and ours holds at least this one), where only root may create one."""
    own_dir = os.path.join(ROOT, own.lstrip("/"))
    try:
        enable_controllers(own_dir)
        return own_dir
    except OSError as e:
        if own_dir == ROOT:
            raise
        try:
            enable_controllers(ROOT)
        except OSError:
            raise e from None
        return ROOT


def enable_controllers(parent: str) -> None:
    """v2: the memory, pids and cpu controllers must be enabled in the parent for its children."""
    enabled = read(os.path.join(parent, "cgroup.subtree_control")).split()
    wanted = [c for c in ("memory", "pids", "cpu") if c not in enabled]
    if wanted:
        write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))


def make_dir(path: str) -> str:
    os.mkdir(path, 0o755)
    return path


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def keyed(path: str) -> dict[str, int]:
    """A cgroup file of `key value` lines."""
    pairs = (line.split() for line in read(path).splitlines())
    return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}
