"""The sandbox's init: sets the per-process limits, starts the program, reaps orphans and reports how
the program ended.

Run with the standard library only, as `python -I -S -c SOURCE STATUS_FD CONFIG_JSON` (the parent side
is `rlsys.tools.sandbox`). Under bubblewrap it is PID 1 of the sandbox's PID namespace (`--as-pid-1`),
already inside every confinement (namespaces, no capabilities, seccomp); unconfined it is a plain
child of the trainer. It is a separate program rather than a `preexec_fn` because the parent is a
threaded asyncio process, where running Python between fork and exec can deadlock.

Why the program cannot forge the report: the report pipe is close-on-exec, and the init is not
dumpable, so neither /proc/1/fd nor ptrace (also denied by seccomp) reaches it. As a PID-namespace
init the kernel drops SIGKILL and SIGSTOP sent from inside the namespace; the other signals that would end
it (SIGINT, SIGTERM, ...) get a no-op handler, since unconfined it is no namespace init, and Python's
own SIGINT handler would turn a SIGINT from the program into a KeyboardInterrupt here (a forged
sandbox_error). When it exits, the kernel kills everything left in the namespace.
The program must not be PID 1 itself, or it would ignore SIGXCPU and the CPU limit's SIGKILL too.
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGALRM)


def set_limits(limits: dict, count_others: bool) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU first, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    # counted per uid in the innermost user namespace: only the sandbox's own processes under bubblewrap,
    # all of the caller's otherwise; root's uid is exempt, where the pids cgroup counts instead
    others = processes_of(os.getuid()) if count_others else 0
    resource.setrlimit(resource.RLIMIT_NPROC, (others + 1 + limits["max_processes"],) * 2)  # +1: this init
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(limits["nice"])


def processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:  # exited meanwhile
            pass
    return count


def wait_for(program: int) -> dict:
    """Reaps orphans (we are their init) until the program itself ends; returns its exit code or signal."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            return {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}


def main() -> None:
    for number in IGNORED_SIGNALS:  # a no-op handler: the init lives on, and exec gives the program the defaults back
        signal.signal(number, lambda *_: None)
    status_fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not be able to write the report
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for option, value in ((PR_SET_NO_NEW_PRIVS, 1), (PR_SET_DUMPABLE, 0), (PR_SET_PDEATHSIG, signal.SIGKILL)):
            if libc.prctl(option, value, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"prctl({option}): {os.strerror(ctypes.get_errno())}")
        set_limits(config["limits"], count_others=not config["namespaces"])
        os.chdir(config["workdir"])
        env = dict(config["env"], HOME=config["workdir"], TMPDIR=config["workdir"])
        program = os.fork()
        if program == 0:
            python = config["python"]
            os.execve(python, [python, "-E", "-s", "-B", "-u", "main.py"], env)
    except BaseException as e:  # noqa: BLE001 (anything that stops the program from starting is reported)
        os.write(status_fd, (json.dumps({"error": f"sandbox setup failed: {type(e).__name__}: {e}"}) + "\n").encode())
        os._exit(127)
    os.write(status_fd, (json.dumps(wait_for(program)) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
