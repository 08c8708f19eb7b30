"""Cancelling tasks that may not end at their first cancellation.

asyncio delivers a cancellation once: code that catches the CancelledError and does not raise it again goes on
running, and whoever waits for it to end waits for ever. Libraries agents and environments use do this now and then:
httpx (anyio's connect_tcp, which cancels its own connection attempts once one connects) returns a response now and
then from a request whose task was cancelled while it connected. A rollout worker that cancels its episodes at the
end of training, an episode that stops its agent, a time limit that stops an environment call: each cancels again,
once a CANCEL_AGAIN_SECONDS, what has not ended, as anyio's own cancel scopes do.
"""

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor

CANCEL_AGAIN_SECONDS = 1.0
# Tasks run_to_the_end left pending: held, so that the garbage collector does not close them outside any loop (where
# one that awaits again after its GeneratorExit loops for ever) at some moment of the process's later work
_left_pending: list[asyncio.Task] = []


async def cancel_and_wait(tasks: Iterable[asyncio.Task], limit: float | None = None) -> set[asyncio.Task]:
    """Cancels `tasks` and waits for them to end, cancelling those that go on again every CANCEL_AGAIN_SECONDS, for
    at most `limit` s (None: until they end). Returns the tasks still running then. What they raised is retrieved,
    not raised. The caller waits for them even if it is cancelled meanwhile: its own cancellation is raised after."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    running, interrupted = {task for task in tasks if not task.done()}, None
    while running and (deadline is None or loop.time() < deadline):
        for task in running:
            task.cancel()
        wait = CANCEL_AGAIN_SECONDS if deadline is None else min(CANCEL_AGAIN_SECONDS, deadline - loop.time())
        try:
            _, running = await asyncio.wait(running, timeout=wait)
        except asyncio.CancelledError as e:  # raised once they ended: an episode's agent ends before its env closes
            interrupted = e
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # what a task raised on its way out is no news: retrieved, so asyncio does not log it
    if interrupted is not None:
        raise interrupted
    return running


def run_to_the_end(main: Coroutine, limit: float = CANCEL_AGAIN_SECONDS):
    """asyncio.run(main), but what still runs once `main` returned is not waited for for ever: asyncio.run cancels the
    tasks left once and gathers them, so one that ignores its cancellation (an episode the end of training left behind,
    rlsys/workers/rollout_worker.py) kept the process from exiting. They are cancelled again for `limit` s
    (`cancel_and_wait`); those that go on are closed (GeneratorExit is raised where they wait: their `finally` blocks
    run) and given `limit` s more to end; any still there is left pending as the loop closes, and held for the life
    of the process (`coroutines_left_pending`: its end must not close them, rlsys/placement/process_end.py).

    Nor does it wait for the calls of the loop's default executor (asyncio.to_thread) still running, as asyncio.run
    does: a thread cannot be cancelled, and an environment step blocked in one for ever held the loop for ever. Those
    not started are cancelled; those running go on, and the process's end waits for them a while at most
    (rlsys/placement/process_end.py)."""
    loop = asyncio.new_event_loop()
    calls = ThreadPoolExecutor(thread_name_prefix="asyncio")  # as asyncio's own default, but this function's to end
    loop.set_default_executor(calls)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(_end_the_rest(limit))
            loop.run_until_complete(loop.shutdown_asyncgens())
            calls.shutdown(wait=False, cancel_futures=True)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _end_the_rest(limit: float) -> None:
    stuck = await cancel_and_wait(asyncio.all_tasks() - {asyncio.current_task()}, limit)
    for task in stuck:
        with contextlib.suppress(RuntimeError):  # one that awaits again after GeneratorExit: left pending
            task.get_coro().close()
    # a closed one ends at its next step, raising RuntimeError: retrieved
    _left_pending.extend(await cancel_and_wait(stuck, limit))


def coroutines_left_pending() -> int:
    """How many coroutines run_to_the_end left pending, which cannot be closed."""
    return len(_left_pending)
