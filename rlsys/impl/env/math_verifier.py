"""Math answer checking in a pool of long-lived worker processes with a hard wall-clock deadline.

math-verify runs sympy, which can take unbounded time (or crash) on adversarial model output, and its own
signal-based timeout only works on a main thread and cannot interrupt every C-level loop. So each check runs
in a child process; a check that overruns its deadline gets its worker SIGKILLed and replaced, and the caller
gets a "timeout" verdict instead of an exception. Each worker is a fresh interpreter that imports this module and
the check, nothing else: not a fork (the parent, an asyncio rollout worker, holds threads, and forking a threaded
process can deadlock the child), and not a multiprocessing child either, which first imports the program's entry
script again (the training script: torch, transformers, every experiment; seconds of CPU at each start, on the
cores the run's roles are starting on). So the entry script needs no `if __name__ == "__main__":` guard for it.
Jobs and verdicts cross the worker's socket as JSON.
"""

import asyncio
import atexit
import contextlib
import dataclasses
import importlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

# The default check, and its verdict on plain numbers, which the pool gives in-process: both named by path, so that
# importing this module (every role does, with the built-in environments) does not import math-verify and sympy.
DEFAULT_CHECK = "rlsys.impl.env.math_answers:check_answer"
PLAIN_NUMBERS = "rlsys.impl.env.math_answers:plain_number_verdict"
READY = "ready"


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one answer; `status` says whether `correct` can be trusted."""

    correct: bool
    status: str  # "ok" | "timeout" | "error" | "unparsable"
    reason: str = ""


def resolve(path: str) -> Callable[[str, str], Verdict]:
    """Imports "package.module:function"; a path (not a callable) is what can cross a spawn boundary."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def serve(conn: Connection, check_path: str) -> None:
    """Worker main loop: import the check once, announce readiness, then answer (answer, reference) jobs."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    check = resolve(check_path)
    conn.send_bytes(json.dumps(READY).encode())
    while True:
        try:
            answer, reference = json.loads(conn.recv_bytes())
        except EOFError:  # the parent went away
            return
        try:
            verdict = check(answer, reference)
            if not isinstance(verdict, Verdict):
                raise TypeError(f"{check_path} returned {verdict!r}, not a Verdict")
        except Exception as e:  # a bad answer must never take the worker down
            verdict = Verdict(False, "error", f"{type(e).__name__}: {e}")
        conn.send_bytes(json.dumps(dataclasses.asdict(verdict)).encode())


def _exit_with_parent(parent: int) -> None:
    """The job loop sees its parent gone (EOF) only between checks; a check hung in sympy would outlive a parent
    killed outright (no close(): SIGKILL, the OOM killer) and spin on, orphaned. A thread, since sympy holds the
    GIL only a switch interval at a time; not PR_SET_PDEATHSIG, which fires when the thread that started the worker
    ends (a pool thread), not the process."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


# The worker's program: the parent's import path (as a multiprocessing child gets it), then serve on the socket.
WORKER_PROGRAM = ("import sys; sys.path[:] = sys.argv[3:]; from multiprocessing.connection import Connection; "
                  "from rlsys.impl.env.math_verifier import serve; serve(Connection(int(sys.argv[1])), sys.argv[2])")


class Worker:
    """One child process and the parent's end of its socket; used by one thread at a time."""

    def __init__(self, check_path: str):
        self.ready = self.dead = False
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.start_error: OSError | None = None
        try:
            ours, theirs = socket.socketpair()
            try:
                with theirs:  # closed here once the child has it, so the parent sees EOF when the child dies
                    self.process = subprocess.Popen(
                        [sys.executable, "-c", WORKER_PROGRAM, str(theirs.fileno()), check_path, *sys.path],
                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            except OSError:
                ours.close()
                raise
        except OSError as e:  # out of processes or descriptors for now: dead, so the pool tries again at its release
            self.dead, self.start_error = True, e
            return
        self.conn = Connection(ours.detach())

    def wait_ready(self, startup_timeout: float) -> Verdict | None:
        """None once the worker is ready. Startup (interpreter + sympy import) is not charged to a check."""
        if self.start_error is not None:
            e = self.start_error
            return Verdict(False, "error", f"could not start a verifier worker: {type(e).__name__}: {e}")
        if not self.ready:
            message = self.receive(startup_timeout, "startup")
            self.ready = message == READY
            if not self.ready:
                return message
        return None

    def run(self, answer: str, reference: str, timeout: float) -> Verdict:
        self.conn.send_bytes(json.dumps([answer, reference]).encode())
        message = self.receive(timeout, "check")
        return message if isinstance(message, Verdict) else Verdict(**message)

    def receive(self, timeout: float, what: str):
        """The worker's next message; if it overran or died, it is killed and a Verdict says so instead."""
        try:
            if not self.conn.poll(timeout):
                self.kill()
                return Verdict(False, "timeout", f"{what} exceeded {timeout:g}s; worker killed")
            return json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            # let it finish exiting, so the exit code is its own, not our SIGKILL
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1)
            self.kill()
            return Verdict(False, "error", f"worker died during {what} (exit code {self.process.returncode})")

    def kill(self) -> None:
        self.dead = True
        if self.process is None:  # never started
            return
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.conn.close()


