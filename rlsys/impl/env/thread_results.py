"""Handing a result computed on a thread of its own back to the event loop that waits for it."""

import asyncio


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
