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
    previous = {}
    try:
        for signum in STOP_SIGNALS:  # one at a time: a signal whose handler raises between two swaps undoes the first
            previous[signum] = signal.signal(signum, lambda signum, frame: came.append(signum))
        yield
    finally:
        handlers_put_back(previous)
        if came:
            signal.raise_signal(came[0])


def handlers_put_back(handlers: dict) -> None:
    """signal.signal(signum, handler) for each, whatever a handler of a signal that comes meanwhile raises (it runs
    before a swap, which it leaves unmade, or after one): every handler is put back, and the first raise follows."""
    raised = None
    for signum, handler in handlers.items():
        while signal.getsignal(signum) is not handler:
            try:
                signal.signal(signum, handler)
            except BaseException as e:  # a stop signal's own (KeyboardInterrupt, SystemExit): raised below
                raised = raised or e
    if raised is not None:
        raise raised
