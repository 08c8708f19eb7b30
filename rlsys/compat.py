"""The few standard-library features rlsys uses that Python 3.10 lacks, at the bottom of the package.

rlsys supports Python 3.10+ (setup.py). Code that needs a 3.11-only API imports it from here instead;
`tests/test_python_versions.py` refuses the 3.11-only names anywhere else in the package and, where a
python3.10 is on the machine, compiles the package and runs the episode guard under it.
"""

import asyncio
import sys

if sys.version_info >= (3, 11):
    timeout = asyncio.timeout
else:

    class timeout:  # noqa: N801 - stands in for asyncio.timeout, named as it is
        """`async with timeout(delay) as deadline:` as asyncio.timeout does it on 3.11: past `delay` seconds (None: no
        limit) the block's task is cancelled and the block raises the builtin TimeoutError; `deadline.expired()`
        tells that timeout from a TimeoutError the block raised itself."""

        def __init__(self, delay: float | None):
            self._delay, self._expired, self._handle, self._task = delay, False, None, None

        def expired(self) -> bool:
            return self._expired

        async def __aenter__(self) -> "timeout":
            self._task = asyncio.current_task()
            if self._delay is not None:
                self._handle = asyncio.get_running_loop().call_later(self._delay, self._expire)
            return self

        def _expire(self) -> None:
            self._expired = True
            self._task.cancel()

        async def __aexit__(self, kind, error, traceback) -> None:
            if self._handle is not None:
                self._handle.cancel()
            if self._expired and kind is asyncio.CancelledError:
                raise TimeoutError from error
