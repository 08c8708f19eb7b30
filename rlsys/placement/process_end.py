"""A role process's end: Python's own exit, unless something a plugin left would hold it for ever.

Python's exit joins every thread that is not a daemon (and every thread of a ThreadPoolExecutor, from threading's own
exit hook) before it runs the exit handlers (atexit): an environment step, reward or tool call blocked in a thread for
ever (a synchronous call run through asyncio.to_thread, an executor's or its own thread), which no cancellation can
stop, kept the rollout role's process from exiting, until the launcher's stop killed it after its grace
(`cluster.stop_grace_seconds`) and the run's summary named the role among its unclean exits. And as the interpreter
ends, it closes what is left: a coroutine that rlsys/cancellation.py's run_to_the_end left pending, one that awaits
again after its GeneratorExit, loops for ever there.

So the process exits as Python's exit has it, watched: threads still running THREADS_END_SECONDS after the role ended
are logged with where they are and left behind, the process exiting without them once the exit handlers ran; where
coroutines were left pending, it exits once the exit handlers ran, before the interpreter's end closes them.
"""

import atexit
import logging
import os
import sys
import threading
import traceback

from rlsys.cancellation import coroutines_left_pending

log = logging.getLogger("rlsys")
THREADS_END_SECONDS = 5.0  # for a call in flight to return (a bus call, a model loading): well within a stop's grace


def end_process(code: int, limit: float = THREADS_END_SECONDS) -> None:
    """Watches the exit of a process whose role ended with `code`, and returns: the caller exits as usual. Where the
    exit has not joined its threads `limit` s later, or has coroutines left pending, the process exits with `code`
    once its exit handlers ran."""
    joined = threading.Event()

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
    left = [thread for thread in threading.enumerate() if not thread.daemon and thread is not threading.main_thread()]
    if not left:
        return
    frames = sys._current_frames()
    log.error("%d threads still run %g s after the role ended (a plugin's call that never returns: an environment "
              "step, reward or tool run in a thread); left behind, the process exits without them. They are at:\n%s",
              len(left), limit, "\n".join(f"{thread.name}:\n" + "\n".join(where(frames.get(thread.ident)))
                                           for thread in left))
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


def where(frame) -> list[str]:
    """A thread's stack, outermost first, as `file:line in name` lines."""
    if frame is None:
        return ["  (ended meanwhile)"]
    return [f"  {entry.filename}:{entry.lineno} in {entry.name}" for entry in traceback.extract_stack(frame)]
