"""The sandbox's launcher: confines itself, then runs one Python program and reports how it ended.

Run by path with the standard library only (`python -I -S confine.py STATUS_FD CONFIG_JSON`); the
parent side is `rlsys.tools.sandbox`. It is a separate program rather than a `preexec_fn` because the
parent is a threaded asyncio process, where running Python between fork and exec can deadlock.

Steps, each recorded in the report so the parent can say which isolation was in force:
1. New namespaces for mounts, network (no interfaces up: no network at all), PIDs, IPC and hostname.
   As root that is enough; otherwise a user namespace is tried first (we then map ourselves to root
   inside it); if neither works the program runs with resource limits only.
2. Fork: the child is PID 1 (init) of the new PID namespace. When it exits the kernel kills every
   process left in the namespace, so nothing the program starts outlives it, and a fresh /proc
   shows nothing of the parent (no /proc/<pid>/environ to read).
3. The filesystem becomes a read-only view of the host (every mount remounted read-only and nosuid);
   home and temporary directories are covered by empty tmpfs (the interpreter's own prefix is bound
   back in so Python still runs); the only writable place is a fresh size-limited tmpfs that
   vanishes with the namespace (mounted at /tmp/work, inside the hidden /tmp, so an interpreter
   that lives under /tmp stays visible).
4. Resource limits, then (as real root) a uid/gid of its own with no supplementary groups, so the
   per-user process limit counts only this sandbox and nothing else of the host is writable by it;
   no-new-privileges so setuid binaries cannot regain root; lower CPU priority.
5. The init forks the program (PID 2) with a scrubbed environment, reaps orphans, and reports the
   program's exit code or signal. The report pipe is close-on-exec and the init is not dumpable, so
   the program can neither write to the pipe nor ptrace the init to forge the report.
"""

import ctypes
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    0x1, 0x2, 0x4, 0x8, 0x20, 0x1000, 0x4000, 0x40000)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x400, 0x800, 0x200000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
WORKDIR = "/tmp/work"  # inside the namespace: the sandbox's own tmpfs, in the (hidden) /tmp

# statvfs flags of a mount that a read-only bind remount must keep (dropping a locked one is EPERM)
KEPT_MOUNT_FLAGS = {os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME,
                    os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def enter_namespaces(report: dict) -> str:
    """Unshares what this machine allows; returns the mode: "root", "userns" or "none"."""
    if os.geteuid() == 0:
        if libc.unshare(NAMESPACES) == 0:
            return "root"
        report["notes"].append(f"namespaces as root: {os.strerror(ctypes.get_errno())}")
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | NAMESPACES) == 0:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
        return "userns"
    report["notes"].append(f"user namespace: {os.strerror(ctypes.get_errno())}; "
                           "no network, PID or filesystem isolation, resource limits only")
    return "none"


def write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def build_filesystem(config: dict, code: str, report: dict) -> None:
    """Read-only host view, hidden home/temp dirs, private writable /tmp, fresh /proc."""
    hidden = [path for path in config["hide"] if os.path.isdir(path) and not os.path.islink(path)]
    if os.path.dirname(WORKDIR) not in hidden:  # the work dir is made inside a hidden tmpfs, never on the host
        raise RuntimeError(f"{os.path.dirname(WORKDIR)} must be among the hidden directories")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    exposed = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in config["expose"]
               if os.path.isdir(path) and any(path == h or path.startswith(h + "/") for h in hidden)}
    for path in hidden:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    for path, fd in exposed.items():  # the interpreter, if it lives under a hidden directory
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.makedirs(WORKDIR)
    report["isolation"].append("hidden-home-and-tmp")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    report["isolation"].append("private-proc")
    remount_read_only(report)
    sandbox_id = config["uid"] if config["mode"] == "root" else 0
    limits = config["limits"]
    mount("tmpfs", WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={limits['workdir_bytes']},nr_inodes=1024,mode=700,uid={sandbox_id},gid={sandbox_id}")
    report["isolation"].append("private-workdir")
    write_file(os.path.join(WORKDIR, "main.py"), code)
    os.chown(os.path.join(WORKDIR, "main.py"), sandbox_id, sandbox_id)


def remount_read_only(report: dict) -> None:
    failed = []
    for target in mount_points():
        if target == "/proc" or target.startswith("/proc/"):
            continue
        if not os.path.exists(target):  # under a directory we covered: out of the program's reach anyway
            continue
        try:
            flags = os.statvfs(target).f_flag
            kept = sum(ms for st, ms in KEPT_MOUNT_FLAGS.items() if flags & st)
            mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)
        except OSError as e:
            failed.append(f"{target} ({e.strerror})")
    if failed:
        report["notes"].append(f"could not remount read-only: {', '.join(failed)}")
    else:
        report["isolation"].append("read-only-filesystem")


