"""Which confinement this machine gives the code sandbox, checked once per process, and the command
that applies it.

Modes, best first:
- `bwrap+cgroup`: bubblewrap (Debian's `bubblewrap`) in a new user namespace with every other namespace
  new too (mount, PID, network without interfaces, IPC, UTS, cgroup), all capabilities dropped, further
  user namespaces disabled (run by root: by the seccomp filter alone, see below), a new session (no TIOCSTI
  into the caller's terminal), killed with its parent, and the seccomp filter of `seccomp_filter.py`.
  Mounts made in the parent namespace are locked (a nested user namespace cannot unmount or remount
  them), and the filesystem is an allow-list: read-only /usr and the interpreter's prefix, a fresh
  read-only /proc, a fresh /dev, a private size-limited /tmp (the only writable place) and /dev/shm;
  nothing else of the host (no home, no dataset, no run directory). A cgroup bounds memory (shmem and
  memfd included) and processes for the run as a whole, and counts its CPU time. Needs a cgroup we may
  create: root, or delegation.
- `bwrap`: the same without the cgroup (a non-root user on a machine that delegates none): memory and
  CPU limits hold per process only, and memfd_create is denied, since nothing would bound its pages.
- `unconfined`: the per-process limits only. Never chosen unless the caller allows it
  (`allow_unconfined`); without that, `preflight` raises and `run_python` refuses.

Run by root, bubblewrap's own user namespace would map the sandbox's uid to the host's root, and root's uid
owns what the sandbox can reach: the host's device nodes bound into its /dev (a chmod of /dev/null to 000
breaks every other user's processes) and what /proc shows root only (/proc/keys, /proc/timer_list). So a
root caller writes the namespace's uid and gid maps itself (bubblewrap's `--userns-block-fd`): the sandbox's
uid maps to an unprivileged one outside (`UNPRIVILEGED_UID`, nobody, which owns no files; the environment
variable RLSYS_SANDBOX_UID chooses another), and 0 to 0 for bubblewrap's setup alone, which runs as root so
that it can bind an interpreter root's own directories hold (/root/.pyenv). The init then drops to the
sandbox's uid with an empty capability bounding set, before it starts the program (`confine.py`), and the
launch clears the supplementary groups. Such a user namespace cannot be combined with bubblewrap's
`--disable-userns`: the seccomp filter alone denies further user namespaces there.

Why bubblewrap rather than our own namespace code: it is small, setuid-free, audited and used by
Flatpak for exactly this; it creates the user namespace first and does every mount inside it, so the
mounts come out locked and the capabilities it held die with the setup, which is the part our own
launcher got wrong (model code kept CapEff 1ff... and could unmount /tmp).
"""

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.tools.sandbox_cgroup import SandboxCgroup

WORKDIR = "/tmp"  # inside the sandbox: the private tmpfs
SANDBOX_UID = 1000  # the program's uid and gid inside its user namespace
UNPRIVILEGED_UID = 65534  # run by root: the program's uid and gid outside it (nobody; RLSYS_SANDBOX_UID overrides)
SETUP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")  # what the init needs to drop to SANDBOX_UID, then drops
PROBE_TIMEOUT = 30.0


class SandboxUnavailable(RuntimeError):
    """The confinement the config asks for cannot be had on this machine."""


@dataclass(frozen=True)
class Confinement:
    """What a run gets: `mode` (see the module doc), what is in force and why anything is missing."""

    mode: str  # "bwrap+cgroup", "bwrap" or "unconfined"
    isolation: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    outside_uid: int | None = None  # run by root: the uid (and gid) the sandbox runs as outside its user namespace

    @property
    def namespaces(self) -> bool:
        return self.mode.startswith("bwrap")

    @property
    def cgroup(self) -> bool:
        return self.mode.endswith("cgroup")


NAMESPACE_ISOLATION = ("user-namespace", "mount-namespace", "pid-namespace", "network-namespace", "ipc-namespace",
                       "uts-namespace", "no-capabilities", "locked-mounts", "seccomp", "no-new-privs",
                       "allow-list-filesystem", "private-tmp", "private-proc")


def preflight(allow_unconfined: bool) -> Confinement:
    """The confinement runs will get; raises SandboxUnavailable, saying why, where it is none and the
    caller did not allow that. Call it when an experiment that uses the python tool starts."""
    confinement = machine_confinement()
    if confinement.mode == "unconfined" and not allow_unconfined:
        raise SandboxUnavailable(refusal(confinement))
    return confinement


