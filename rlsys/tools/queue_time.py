"""A tool call's time limit that does not count its waits for a shared resource.

An environment limits each tool call (`within`), as a backstop for a tool that hangs, and the rollout
worker limits each environment call (`env_timeout`) the same way. A call that queues for something
other calls hold (a sandbox slot: a few runs at once per event loop) has not started while it waits;
charged for that wait, a quick call behind a few that run to their own limits would be reported as
timed out, the model told its code hung, or its whole episode failed as `env_timeout`. The resource's
owner acquires it with `queued_for`, which tells every limit the call runs under (a tool call's inside
an environment step's) how long it waited.
"""

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from rlsys.cancellation import cancel_and_wait

T = TypeVar("T")


class _Waits:
    """A call's waits so far, and the start of the one under way."""

    def __init__(self):
        self.total, self.since = 0.0, None

    def seconds(self, now: float) -> float:
        return self.total + (now - self.since if self.since is not None else 0.0)


_waits: contextvars.ContextVar[tuple[_Waits, ...]] = contextvars.ContextVar("rlsys_tool_waits", default=())


class Overran(asyncio.TimeoutError):
    """A `within` call ran past its limit (not a TimeoutError the call raised itself)."""


@contextlib.asynccontextmanager
async def queued_for(lock: asyncio.Semaphore) -> AsyncIterator[None]:
    """Holds `lock` for the block; the wait for it is not charged to the `within` limits of the call it serves."""
    enclosing = _waits.get()
    for waits in enclosing:
        waits.since = time.monotonic()
    try:
        await lock.acquire()
    finally:
        for waits in enclosing:
            waits.total, waits.since = waits.seconds(time.monotonic()), None
    try:
        yield
    finally:
        lock.release()


async def within(call: Coroutine[Any, Any, T], seconds: float) -> T:
    """`call`'s result, or `Overran` (an asyncio.TimeoutError) once it has run `seconds` not counting its
    `queued_for` waits; the call is cancelled then (as `asyncio.wait_for` does)."""
    waits = _Waits()
    context = contextvars.copy_context()
    context.run(_waits.set, (*_waits.get(), waits))
    task = asyncio.get_running_loop().create_task(call, context=context)  # its own context holds its waits
    start = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            left = seconds - (now - start - waits.seconds(now))
            if left <= 0:
                raise Overran
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
    finally:
        await cancel_and_wait([task])
