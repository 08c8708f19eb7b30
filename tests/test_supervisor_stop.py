"""The supervisor's stop: what it reports of the roles that did not end cleanly once told to stop; and how it names
a learner rank that died."""

import contextlib
import multiprocessing
import os
import resource
import signal
import threading
import time

import pytest
import redis

from rlsys import protocol, supervisor
from rlsys.bus.inproc import InProcessBus
from rlsys.cli import parse_config
from rlsys.errors import LearnerFailed, RoleFailed
from rlsys.placement.base import RoleHandle
from rlsys.placement.local import STOP_SIGNALS, LocalPlacement, LocalRole


def finish() -> None:
    pass


def crash_on_the_way_out() -> None:
    time.sleep(0.2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the tests' folder
    os.abort()  # as a native abort at interpreter exit ends a role


def ignore_the_stop() -> None:
    time.sleep(600)


def test_the_stop_names_each_role_that_crashed_or_had_to_be_killed():
    ctx = multiprocessing.get_context("spawn")
    roles = []
    for name, target in (("learner0", finish), ("rollout0", crash_on_the_way_out), ("inference0", ignore_the_stop)):
        process = ctx.Process(target=target, name=name)
        process.start()
        roles.append(LocalRole(process))
    # The two that end by themselves ended before the stop: a spawn slower than the grace (a loaded machine's took
    # over 3 s) had them killed mid-start, and reported as still running
    for role in roles[:2]:
        role.process.join()
    bus = InProcessBus()
    start = time.monotonic()
    unclean = supervisor.stop_processes(bus, roles, grace=3)
    assert time.monotonic() - start < 3 + 10
    assert bus.get(protocol.STOP) == 1
    assert unclean == {"rollout0": "exited with code -6 (SIGABRT)",
                       "inference0": "was still running 3 s after the stop, and was killed (a learner that needs "
                                     "longer to finish its step and save: cluster.stop_grace_seconds)"}
    assert [role.exitcode for role in roles] == [0, -6, -9]


@contextlib.contextmanager
def supervising(overrides: list[str], entry):
    """A supervisor whose roles run `entry` in local processes, started; every one still running ends at the exit."""
    config = parse_config(overrides)
    placement = LocalPlacement(config, entry)
    watching = supervisor.Supervisor(config, lambda role, index: placement.start(role, index, ()))
    try:
        watching.start()
        yield watching
    finally:
        placement.close()


def learner1_dies(role, index, *args):
    return 1 if (role, index) == ("learner", 1) else time.sleep(600)  # the others run on


def test_a_learner_rank_that_died_is_named_in_its_restart(caplog):
    """Any rank's death restarts the run; each was counted as learner0's, with the rank that died in the reason:
    "learner0 learner1 exited with code 1; restarting it", and at the limit "error: learner0 learner1 exited ...".
    """
    with supervising(["cluster.n_learner_ranks=2"], learner1_dies) as watching:
        with pytest.raises(LearnerFailed, match=r"^learner1 exited with code 1$"):
            watching.watch(InProcessBus(), report=lambda: None)
    assert watching.restarts == {"learner1": 1}
    assert "learner1 exited with code 1; restarting it (restart 1 of 3)" in caplog.text


def rollout_exits_early(role, index, *args):
    return 0 if role == "rollout" else time.sleep(600)  # as a plugin's sys.exit() ends a rollout worker


def test_a_rollout_worker_that_exits_without_being_done_is_restarted_not_waited_for(monkeypatch):
    """Exit code 0 counted as a role that finished its part; a rollout worker that exited 0 before it said it was
    done (its done key) was never restarted, and the run waited for it for ever, in silence."""
    deadline = time.monotonic() + 60

    def report():
        assert time.monotonic() < deadline, "the supervisor still waits for a rollout worker that exited"

    with supervising(["cluster.max_role_restarts=1"], rollout_exits_early) as watching:
        with pytest.raises(RoleFailed, match=r"^rollout0 exited with code 0 before it was done, and was restarted 1 "):
            watching.watch(InProcessBus(), report)
    assert watching.restarts == {"rollout0": 1}


class UnreachableBus(InProcessBus):
    """A Redis given by cluster.redis_url that went away for longer than the bus waits out a restart."""

    def get(self, key):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6392. Connection refused.")


def test_a_joined_redis_that_stops_answering_stops_the_run_with_a_reason():
    """It ended the launcher with redis's own traceback, and no `error:` line."""
    watching = supervisor.Supervisor(parse_config([]), start_role=None, server=None)
    with pytest.raises(RoleFailed, match=r"^the run's Redis \(cluster.redis_url\) stopped answering: Error 111 "):
        watching.watch(UnreachableBus(), lambda: None)


def ends_at_once(role, index, *args) -> int:
    return 0


def test_a_ctrl_c_while_a_role_process_starts_is_left_to_the_launcher():
    """The role's process ignored Ctrl-C only once it ran the role: one in the seconds it spent importing the
    launcher's main module ended it there, with a KeyboardInterrupt traceback on the console."""
    placement = LocalPlacement(parse_config([]), ends_at_once)
    try:
        role = placement.start("rollout", 0, ())
        os.kill(role.process.pid, signal.SIGINT)  # as Ctrl-C reaches the whole process group: it is still importing
        role.join(timeout=60)
        assert role.exitcode == 0
    finally:
        placement.close()


def save_for_two_seconds(role, index, *args):
    return time.sleep(2) if role == "learner" else None  # a learner finishing its step and its checkpoint


@pytest.mark.parametrize("grace, killed", [(1, True), (60, False)])  # the stop waits only as long as the role runs
def test_the_stop_gives_the_roles_cluster_stop_grace_seconds(grace, killed):
    """The grace was 20 s whatever the model: a learner whose step and save took longer was killed, and a run that
    saves only at its end lost its only checkpoint."""
    with supervising([f"cluster.stop_grace_seconds={grace}"], save_for_two_seconds) as watching:
        unclean = watching.stop(InProcessBus())
    assert ("learner0" in unclean) == killed
    if killed:
        assert unclean["learner0"].startswith(f"was still running {grace} s after the stop")


class HungRole(RoleHandle):
    """A role that outlives any grace; `ctrl_c`, while it holds one, cuts the wait for it short a second later, as a
    Ctrl-C does the stop's."""

    def __init__(self, name: str, ctrl_c: list):
        self.name, self.ctrl_c, self.waits, self.code = name, ctrl_c, [], None

    @property
    def exitcode(self) -> int | None:
        return self.code

    def join(self, timeout: float) -> None:
        self.waits.append(timeout)
        if self.ctrl_c:
            self.ctrl_c.pop()
            time.sleep(1)
            raise KeyboardInterrupt

    def kill(self) -> None:
        self.code = -9


def test_a_stop_called_again_waits_only_what_is_left_of_the_first_ones_grace():
    """A learner's restart stops the roles, and the part's end stops them again: a Ctrl-C during the restart's stop
    cut it short, and the second gave the roles a whole grace more (two, where a role that hangs is killed after
    cluster.stop_grace_seconds). A new part's roles get their own."""
    roles, ctrl_c = {}, ["once"]
    watching = supervisor.Supervisor(parse_config(["cluster.stop_grace_seconds=10"]), lambda role, index: (
        roles.setdefault(protocol.role_name(role, index), HungRole(protocol.role_name(role, index), ctrl_c))))
    watching.start()
    with pytest.raises(KeyboardInterrupt):
        watching.stop(InProcessBus())
    unclean = watching.stop(InProcessBus())
    assert max(wait for role in roles.values() for wait in role.waits[-1:]) <= 10 - 1
    killed = ("was still running 10 s after the stop, and was killed (a learner that needs longer to finish its step "
              "and save: cluster.stop_grace_seconds)")
    assert unclean == dict.fromkeys(roles, killed) and len(roles) == 3
    roles.clear()
    watching.start()
    watching.stop(InProcessBus())
    assert roles["learner0"].waits[0] > 10 - 1  # the first stop was a second ago: this part's waits its own grace


def rollout_exits_3(role, index, *args):
    return 3 if role == "rollout" else time.sleep(600)  # a plugin's sys.exit(3), no reason said


def test_a_role_that_exits_with_code_3_without_a_reason_is_restarted_not_taken_for_a_stop(caplog):
    """Code 3 is what a role that cannot go on exits with, after it has put its reason on the bus; another exit with
    it stopped the run as "rollout0 stopped the run: None"."""
    with supervising(["cluster.max_role_restarts=1"], rollout_exits_3) as watching:
        with pytest.raises(RoleFailed, match=r"rollout0 exited with code 3"):
            watching.watch(InProcessBus(), report=lambda: None)
    assert "rollout0 exited with code 3; restarting it (restart 1 of 1)" in caplog.text


def test_a_start_clears_the_stop_reasons_an_earlier_run_left_for_every_role():
    """A role that cannot go on leaves its reason on the bus and exits with code 3; a reason an earlier run on the same
    Redis left for the learner or an inference worker stayed, and a later run's role that exited with code 3 without
    one stopped that run with the earlier run's reason instead of being restarted."""
    from rlsys.run_start import initialize_bus_state

    config = parse_config(["cluster.n_learner_ranks=2"])
    bus = InProcessBus()
    roles = ["learner0", "learner1", "inference0", "rollout0"]
    for role in roles:
        bus.set(protocol.role_stop_reason(role), "the earlier run's weight checksum did not match")
    initialize_bus_state(bus, config, {})
    assert {role: bus.get(protocol.role_stop_reason(role)) for role in roles} == dict.fromkeys(roles)


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_stop_signal_while_they_are_deferred_comes_once_the_block_ends(signum, raised):
    """What the launcher defers them for (setting a restart's books, writing a stopped run's summary) is done whole:
    a Ctrl-C or SIGTERM amid it is raised after it, not where it came. A signal mask of the main thread held back
    nothing: another thread took the signal, and Python raised it in the main thread at once."""
    from rlsys.bus import raise_on_sigterm
    from rlsys.stop_signals import stop_signals_deferred

    other = threading.Thread(target=time.sleep, args=(1,))  # one that could take the signal
    other.start()
    done = []
    with raise_on_sigterm(), pytest.raises(raised):
        with stop_signals_deferred():
            os.kill(os.getpid(), signum)
            time.sleep(0.2)
            done.append("the deferred part")
        done.append("after it")
    other.join()
    assert done == ["the deferred part"]


@pytest.mark.parametrize("raising_call", [2, 3], ids=["between-the-two-swaps", "as-the-first-is-put-back"])
def test_a_stop_signal_whose_handler_raises_amid_the_swaps_leaves_every_handler_as_it_was(monkeypatch, raising_call):
    """A signal that came while the handlers were being swapped runs its handler inside signal.signal, before the
    swap it was called for; where that handler raises (SIGTERM's SystemExit, Ctrl-C's KeyboardInterrupt), the other
    signal's handler was left as the block's, which only notes a signal: a later Ctrl-C or SIGTERM did nothing."""
    from rlsys import stop_signals

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    calls, real_signal = [], signal.signal

    def signal_with_one_pending(signum, handler):
        calls.append(signum)
        if len(calls) == raising_call:
            raise SystemExit(128 + signal.SIGTERM)  # the pending signal's handler ran first: no swap made
        return real_signal(signum, handler)

    monkeypatch.setattr(stop_signals.signal, "signal", signal_with_one_pending)
    with pytest.raises(SystemExit):
        with stop_signals.stop_signals_deferred():
            pass
    monkeypatch.setattr(stop_signals.signal, "signal", real_signal)
    after = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in before.items():  # this process's other tests keep theirs, whatever this one finds
        signal.signal(signum, handler)
    assert after == before
