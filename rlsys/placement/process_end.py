"""A role process's end: Python's own exit, unless something a plugin left would hold it for ever.

Python's exit joins every thread that is not a daemon (and every thread of a ThreadPoolExecutor, from threading's own
exit hook) before it runs the exit handlers (atexit): an environment step, reward or tool call blocked in a thread for
ever (a synchronous call run through asyncio.to_thread, an executor's or its own thread), which no cancellation can
stop, kept the rollout role's process from exiting, until the launcher's stop killed it after its grace
(`cluster.stop_grace_seconds`) and the run's summary named the role among its unclean exits. And as the interpreter
ends, it closes what is left: a coroutine that rlsys/cancellation.py's run_to_the_end left pending, one that awaits
again after its GeneratorExit, loops for ever there.

So the process exits as Python's exit has it, watched: threads still running a share of the stop's grace after the
role ended (rlsys/stop_grace.py, THREADS_END_SHARE: a stop bounds the role's whole end by that grace) are logged
with where they are and left behind, the process exiting without them once the exit handlers ran; where coroutines
were left pending, it exits once the exit handlers ran, before the interpreter's end closes them.

A role run by a Ray actor ends the same way before its run returns (end_role): the actor's process never exits, Ray
kills it once the launcher has the role's code, threads and all, and without a run of the exit handlers, where Ray's
own (ray.shutdown) would end the worker before its reply. So the role's handlers are held aside as it registers them
(HeldExitHandlers) and run at its end, once the threads it started ended or were logged as left behind.
"""

import atexit
import concurrent.futures.thread
import logging
import os
import sys
import threading
import time
import traceback

from rlsys.cancellation import coroutines_left_pending
from rlsys.stop_grace import THREADS_END_SHARE

log = logging.getLogger("rlsys")


def end_process(code: int, grace: float) -> None:
    """Watches the exit of a process whose role ended with `code`, and returns: the caller exits as usual. Where the
    exit has not joined its threads THREADS_END_SHARE of the stop's `grace` (cluster.stop_grace_seconds) later, or
    has coroutines left pending, the process exits with `code` once its exit handlers ran."""
    joined = threading.Event()
    limit = grace * THREADS_END_SHARE  # for a call in flight to return (a bus call, a model loading)

    def exit_handlers_begin() -> None:  # registered last, so run first: Python's exit has joined every thread
        joined.set()
        if coroutines_left_pending():
            log.warning("%d coroutines that ignore being closed are left pending (rlsys/cancellation.py): the "
                        "process exits before the interpreter's end would close them", coroutines_left_pending())
            exit_now(code, exit_handlers_begin)

    atexit.register(exit_handlers_begin)
    threading.Thread(target=exit_unless_joined, args=(joined, code, limit, exit_handlers_begin), name="process-end",
                     daemon=True).start()


def exit_unless_joined(joined: threading.Event, code: int, limit: float, marker) -> None:
    if joined.wait(limit):
        return
    # the main thread waits in Python's exit to join these (none: its exit is slow elsewhere, and not held by them)
    left = threads_left()
    if not left:
        return
    log_left_behind(left, limit, "the process exits without them")
    exit_now(code, marker)


def exit_now(code: int, marker) -> None:
    """Exits with `code` once the exit handlers ran (the logs' flush, multiprocessing's finalizers, a plugin's
    close), without the rest of Python's exit: joining the threads that hold it, or the interpreter's end."""
    atexit.unregister(marker)
    # Private, and on this path alone: no public call runs the exit handlers short of the exit that is held
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class HeldExitHandlers:
    """The exit handlers (atexit) registered in this process from here on, held aside rather than registered: a Ray
    actor's, made before the role's modules import and its plugins start, holds those of its role, which end_role
    runs as the role ends; Ray's own, registered before, stay with the process, which Ray ends."""

    def __init__(self):
        self.held: list[tuple] = []  # (func, args, kwargs), in the order registered
        self.unregister_registered = atexit.unregister
        atexit.register, atexit.unregister = self.register, self.unregister

    def register(self, func, *args, **kwargs):
        self.held.append((func, args, kwargs))
        return func  # as atexit.register's: a decorator

    def unregister(self, func) -> None:
        self.held = [handler for handler in self.held if handler[0] != func]
        self.unregister_registered(func)  # one registered before, as atexit.unregister would

    def run(self) -> None:
        """Each held handler, the last registered first, as Python's exit runs them: one that raises is logged, and
        the rest still run."""
        while self.held:
            func, args, kwargs = self.held.pop()
            try:
                func(*args, **kwargs)
            except BaseException:
                log.exception("the exit handler %r raised", func)


def end_role(handlers: HeldExitHandlers, threads_before: set, grace: float) -> None:
    """What a process's exit does as a role ends, in a process that outlives its role (a Ray actor's), and returns:
    the threads the role started (not in `threads_before`) have THREADS_END_SHARE of the stop's `grace` to end, as
    Python's exit joins them; those still running are logged as left behind, and the role's exit handlers run."""
    limit = grace * THREADS_END_SHARE
    deadline = time.monotonic() + limit
    while (left := threads_left(threads_before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        log_left_behind(left, limit, "the actor's process is killed with them once the role's exit handlers ran")
    handlers.run()


def threads_left(before=frozenset()) -> list[threading.Thread]:
    """The threads, not in `before`, that would hold Python's exit: neither daemons, the main thread, nor a pool's
    thread waiting for work, which Python's exit ends (concurrent.futures' hook)."""
    frames = sys._current_frames()
    return [thread for thread in threading.enumerate()
            if not thread.daemon and thread is not threading.main_thread() and thread not in before
            and getattr(frames.get(thread.ident), "f_code", None) is not concurrent.futures.thread._worker.__code__]


def log_left_behind(left: list[threading.Thread], limit: float, fate: str) -> None:
    frames = sys._current_frames()
    log.error("%d threads still run %g s after the role ended (a plugin's call that never returns: an environment "
              "step, reward or tool run in a thread); left behind, %s. They are at:\n%s",
              len(left), limit, fate, "\n".join(f"{thread.name}:\n" + "\n".join(where(frames.get(thread.ident)))
                                                 for thread in left))


def where(frame) -> list[str]:
    """A thread's stack, outermost first, as `file:line in name` lines."""
    if frame is None:
        return ["  (ended meanwhile)"]
    return [f"  {entry.filename}:{entry.lineno} in {entry.name}" for entry in traceback.extract_stack(frame)]