def refusal(confinement: Confinement) -> str:
    return ("the code sandbox cannot confine model code here (" + "; ".join(confinement.notes) + "); refusing to "
            "run it. Install bubblewrap and allow user namespaces, or set sandbox.allow_unconfined=true to run "
            "it with per-process limits only")


@functools.cache
def machine_confinement() -> Confinement:
    """Probes once: does bubblewrap run a program here (run by root: as an unprivileged uid), and can we make
    a cgroup?"""
    try:
        probe_bwrap(outside_uid())
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return unconfined(str(e))
    try:
        SandboxCgroup.create(64 << 20, 8).remove()
    except OSError as e:
        return without_cgroup(f"no cgroup ({e})")
    return Confinement("bwrap+cgroup", NAMESPACE_ISOLATION + ("cgroup-memory", "cgroup-pids", "cgroup-cpu", "rlimits",
                                                              "process-limit") + uid_isolation(outside_uid()),
                       outside_uid=outside_uid())


def outside_uid() -> int | None:
    """Run by root: the unprivileged uid the sandbox runs as outside its user namespace; None for anyone else (the
    sandbox runs as the caller's own uid)."""
    if os.geteuid() != 0:
        return None
    given = os.environ.get("RLSYS_SANDBOX_UID", str(UNPRIVILEGED_UID))
    try:
        uid = int(given)
    except ValueError:
        raise ValueError(f"RLSYS_SANDBOX_UID={given!r} is not a uid: give a number, an unprivileged uid that owns no "
                         f"files, or unset it ({UNPRIVILEGED_UID}, nobody)") from None
    if not 0 < uid < 2**32 - 1:
        raise ValueError(f"RLSYS_SANDBOX_UID={uid}: the sandbox's uid outside must not be root's (0) nor -1")
    return uid


def uid_isolation(uid: int | None) -> tuple[str, ...]:
    """The isolation entry that says which uid the sandbox runs as outside its user namespace."""
    return (f"outside-uid-{os.geteuid() if uid is None else uid}",)


def without_cgroup(why: str) -> Confinement:
    """Mode `bwrap`. RLIMIT_NPROC counts the sandbox's uid: run by root that is the unprivileged one, which the
    limit binds (root's own uid is exempt)."""
    notes = [f"{why}: memory and CPU limits hold per process, not for the sandbox as a whole; memfd_create denied"]
    uid = outside_uid()
    return Confinement("bwrap", NAMESPACE_ISOLATION + ("rlimits", "process-limit") + uid_isolation(uid), tuple(notes),
                       uid)


def unconfined(why: str) -> Confinement:
    """Mode `unconfined`: per-process limits; as root not even a process limit."""
    return Confinement("unconfined", ("rlimits",) + ("process-limit",) * (os.geteuid() != 0), (why,))


