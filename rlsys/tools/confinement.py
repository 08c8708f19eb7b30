"""Which confinement this machine gives the code sandbox, checked once per process, and the command
that applies it.

Modes, best first:
- `bwrap+cgroup`: bubblewrap (Debian's `bubblewrap`) in a new user namespace with every other namespace
  new too (mount, PID, network without interfaces, IPC, UTS, cgroup), all capabilities dropped, further
  user namespaces disabled, a new session (no TIOCSTI into the caller's terminal), killed with its
  parent, and the seccomp filter of `seccomp_filter.py`. Mounts made in the parent namespace are
  locked (a nested user namespace cannot unmount or remount them), and the filesystem is an
  allow-list: read-only /usr and the interpreter's prefix, a fresh read-only /proc, a fresh /dev, a private
  size-limited /tmp (the only writable place) and /dev/shm; nothing else of the host (no home, no
  dataset, no run directory). A cgroup bounds memory (shmem and memfd included) and processes for
  the run as a whole, and counts its CPU time. Needs a cgroup we may create: root, or delegation.
- `bwrap`: the same without the cgroup (a non-root user on a machine that delegates none): memory and
  CPU limits hold per process only, and memfd_create is denied, since nothing would bound its pages.
- `unconfined`: the per-process limits only. Never chosen unless the caller allows it
  (`allow_unconfined`); without that, `preflight` raises and `run_python` refuses.

Why bubblewrap rather than our own namespace code: it is small, setuid-free, audited and used by
Flatpak for exactly this; it creates the user namespace first and does every mount inside it, so the
mounts come out locked and the capabilities it held die with the setup, which is the part our own
launcher got wrong (model code kept CapEff 1ff... and could unmount /tmp).
"""

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from rlsys.tools.sandbox_cgroup import SandboxCgroup

WORKDIR = "/tmp"  # inside the sandbox: the private tmpfs
SANDBOX_UID = 1000  # the program's uid and gid inside its user namespace
PROBE_TIMEOUT = 30.0


class SandboxUnavailable(RuntimeError):
    """The confinement the config asks for cannot be had on this machine."""


@dataclass(frozen=True)
class Confinement:
    """What a run gets: `mode` (see the module doc), what is in force and why anything is missing."""

    mode: str  # "bwrap+cgroup", "bwrap" or "unconfined"
    isolation: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

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
    """Probes once: does bubblewrap run a program here, and can we make a cgroup?"""
    try:
        probe_bwrap()
    except (OSError, subprocess.SubprocessError) as e:
        return unconfined(str(e))
    try:
        SandboxCgroup.create(64 << 20, 8).remove()
    except OSError as e:
        return without_cgroup(f"no cgroup ({e})")
    return Confinement("bwrap+cgroup", NAMESPACE_ISOLATION + ("cgroup-memory", "cgroup-pids", "cgroup-cpu", "rlimits",
                                                              "process-limit"))


def without_cgroup(why: str) -> Confinement:
    """Mode `bwrap`. Root's own uid is exempt from RLIMIT_NPROC, so as root it has no process limit at all."""
    notes = [f"{why}: memory and CPU limits hold per process, not for the sandbox as a whole; memfd_create denied"]
    if os.geteuid() == 0:
        notes.append("no process limit: root's processes are exempt from RLIMIT_NPROC and no pids cgroup was made")
        return Confinement("bwrap", NAMESPACE_ISOLATION + ("rlimits",), tuple(notes))
    return Confinement("bwrap", NAMESPACE_ISOLATION + ("rlimits", "process-limit"), tuple(notes))


def unconfined(why: str) -> Confinement:
    """Mode `unconfined`: per-process limits; as root not even a process limit."""
    return Confinement("unconfined", ("rlimits",) + ("process-limit",) * (os.geteuid() != 0), (why,))


def probe_bwrap() -> None:
    """Runs `true` under the same bubblewrap options as a real run; raises with bubblewrap's own words."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise OSError("bubblewrap is not installed (Debian package `bubblewrap`; `bash scripts/install.sh --tests` "
                      "installs it)")
    from rlsys.tools.seccomp_filter import deny_filter
    deny_filter(True)  # no table for this architecture: raises
    done = subprocess.run([bwrap, *namespace_options(), *system_binds(), *PROC_AND_DEV, *READ_ONLY_ROOT, "--",
                           "/usr/bin/true"],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise OSError(f"bubblewrap failed: {done.stderr.strip() or f'exit code {done.returncode}'}")


def namespace_options() -> list[str]:
    return ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]


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


# /proc read-only: run by root, bubblewrap maps the sandbox's uid to root outside, and sysctls check only that uid,
# so a writable /proc/sys would let the program set host-wide ones (kernel.core_pattern runs a program of its
# choosing as the host's root).
PROC_AND_DEV = ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
# Last, once every mount point is made: bubblewrap's own tmpfs at / and /dev have no size limit.
READ_ONLY_ROOT = ["--remount-ro", "/dev", "--remount-ro", "/"]


def bwrap_command(limits: dict, seccomp_fd: int, code_fd: int) -> list[str]:
    """The bubblewrap part of a run's command line; the init's own command follows it."""
    args = [shutil.which("bwrap") or "bwrap", *namespace_options(), "--as-pid-1", *system_binds(), *PROC_AND_DEV,
            "--size", str(limits["workdir_bytes"]), "--tmpfs", WORKDIR,
            "--size", str(limits["shm_bytes"]), "--tmpfs", "/dev/shm"]
    # After the tmpfs mounts, which would hide an interpreter that lives under them (a venv in /tmp)
    for path in interpreter_dirs():
        args += ["--ro-bind", path, path]
    args += ["--perms", "0644", "--file", str(code_fd), f"{WORKDIR}/main.py", *READ_ONLY_ROOT,
             "--chdir", WORKDIR, "--clearenv", "--seccomp", str(seccomp_fd), "--"]
    return args
