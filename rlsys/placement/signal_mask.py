"""A thread's signal mask changed for one call (a process start: the process starts with the mask, which outlives
exec), and put back however a signal handler raises meanwhile.

Python runs the handlers of signals that came meanwhile inside pthread_sigmask itself, once the mask is changed, and
as each Python function begins (signal.pthread_sigmask is one). A Ctrl-C (KeyboardInterrupt) or a SIGTERM whose
handler raises (rlsys.bus.raise_on_sigterm's SystemExit) that came as the block began raised out of the call that
blocked them, before there was a mask to put back; the thread kept both blocked for life, and so did each thread it
made and each process it started after (a test process's launchers, and the processes they started). Seen: once in
some thousands of SIGINTs that came as a role process was started.
"""

import _signal
import signal


def blocked_during(signals: set, call):
    """call()'s result, with `signals` blocked in this thread while it runs; the mask as it was once it returns or
    raises."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # unchanged: a handler that raises here changes nothing
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        return call()
    finally:
        # _signal's own: it sets the mask before it runs a handler, where signal's Python wrapper runs them first
        _signal.pthread_sigmask(signal.SIG_SETMASK, previous)
