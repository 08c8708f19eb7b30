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

Run by root (config `drop_to`), bubblewrap starts the init as the user namespace's root, which maps to the host's
root, with CAP_SETUID, CAP_SETGID and CAP_SETPCAP in the namespace: the init empties the capability bounding set
and drops to `drop_to` (which maps to an unprivileged uid outside) before anything else, and checks that no
capability and no supplementary group is left; it fails closed (a report error, no program) otherwise.
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL, CAPABILITY_VERSION_3 = 4, 0x20080522
IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGALRM)


def set_limits(limits: dict, count_others: bool) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU first, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    # counted per uid in the innermost user namespace: only the sandbox's own processes under bubblewrap,
    # all of the caller's otherwise (threads included); root's uid is exempt, where the pids cgroup counts instead
    others = processes_of(os.getuid()) if count_others else 0
    resource.setrlimit(resource.RLIMIT_NPROC, (others + 1 + limits["max_processes"],) * 2)  # +1: this init
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # a trainer's real-time policy is inherited, and would put the program above every ordinary process, its nice
    # value ignored: the program gets the ordinary policy (lowering it needs no privilege)
    if os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.nice(limits["nice"])


def processes_of(uid: int) -> int:
    """Tasks of `uid`, each thread one, as RLIMIT_NPROC counts them (a trainer's threads would leave the limit below
    what the user already runs, and the program could not even be started)."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:  # exited meanwhile
            pass
    return count


def drop_to(uid: int, libc) -> None:
    """Empties the bounding set, becomes `uid` (its gid alike), clears every capability set; raises unless the
    result is that uid with no capability and no supplementary group (the launch cleared those)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from the namespace's root to another uid: the kernel clears the permitted set
    header, data = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    with open("/proc/self/status") as f:
        caps = {line.split(":")[0]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}
    if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups() or any(caps.values()):
        raise OSError(f"could not drop to uid {uid}: uids {os.getresuid()}, gids {os.getresgid()}, "
                      f"groups {os.getgroups()}, capabilities {caps}")


def check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def wait_for(program: int) -> dict:
    """Reaps orphans (we are their init) until the program itself ends; returns its exit code or signal, and the CPU
    seconds it used (a SIGKILL at RLIMIT_CPU's hard limit is told from others by them)."""
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            ending = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
            return ending | {"cpu_seconds": usage.ru_utime + usage.ru_stime}


def main() -> None:
    for number in IGNORED_SIGNALS:  # a no-op handler: the init lives on, and exec gives the program the defaults back
        signal.signal(number, lambda *_: None)
    status_fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not be able to write the report
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if config.get("drop_to") is not None:  # first: a change of uid resets the parent-death signal
            drop_to(config["drop_to"], libc)
        for option, value in ((PR_SET_NO_NEW_PRIVS, 1), (PR_SET_DUMPABLE, 0), (PR_SET_PDEATHSIG, signal.SIGKILL)):
            check(libc.prctl(option, value, 0, 0, 0), f"prctl({option})")
        for fd in map(int, os.listdir("/proc/self/fd")):  # nothing but stdio reaches the program (bubblewrap's
            if fd > 2:                                      # --userns-block-fd stays open in its child)
                try:
                    os.set_inheritable(fd, False)
                except OSError:  # the listing's own, closed meanwhile
                    pass
        set_limits(config["limits"], count_others=not config["namespaces"])
        os.chdir(config["workdir"])
        env = dict(config["env"], HOME=config["workdir"], TMPDIR=config["workdir"])
        program = os.fork()
        if program == 0:
            # signals the caller blocked or ignored would stay so through exec (SIGXCPU, SIGALRM, SIGINT...)
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            for number in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
                if signal.getsignal(number) == signal.SIG_IGN:
                    signal.signal(number, signal.SIG_DFL)
            python = config["python"]
            try:
                os.execve(python, [python, "-E", "-s", "-B", "-u", "main.py"], env)
            except PermissionError as e:
                if config.get("drop_to") is None:
                    raise
                raise PermissionError(e.errno, f"{e.strerror}: {python} (run by root, the program runs as an "
                                      "unprivileged uid, which must be able to read the interpreter)") from None
    except BaseException as e:  # noqa: BLE001 (anything that stops the program from starting is reported)
        os.write(status_fd, (json.dumps({"error": f"sandbox setup failed: {type(e).__name__}: {e}"}) + "\n").encode())
        os._exit(127)
    os.write(status_fd, (json.dumps(wait_for(program)) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
