"""The supervisor's stop: what it reports of the roles that did not end cleanly once told to stop."""

import multiprocessing
import os
import resource
import time

from rlsys import protocol, supervisor
from rlsys.bus.inproc import InProcessBus
from rlsys.placement.local import LocalRole


def finish() -> None:
    pass


def crash_on_the_way_out() -> None:
    time.sleep(0.2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the tests' folder
    os.abort()  # as a native abort at interpreter exit ends a role


def ignore_the_stop() -> None:
    time.sleep(600)


def test_the_stop_names_each_role_that_crashed_or_had_to_be_killed(monkeypatch):
    monkeypatch.setattr(supervisor, "STOP_GRACE_SECONDS", 3)
    ctx = multiprocessing.get_context("spawn")
    roles = []
    for name, target in (("learner0", finish), ("rollout0", crash_on_the_way_out), ("inference0", ignore_the_stop)):
        process = ctx.Process(target=target, name=name)
        process.start()
        roles.append(LocalRole(process))
    bus = InProcessBus()
    start = time.monotonic()
    unclean = supervisor.stop_processes(bus, roles)
    assert time.monotonic() - start < 3 + 10
    assert bus.get(protocol.STOP) == 1
    assert unclean == {"rollout0": "exited with code -6 (SIGABRT)",
                       "inference0": "was still running 3 s after the stop, and was killed"}
    assert [role.exitcode for role in roles] == [0, -6, -9]