def mount_points() -> list[str]:
    """Mount points of this namespace, outermost first (mountinfo escapes spaces etc. as octal)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]))
    return sorted(set(points), key=len)


def set_limits(limits: dict, mode: str, report: dict) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU first, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    if mode == "none" and os.geteuid() == 0:
        report["notes"].append("process limit not enforced: root ignores RLIMIT_NPROC")
    else:  # counted per uid; with no namespace of its own the caller's other processes count too
        others = processes_of(os.getuid()) if mode == "none" else 0
        resource.setrlimit(resource.RLIMIT_NPROC, (others + 1 + limits["max_processes"],) * 2)  # +1: our init
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(limits["nice"])
    report["isolation"].append("rlimits")


def processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:  # exited meanwhile
            pass
    return count


def become_sandbox_user(uid: int, report: dict) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    report["isolation"].append(f"uid={uid}")


def child(config: dict, mode: str, report: dict, status_fd: int) -> None:
    """PID 1 of the sandbox (in namespace modes): confine, start the program, report how it ended. Never returns.

    The program must not be PID 1 itself: the kernel does not deliver signals a PID-namespace init has
    no handler for, and that includes SIGXCPU and the SIGKILL of the CPU limit.
    """
    try:
        code = open(config["code_path"], encoding="utf-8").read()
        if mode == "none":
            workdir = os.path.dirname(config["code_path"])
        else:
            build_filesystem(config, code, report)
            workdir = WORKDIR
        set_limits(config["limits"], mode, report)
        if mode == "root":
            become_sandbox_user(config["uid"], report)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        report["isolation"].append("no-new-privs")
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # after setuid, which clears it
        check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")  # the program may not ptrace us to forge the report
        os.chdir(workdir)
        env = dict(config["env"], HOME=workdir, TMPDIR=workdir)
        program = os.fork()
        if program == 0:
            python = config["python"]
            os.execve(python, [python, "-E", "-s", "-B", "-u", "main.py"], env)
        os.write(status_fd, (json.dumps(report) + "\n").encode())
        os.write(status_fd, (json.dumps(wait_for(program)) + "\n").encode())
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 (anything that stops the program from starting is reported)
        os.write(status_fd, (json.dumps({"error": f"sandbox setup failed: {type(e).__name__}: {e}"}) + "\n").encode())
    os._exit(127)


def wait_for(program: int) -> dict:
    """Reaps orphans (we are their init) until the program itself ends; returns its exit code or signal."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            return {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}


def main() -> None:
    status_fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not be able to write the report
    report = {"isolation": [], "notes": []}
    mode = enter_namespaces(report) if config["isolate"] else "none"
    if not config["isolate"]:
        report["notes"].append("isolation disabled by the caller")
    if mode != "none":
        report["isolation"] += ["user-namespace"] * (mode == "userns") + [
            "network-namespace", "pid-namespace", "mount-namespace", "ipc-namespace"]
    config["mode"] = mode
    if os.fork() == 0:
        child(config, mode, report, status_fd)
    os.wait()


if __name__ == "__main__":
    main()
