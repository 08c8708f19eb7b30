"""User code that may block, run where a block cannot freeze the event loop: a daemon thread to itself per call.

A synchronous environment method or constructor, tool call or reward function run on the rollout worker's event loop
would stop every episode of the worker (and its beat) for as long as it blocks, and nothing can pre-empt it there. On
a thread its caller's deadline still ends the wait. A thread cannot be stopped, though: one still running when its
caller stops waiting is left running, named in `left_running` and logged, and logged again if it ends. Each call has a
thread to itself rather than a pool's queue: a hung call holds only its own thread, never one that later calls queue
for, nor one of the loop's default executor, whose few threads every bus call of the rollout worker waits for
(asyncio.to_thread). A thread whose call returned waits a while for the next (a thread's start costs several times
the hand-over, and an episode makes its environment on one); one that was left running takes calls again once its
call ends. A daemon thread does not hold the process's exit either (rlsys/placement/process_end.py logs those still
running then).
"""

import asyncio
import functools
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_left_running: list[str] = []  # the labels of calls still running after their callers stopped waiting
_idle: list["_Thread"] = []  # threads whose call returned, waiting for another; the most recent last
IDLE_NAME = "blocking-calls-idle"
IDLE_SECONDS = 30.0  # a thread given no call for this long ends: a burst's threads do not stay for good


class _Thread:
    """A daemon thread that runs the calls handed to it (`calls`) one at a time, named for the one it runs; between
    calls in `_idle`, until IDLE_SECONDS pass without one. A call returns how to tell its caller what it gave, done
    once the thread is idle again: a caller that makes its next call at once finds this thread waiting for it."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.serve, name=IDLE_NAME, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while (call := self.next_call()) is not None:
            answer = call()
            self.thread.name = IDLE_NAME
            with _lock:
                _idle.append(self)
            answer()

    def next_call(self) -> Callable[[], Callable[[], None]] | None:
        try:
            return self.calls.get(timeout=IDLE_SECONDS)
        except queue.Empty:
            with _lock:
                if self in _idle:
                    _idle.remove(self)
                    return None
            return self.calls.get()  # taken from _idle meanwhile: its call is on the way


def _hand_over(call: Callable[[], Callable[[], None]]) -> None:
    """`call()` on an idle thread, or a new one if none is idle."""
    with _lock:
        thread = _idle.pop() if _idle else None
    (thread or _Thread()).calls.put(call)


def _forget_threads() -> None:
    """In a forked child: its parent's threads are not there (nor a hold of the lock one of them had)."""
    global _lock
    _lock = threading.Lock()
    _idle.clear()
    _left_running.clear()


os.register_at_fork(after_in_child=_forget_threads)


def left_running() -> list[str]:
    """The labels of this process's calls still running on their threads after their callers stopped waiting."""
    with _lock:
        return list(_left_running)


async def on_own_thread(function: Callable[[], Any], label: str) -> Any:
    """`function()` on a daemon thread to itself, named `label` while it runs; what it returns or raises, once it
    does. A cancelled wait (its caller's deadline) leaves the call running on its thread: named in `left_running`
    until it ends."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    call = {"ended": False, "abandoned_at": None}

    def run() -> Callable[[], None]:
        threading.current_thread().name = label
        result, error = None, None
        try:
            result = function()
        except BaseException as e:  # noqa: BLE001 (raised in the caller)
            error = e
        with _lock:
            call["ended"] = True
            if call["abandoned_at"] is not None:
                _left_running.remove(label)
                log.warning("%s ended on its thread %.0f s after its caller stopped waiting (%d still running)",
                            label, time.monotonic() - call["abandoned_at"], len(_left_running))
        return functools.partial(settle_from_thread, loop, future, result, error)

    _hand_over(run)
    try:
        return await future
    except asyncio.CancelledError:
        with _lock:
            if not call["ended"]:
                call["abandoned_at"] = time.monotonic()
                _left_running.append(label)
                log.warning("%s is still running on its thread, which cannot be stopped: left running (%d such "
                            "threads in this process)", label, len(_left_running))
        raise


def async_form(method: Callable, label: str) -> Callable[..., Awaitable]:
    """`method` itself where it is a coroutine function; else one that runs it on a thread of its own (`label`) and
    gives what it returns, awaited on the loop where that is awaitable (a `def` that returns a coroutine). Read once:
    an `async def` method pays nothing per call."""
    if asyncio.iscoroutinefunction(method):
        return method

    @functools.wraps(method)
    async def off_the_loop(*args, **kwargs):
        result = await on_own_thread(functools.partial(method, *args, **kwargs), label)
        return await result if inspect.isawaitable(result) else result

    return off_the_loop


def settle_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None,
                       error: BaseException | None = None) -> None:
    """From another thread: `future` (of `loop`) gets `error` if there is one, else `result`, unless it is done by
    then (its caller stopped waiting: a timeout, a cancel) or the loop has closed (nobody waits for it)."""
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop has closed
        pass


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
