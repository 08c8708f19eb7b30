"""Roles as processes on this machine (`cluster.backend=local`), each with the GPUs gpu_layout gives it."""

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.popen_spawn_posix
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time

from rlsys.placement.base import Placement, RoleHandle, learner_rendezvous, process_exit
from rlsys.placement.cpu_threads import role_environment_applied
from rlsys.placement.gpus import gpu_layout, visible_devices
from rlsys.placement.process_end import end_process
from rlsys.placement.signal_mask import blocked_during
from rlsys.protocol import RENDEZVOUS_LISTEN_FD, role_name


class LocalRole(RoleHandle):
    def __init__(self, process: multiprocessing.Process):
        self.process, self.name = process, process.name

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def exit_reason(self) -> str:
        return process_exit(self.process.exitcode)

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


class LocalPlacement(Placement):
    bus_host = "127.0.0.1"  # nothing outside this machine needs the bus

    def __init__(self, config, entry):
        self.config, self.entry = config, entry
        self.gpus = gpu_layout(config.cluster, config.inference, visible_devices())
        self.master_port = 0
        self.roles: list[LocalRole] = []  # every role started here that may still run, for close()
        # Set as the launcher gets a SIGTERM: a role's own SIGTERM is the process group's if it is set soon (_sigterm)
        self.terminated = multiprocessing.get_context("spawn").RawValue("b", 0)
        self._launcher_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._note_sigterm)

    def start(self, role: str, index: int, args: tuple) -> RoleHandle:
        env = {"CUDA_VISIBLE_DEVICES": self.gpus[(role, index)]} if (role, index) in self.gpus else {}
        listener = None
        if role == "learner":
            if index == 0:  # a new group of ranks: a new rendezvous port, bound here and held until rank 0 serves on
                # it (a port picked free here and bound by rank 0 once started could be taken by then)
                listener = socket.create_server(("127.0.0.1", 0))
                self.master_port = listener.getsockname()[1]
            env.update(learner_rendezvous(index, self.config.cluster.n_learner_ranks, "127.0.0.1", self.master_port))
        # the socket goes to the process with its arguments (spawn passes on the descriptors of those it pickles)
        process = RoleProcess(target=run_in_process, name=role_name(role, index),
                              args=(self.entry, role, index, *args, env),
                              kwargs={"launcher_terminated": self.terminated,
                                      "grace": self.config.cluster.stop_grace_seconds,
                                      **({"rendezvous": listener} if listener else {})})
        try:
            with role_environment_applied():  # a process starts with a copy of it
                started_with_stop_signals_blocked(process)
        finally:
            if listener is not None:  # rank 0 holds its own copy now
                listener.close()
        self.roles = [handle for handle in self.roles if handle.is_alive()]  # restarts replace the dead
        self.roles.append(LocalRole(process))
        return self.roles[-1]

    def close(self) -> None:
        """Kills every role process still running. The supervisor's stop has ended them on a run's ordinary ways out;
        this ends those it did not reach (a second Ctrl-C during its stop, an error while the roles were being
        started), which the launcher's exit would otherwise wait on (multiprocessing joins its children at exit)."""
        for handle in self.roles:
            handle.kill()
        signal.signal(signal.SIGTERM, self._launcher_sigterm)

    def _note_sigterm(self, signum, frame) -> None:
        """The launcher's SIGTERM: noted for the roles, then handled as the launcher handles it."""
        self.terminated.value = 1
        if callable(self._launcher_sigterm):
            self._launcher_sigterm(signum, frame)
        elif self._launcher_sigterm == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # what reaches the whole process group to stop a run


def started_with_stop_signals_blocked(process: multiprocessing.Process) -> None:
    """Starts a role process with SIGINT and SIGTERM held back from this thread, so that the process starts with them
    blocked (a signal mask outlives exec) until its first statements take them over (_UNBLOCK_FIRST): a Ctrl-C in the
    seconds a new process spends importing the launcher's main module ended each role there with a KeyboardInterrupt
    traceback on the console. The launcher gets its own signal once the mask is back."""
    # Started first: the first spawn starts multiprocessing's resource tracker, which unblocks both after it
    multiprocessing.resource_tracker.ensure_running()
    blocked_during(STOP_SIGNALS, process.start)


# A role process's first statements, before its interpreter imports anything: Ctrl-C ignored and a SIGTERM held for
# run_in_process, then both taken out of the mask the process started with (started_with_stop_signals_blocked).
# Unblocked only in run_in_process, every thread made before it (by the imports of the launcher's main module and of
# the role's entry: torch's, a BLAS's) kept them blocked for its life, and so did every process such a thread started:
# a redis-server or an engine that a SIGTERM, the parent-death signal included, never reached. A handler is the whole
# process's, not a thread's: run_in_process gives both their own.
_UNBLOCK_FIRST = """
import signal
def held_sigterm(signum, frame):
    held_sigterm.held = True
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, held_sigterm)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
"""


