"""Why an episode failed: environment calls bounded in time, and every failure named by one reason.

An environment's constructor, `reset`, `step` and `close` are the only calls into environment code (rewards are
computed in `step`). `new_env` makes an episode's environment and `guard_env` binds its methods, on the env object
itself, to a deadline (not counting their waits for a shared resource such as a sandbox slot:
rlsys/tools/queue_time.py), and turns what they raise into `EpisodeFailed("env_error")` or, past the deadline,
`EpisodeFailed("env_timeout")`: the agent's `await env.step(...)` raises it, and unless the agent handles it, the
episode ends with that reason. Anything else the agent raises is an `agent_error`. The env stays the same object (its
other methods and attributes, isinstance) so agents that use more of their env than the contract keep working. A
`fork` of a guarded env is guarded in its own right: a copy of the instance would otherwise keep methods bound to the
original, and every chain of a group would step one board.

A synchronous method (`def step`, a reward function that may block) runs on a thread of its own
(rlsys/blocking_calls.py), so the deadline ends its episode while the worker's other episodes go on; what it returns
may still be awaitable, and is then awaited on the loop. The constructor always does: one that connects or loads
cannot be told from one that does not before it runs, and its hand-over to a waiting thread is small beside
an episode (BENCHMARKS.md, "An episode's environment made off the loop"). The deadline
can only interrupt an `async def` method that awaits (I/O, a process pool): one that blocks the event loop with
synchronous work stalls every episode of the worker until the stall watch stops the run naming the worker, which is
why blocking environment work belongs in a `def` method or off the loop (see rlsys/api/env.py). Which a method is is
read once, when the env is guarded: an `async def` method pays nothing for it.
"""

import functools
import traceback

from rlsys.api import ENVIRONMENTS, EnvServiceAbstraction, make_env
from rlsys.blocking_calls import async_form
from rlsys.errors import EpisodeFailed
from rlsys.tools.queue_time import Overran, within
from rlsys.workers.episode_activity import EpisodeActivity


GUARDED = ("reset", "step", "close", "fork")


async def new_env(abstraction: EnvServiceAbstraction, timeout: float, activity: EpisodeActivity | None = None):
    """A guarded environment of `abstraction`, its constructor guarded as its methods are: on a thread of its own,
    within `timeout` s (0: no limit), what it raises an EpisodeFailed."""
    activity = activity or EpisodeActivity()
    label = f"{ENVIRONMENTS.lookup(abstraction.name).__name__}.__init__"
    made = await _guarded(functools.partial(make_env, abstraction), label, timeout, activity)()
    return guard_env(made, timeout, activity)


def guard_env(env, timeout: float, activity: EpisodeActivity | None = None):
    """`env`, with reset/step/close/fork raising EpisodeFailed on an exception or after `timeout` s (0: no
    limit), each call counted in `activity` while it runs (an episode in one is not stuck on its agent); what fork
    returns is guarded the same way."""
    activity = activity or EpisodeActivity()
    for name in GUARDED:
        setattr(env, name, _guarded(getattr(env, name), f"{type(env).__name__}.{name}", timeout, activity))
    fork = env.fork

    async def guarded_fork():
        copy = await fork()
        for name in GUARDED:  # the copy's instance attributes: wrappers of the original's methods
            vars(copy).pop(name, None)
        return guard_env(copy, timeout, activity)

    env.fork = guarded_fork
    return env


def _guarded(method, label: str, timeout: float, activity: EpisodeActivity):
    run = async_form(method, label)

    @functools.wraps(method)
    async def call(*args, **kwargs):
        activity.count_env_call(1)
        try:
            return await (within(run(*args, **kwargs), timeout) if timeout else run(*args, **kwargs))
        except EpisodeFailed:
            raise
        except Overran:
            raise EpisodeFailed("env_timeout", f"{label} took longer than {timeout:g}s (env_timeout)") from None
        except Exception as e:
            raise EpisodeFailed("env_error", f"{label} raised {describe_exception(e)}") from e
        finally:
            activity.count_env_call(-1)

    return call


def describe_exception(e: BaseException) -> str:
    """`Type: message (at file:line in function)`, where the innermost frame is: one line for a log."""
    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        last = frames[-1]
        where = f" (at {last.filename}:{last.lineno} in {last.name})"
    message = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}{': ' + message if message else ''}{where}"