def probe_bwrap(uid: int | None) -> None:
    """Runs `true` under the same bubblewrap options as a real run, its user namespace mapped as a real run's
    (to `uid` outside, where not None); raises with bubblewrap's own words."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise OSError("bubblewrap is not installed (Debian package `bubblewrap`; `bash scripts/install.sh --tests` "
                      "installs it)")
    from rlsys.tools.seccomp_filter import deny_filter
    deny_filter(True)  # no table for this architecture: raises
    with UsernsPipes(uid is not None) as pipes:
        process = subprocess.Popen([bwrap, *namespace_options(pipes), *system_binds(), *PROC_AND_DEV, *READ_ONLY_ROOT,
                                    "--", "/usr/bin/true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL, pass_fds=pipes.passed, **launch_options(uid))
        try:
            pipes.launched()
            if uid is not None:
                pipes.map_ids(read_all(pipes.info), uid)
            _, stderr = process.communicate(timeout=PROBE_TIMEOUT)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if process.returncode != 0:
        raise OSError(f"bubblewrap failed: {stderr.strip() or f'exit code {process.returncode}'}")


def launch_options(uid: int | None) -> dict:
    """Popen options of the launch: run by root, no supplementary groups (the init cannot clear them: the user
    namespace denies setgroups)."""
    return {} if uid is None else {"extra_groups": []}


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


class UsernsPipes:
    """Run by root: the pipes through which bubblewrap says its child's pid (`--info-fd`) and waits until we have
    written that child's uid and gid maps (`--userns-block-fd`). Unused (no fds) for anyone else."""

    def __init__(self, used: bool):
        self.used = used
        self.info, info_write = os.pipe() if used else (None, None)
        block_read, self.block = os.pipe() if used else (None, None)
        self.passed = (info_write, block_read) if used else ()  # bubblewrap's ends, closed here once it runs

    def __enter__(self) -> "UsernsPipes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def launched(self) -> None:
        """Closes bubblewrap's ends here, so that a bubblewrap that dies leaves us at end of file, not waiting."""
        for fd in self.passed:
            os.close(fd)
        self.passed = ()

    def map_ids(self, info: bytes, uid: int) -> None:
        """Maps the namespace of bubblewrap's child: SANDBOX_UID to `uid` outside, 0 to 0 (bubblewrap's setup runs as
        root, and files it makes must belong to a mapped uid); then lets it go on. No pid (bubblewrap failed
        before its clone): nothing to map, and its error comes out as its exit."""
        try:
            pid = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError, TypeError):
            return
        ids = f"0 0 1\n{SANDBOX_UID} {uid} 1\n"
        try:
            for name, text in (("uid_map", ids), ("setgroups", "deny"), ("gid_map", ids)):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            raise OSError(f"could not map the sandbox's user namespace to uid {uid} outside: {e}") from None
        os.write(self.block, b"1")

    def close(self) -> None:
        self.launched()
        for fd in (self.info, self.block):
            if fd is not None:
                os.close(fd)
        self.info = self.block = None


def namespace_options(pipes: UsernsPipes) -> list[str]:
    """Run by root (`pipes.used`), the user namespace is mapped by us and the init drops to SANDBOX_UID; else
    bubblewrap maps SANDBOX_UID to the caller's uid and disables further user namespaces itself."""
    common = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
              "--hostname", "sandbox"]
    if pipes.used:
        info_write, block_read = pipes.passed
        return common + ["--info-fd", str(info_write), "--userns-block-fd", str(block_read)] + [
            arg for cap in SETUP_CAPS for arg in ("--cap-add", cap)]
    return common + ["--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]


def system_binds() -> list[str]:
    """/usr read-only and the top-level links into it (merged /usr); /lib* and /bin bound where they are dirs."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def interpreter_dirs() -> list[str]:
    """Where this interpreter and its packages live (a venv's and its base's), outside /usr."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    real = sorted({os.path.realpath(d) for d in dirs})
    return [d for d in real if not (d == "/usr" or d.startswith("/usr/"))]


# /proc read-only: sysctls check only the writer's uid outside, so a writable /proc/sys would let a sandbox whose uid
# maps to root set host-wide ones (kernel.core_pattern runs a program of its choosing as the host's root). Run by
# root the program's uid maps to an unprivileged one now, but bubblewrap's setup and the init's first moments are
# root's: read-only all the same.
PROC_AND_DEV = ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
# Last, once every mount point is made: bubblewrap's own tmpfs at / and /dev have no size limit.
READ_ONLY_ROOT = ["--remount-ro", "/dev", "--remount-ro", "/"]


def bwrap_command(limits: dict, seccomp_fd: int, code_fd: int, pipes: UsernsPipes) -> list[str]:
    """The bubblewrap part of a run's command line; the init's own command follows it. The tmpfs mounts are
    world-writable (sticky): run by root, bubblewrap makes them as root, and the program runs as SANDBOX_UID."""
    args = [shutil.which("bwrap") or "bwrap", *namespace_options(pipes), "--as-pid-1", *system_binds(), *PROC_AND_DEV,
            "--perms", "1777", "--size", str(limits["workdir_bytes"]), "--tmpfs", WORKDIR,
            "--perms", "1777", "--size", str(limits["shm_bytes"]), "--tmpfs", "/dev/shm"]
    # After the tmpfs mounts, which would hide an interpreter that lives under them (a venv in /tmp). The directories
    # above it are made searchable: bubblewrap would make them 0700, its setup's own (root's, run by root).
    for path in interpreter_dirs():
        for parent in reversed(Path(path).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    args += ["--perms", "0644", "--file", str(code_fd), f"{WORKDIR}/main.py", *READ_ONLY_ROOT,
             "--chdir", WORKDIR, "--clearenv", "--seccomp", str(seccomp_fd), "--"]
    return args