class _RolePopen(multiprocessing.popen_spawn_posix.Popen):
    """multiprocessing's spawn with _UNBLOCK_FIRST ahead of the program its command runs."""

    def _launch(self, process_obj):
        command_line = multiprocessing.spawn.get_command_line

        def unblocking_first(**kwds):
            command = command_line(**kwds)
            if "-c" in command:  # a frozen interpreter's has none: its roles unblock in run_in_process
                program = command.index("-c") + 1
                command[program] = _UNBLOCK_FIRST + command[program]
            return command

        # Python's _launch takes its command from spawn's function: replaced only while this launch runs, on the
        # launcher's one thread that starts roles
        multiprocessing.spawn.get_command_line = unblocking_first
        try:
            super()._launch(process_obj)
        finally:
            multiprocessing.spawn.get_command_line = command_line


class RoleProcess(multiprocessing.context.SpawnProcess):
    """A spawned role process (vLLM and torch do not survive fork) that takes its stop signals out of its mask before
    it imports anything (_UNBLOCK_FIRST)."""

    @staticmethod
    def _Popen(process_obj):
        return _RolePopen(process_obj)


def run_in_process(entry, role: str, index: int, *args, launcher_terminated, grace: float,
                   rendezvous: socket.socket | None = None) -> None:
    """A role process: dies with the launcher, leaves Ctrl-C and a SIGTERM the launcher also gets to it, exits with
    the role's code. `grace`: cluster.stop_grace_seconds, whose share its exit waits for threads at most
    (rlsys/stop_grace.py). `rendezvous`: learner rank 0's listening socket, which its rendezvous serves on
    (rlsys.distributed.rendezvous_store)."""
    _die_with_parent()
    if rendezvous is not None:
        os.environ[RENDEZVOUS_LISTEN_FD] = str(rendezvous.detach())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the launcher stops us
    starting = signal.signal(signal.SIGTERM, functools.partial(_sigterm, os.getppid(), launcher_terminated))
    if getattr(starting, "held", False):  # one that came as the process started (_UNBLOCK_FIRST)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # where _UNBLOCK_FIRST did not run first
    code = entry(role, index, *args)
    if role == "inference":
        # vLLM's exit-time shutdown garbage-collects the engine's whole heap twice (8 s of a CPU run's end); the
        # worker has finished its part, and nothing of the engine outlives the process. multiprocessing's own
        # finalizers still run: they unlink the semaphores the engine made, which the launcher would report leaked.
        multiprocessing.util._run_finalizers()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    end_process(code, grace)  # watches the exit below: a thread or coroutine a plugin left must not hold it for ever
    if code:
        sys.exit(code)


SIGTERM_ALONE_SECONDS = 3.0  # a role's SIGTERM that its launcher did not also get within this was sent to it alone


def _sigterm(launcher: int, launcher_terminated, signum, frame) -> None:
    """A SIGTERM while the launcher lives was sent to the whole process group (Slurm's scancel, systemd's stop,
    `kill -TERM -PGID`) if the launcher got one too: it stops the role as on Ctrl-C, through the bus, so the learner
    saves its checkpoint; killed here, it saved none. The launcher's stop kills a role that outlives its grace. One the
    launcher did not get within SIGTERM_ALONE_SECONDS was sent to this role alone (`kill PID`, a cluster agent): it
    ends the role, which the supervisor restarts as after a crash. Once the launcher is gone, a SIGTERM ends the role
    as it ends any process."""
    if os.getppid() == launcher:
        threading.Thread(target=_end_unless_the_launcher_stops, args=(launcher_terminated,), daemon=True).start()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _end_unless_the_launcher_stops(launcher_terminated) -> None:
    deadline = time.monotonic() + SIGTERM_ALONE_SECONDS
    while not launcher_terminated.value:
        if time.monotonic() > deadline:
            # From this thread, and at once: the main thread may be in a long call, where Python's handlers wait
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal(signal.SIGTERM, None)  # SIG_DFL
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process if the launcher dies, even by SIGKILL. SIGKILL, not SIGTERM: a role's
    SIGTERM handler runs only once its main thread is back in Python, and one waiting in a collective or a long kernel
    would outlive its launcher. A launcher that died before (the process takes a moment to get here) is not watched
    by it: then the role does not start."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != multiprocessing.parent_process().pid:
        os._exit(1)