class VerifierPool:
    """A fixed number of workers; each check holds one worker, so concurrent checks never share a deadline.

    Checks run on the pool's own threads (one per worker), which block on the worker's pipe while the event
    loop stays free. Not bound to any event loop, so one pool serves every `asyncio.run` in the process.
    """

    def __init__(self, size: int | None = None, check: str = DEFAULT_CHECK, startup_timeout: float = 60.0):
        resolve(check)  # a typo in the path fails here, not as a dead worker per check
        self._plain_numbers = resolve(PLAIN_NUMBERS) if check == DEFAULT_CHECK else None
        self.size = size or default_size()
        self.check_path = check
        self.startup_timeout = startup_timeout
        self.closed = False
        self._lock = threading.Lock()
        self._workers: set[Worker] = set()
        self._idle: queue.SimpleQueue[Worker | None] = queue.SimpleQueue()  # None: closed
        for _ in range(self.size):
            self._idle.put(self._spawn())
        self._threads = ThreadPoolExecutor(self.size, thread_name_prefix="math-verifier")
        atexit.register(self.close)

    async def check(self, answer: str, reference: str, timeout: float) -> Verdict:
        if self.closed:
            raise RuntimeError("VerifierPool is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.check_blocking, answer, reference, timeout)

    async def score(self, answers: list[str], reference: str, timeout: float) -> list[Verdict]:
        """One verdict per answer, in order; `timeout` is per check, counted from when a worker takes it.

        With the default check, plain numbers are compared in-process (plain_number_verdict).
        """
        if self.closed:
            raise RuntimeError("VerifierPool is closed")

        async def verdict(answer: str) -> Verdict:
            fast = self._plain_numbers(answer, reference) if self._plain_numbers else None
            return fast or await self.check(answer, reference, timeout)

        return list(await asyncio.gather(*(verdict(a) for a in answers)))

    def wait_ready(self) -> None:
        """Blocks until every worker has started (an interpreter and sympy imported: seconds, more on a busy
        machine), so no check waits for it. Takes each worker from the idle queue, as a check would."""
        workers = [self._idle.get() for _ in range(self.size)]
        for worker in workers:
            if worker is None:  # closed: pass the pill on
                self._idle.put(None)
                continue
            worker.wait_ready(self.startup_timeout)  # a worker that fails to start is dead: released, replaced
            self._release(worker)

    def check_blocking(self, answer: str, reference: str, timeout: float) -> Verdict:
        worker = self._idle.get()
        if worker is None:  # close() was called: pass the pill on so no other thread waits forever
            self._idle.put(None)
            return Verdict(False, "error", "verifier pool closed")
        try:
            verdict = worker.wait_ready(self.startup_timeout) or worker.run(answer, reference, timeout)
        except OSError as e:  # died while idle, or killed by close()
            worker.kill()
            verdict = Verdict(False, "error", f"worker unusable: {type(e).__name__}: {e}")
        finally:
            self._release(worker)
        return verdict

    def _release(self, worker: Worker) -> None:
        """Return a live worker to the idle queue, or replace a dead one (unless the pool is closing)."""
        if not worker.dead:
            self._idle.put(worker)
            return
        with self._lock:
            self._workers.discard(worker)
        replacement = self._spawn()
        if replacement is not None:
            self._idle.put(replacement)

    def _spawn(self) -> Worker | None:
        with self._lock:  # close() must see every worker it has to kill
            if self.closed:
                return None
            worker = Worker(self.check_path)
            self._workers.add(worker)
            return worker

    def close(self) -> None:
        """Kill every worker; in-flight checks get "error" verdicts. Idempotent, and also run at exit."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            workers, self._workers = self._workers, set()
        for worker in workers:
            worker.kill()
        self._idle.put(None)
        self._threads.shutdown(wait=False, cancel_futures=True)
        atexit.unregister(self.close)


def default_size() -> int:
    """Half the cores: checking shares the machine with the event loop and the trainer's data pipeline."""
    return max(1, (os.cpu_count() or 2) // 2)


_shared: VerifierPool | None = None
_shared_lock = threading.Lock()


def shared_pool(size: int | None = None) -> VerifierPool:
    """The process-wide pool, created on first use so that merely importing an environment spawns nothing.

    `size` only matters when the pool is created; asking for a different size later is an error rather
    than being silently ignored.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed:
            _shared = VerifierPool(size)
        elif size is not None and size != _shared.size:
            raise ValueError(f"shared verifier pool already has {_shared.size} workers, asked for {size}")
        return _shared


def close_shared_pool() -> None:
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
        _shared = None
