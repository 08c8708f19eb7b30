"""The launcher's stop signals (Ctrl-C, SIGTERM): which exit is a stop's, and holding one back while the run's books
are set or its summary written, so that neither is left half done."""

import contextlib
import signal

from rlsys.placement.local import STOP_SIGNALS


STOP_EXIT_CODES = {128 + signal.SIGTERM: "SIGTERM"}  # SystemExit codes of a stop (rlsys.bus.raise_on_sigterm's)


def stop_signal(e: BaseException) -> str | None:
    """The signal that stopped the launcher by `e`, or None where `e` is no stop's."""
    if isinstance(e, KeyboardInterrupt):
        return "SIGINT"
    return STOP_EXIT_CODES.get(e.code) if isinstance(e, SystemExit) else None


@contextlib.contextmanager
def stop_signals_deferred():
    """A Ctrl-C or SIGTERM within the block is noted, and handled as the block ends, where it would have been handled
    (the first of them: the second a run gets kills its roles anyway). A signal mask would not do: it holds a signal
    back from one thread, and any other thread of the process takes it (Python then raises it in the main thread at
    once). Main thread only."""
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])
