"""A role process's end, which does not wait for ever for a thread a plugin left blocked.

Python's exit joins every thread that is not a daemon, and every thread of a ThreadPoolExecutor (concurrent.futures
joins them from threading's own exit hook, before the atexit handlers): an environment step, reward or tool call
blocked in a thread for ever (a synchronous call run through asyncio.to_thread, an executor's or its own thread),
which no cancellation can stop, kept the rollout role's process from exiting, until the launcher's stop killed it
after its grace (`cluster.stop_grace_seconds`) and the run's summary named the role among its unclean exits. The
role's process ends as Python's exit would (its exit handlers and multiprocessing's finalizers run, its output is
flushed), then waits for such threads THREADS_END_SECONDS at most; those still running are logged with where they
are and left behind: the process exits without joining them.
"""

import atexit
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import traceback

log = logging.getLogger("rlsys")
THREADS_END_SECONDS = 5.0  # for a call in flight to return (a bus call, a model loading): well within a stop's grace


def end_process(code: int, limit: float = THREADS_END_SECONDS) -> None:
    """Runs the process's exit handlers, and waits up to `limit` s for the threads its exit would join; if some
    still run then, logs them and exits with `code` at once. Returns where none is left (the caller exits as usual,
    and its exit has nothing left to wait for)."""
    atexit._run_exitfuncs()  # the reward model's scorer and the verifier pool end their own threads here
    multiprocessing.util._run_finalizers()
    left = threads_left(limit)
    if not left:
        return
    frames = sys._current_frames()
    log.error("%d threads still run %g s after the role ended (a plugin's call that never returns: an environment "
              "step, reward or tool run in a thread); left behind, the process exits without them. They are at:\n%s",
              len(left), limit, "\n".join(f"{thread.name}:\n" + "\n".join(where(frames.get(thread.ident)))
                                           for thread in left))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def threads_left(limit: float) -> list[threading.Thread]:
    """The threads Python's exit would join (not daemons, not this one) still running after up to `limit` s."""
    deadline = time.monotonic() + limit
    left = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(thread)
    return left


def where(frame) -> list[str]:
    """A thread's stack, outermost first, as `file:line in name` lines."""
    if frame is None:
        return ["  (ended meanwhile)"]
    return [f"  {entry.filename}:{entry.lineno} in {entry.name}" for entry in traceback.extract_stack(frame)]
