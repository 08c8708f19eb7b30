"""Watching a run's processes: what dies is restarted where the run can go on, or the run stops and says why.

- An inference worker that dies is marked dead on the bus at once (rlsys.workers.inference_status), so the
  routers re-send the requests it held without waiting for a missed heartbeat, and it is restarted.
- A rollout worker that dies is restarted; the new one redoes its predecessor's unfinished episodes and
  goes on from its place in the prompt stream.
- The private redis-server that dies is restarted on the same port, with the data its append-only file
  kept; every role's client waits for it (rlsys.bus.redis_bus), but not the launcher's, which restarts it. One that
  cannot be started again (its port taken meanwhile) stops the run with RoleFailed and the server's reason.
- The learner that dies cannot be replaced alone: the weights in inference are newer than its last
  checkpoint. LearnerFailed tells the launcher to restart the whole run from that checkpoint.

Each process (and the server) may be restarted `cluster.max_role_restarts` times; one more death stops
the run with RoleFailed. Every restart logs one line and is counted in the run's summary.

A role that finds the run cannot go on (every episode fails: the env or agent is broken, not unlucky)
raises RunCannotGoOn; it leaves its reason on the bus and exits with CANNOT_GO_ON_EXIT, and the run stops
at once with that reason instead of restarting a role that would only fail the same way.
"""

import collections
import contextlib
import logging
import time

import redis

from rlsys import protocol
from rlsys.bus.redis_server import EmbeddedRedisError
from rlsys.errors import LearnerFailed, RoleFailed
from rlsys.placement.base import process_exit
from rlsys.workers.inference_status import InferenceStatus

log = logging.getLogger("rlsys")
POLL_SECONDS = 0.5
CANNOT_GO_ON_EXIT = 3


class Supervisor:
    """Starts a run's roles with `start_role(role, index) -> RoleHandle` (a process or a Ray actor, see
    rlsys.placement) and watches them (and the embedded server, if any)."""

    def __init__(self, config, start_role, server=None):
        self.config, self.start_role, self.server = config, start_role, server
        self.processes: dict = {}
        self.stop_deadline: float | None = None  # when the first stop of the running roles kills what still runs
        self.restarts: collections.Counter[str] = collections.Counter()  # name -> times restarted

    def start(self) -> None:
        cluster = self.config.cluster
        roles = [("inference", i) for i in range(cluster.n_inference_workers)]
        roles += [("rollout", i) for i in range(cluster.n_rollout_workers)]
        roles += [("learner", rank) for rank in range(cluster.n_learner_ranks)]
        self.stop_deadline = None
        self.processes = {(role, index): self.start_role(role, index) for role, index in roles}

    def watch(self, bus, report) -> None:
        """Returns when every rollout worker finished; restarts what died, or raises RoleFailed. `report()` runs
        every poll (progress lines, the stall check), its bus reads treated as the supervisor's own."""
        done_keys = [protocol.rollout_done(i) for i in range(self.config.cluster.n_rollout_workers)]
        while True:
            self.restart_dead_server()
            try:
                if all(bus.get(key) for key in done_keys):
                    return
                self.restart_dead_roles(bus)
                report()
            except redis.ConnectionError as e:
                if self.server is None:  # the bus already waited out a restart (rlsys.bus.redis_bus, RECONNECT_SECONDS)
                    raise RoleFailed(f"the run's Redis (cluster.redis_url) stopped answering: {e}") from None
                # Our server went down after the check above (SIGTERM, or shutting down): the next turn
                # restarts it once its process has exited. `bus` must not wait out restarts, or nobody would.
            time.sleep(POLL_SECONDS)

    def restart_dead_server(self) -> None:
        if self.server is not None and self.server.exited():
            why = process_exit(self.server.process.returncode)
            self.count_restart("redis-server", why)
            try:
                self.server.restart()
            except EmbeddedRedisError as e:  # the run cannot go on without it: stopped as any role that gave up
                raise RoleFailed(f"redis-server {why}, and could not be started again: {e}") from None

    def restart_dead_roles(self, bus) -> None:
        for (role, index), process in self.processes.items():
            if process.exitcode is None:
                continue
            if process.exitcode == 0 and (role != "rollout" or bus.get(protocol.rollout_done(index))):
                continue  # it finished its part: the learner, before the final eval; a rollout worker, once done
            # The code a role that cannot go on exits with, once it has said why; without a reason, code 3 is some
            # other exit (a plugin's sys.exit(3)), a death like any other
            reason = bus.get(protocol.role_stop_reason(process.name)) if process.exitcode == CANNOT_GO_ON_EXIT else None
            if reason:
                raise RoleFailed(f"{process.name} stopped the run: {reason}")
            # A rollout worker that exits 0 without saying it is done (a plugin's sys.exit()) left the run waiting
            # for it for ever, with no error: it died
            why = process.exit_reason if process.exitcode else "exited with code 0 before it was done"
            self.count_restart(process.name, why)
            if role == "learner":  # restarted with every role, by the launcher
                raise LearnerFailed(f"{process.name} {why}")
            if role == "inference":
                InferenceStatus(bus, index).mark_dead()
            if role == "rollout":  # it runs nothing now; the stall watch waits for its successor to say what it runs
                bus.delete(protocol.rollout_running(index))
            self.processes[(role, index)] = self.start_role(role, index)

    def count_restart(self, name: str, why: str) -> None:
        """Logs the restart and counts it; RoleFailed once `name` used up its restarts."""
        limit = self.config.cluster.max_role_restarts
        if self.restarts[name] >= limit:
            raise RoleFailed(f"{name} {why}, and was restarted {limit} times already (cluster.max_role_restarts)")
        self.restarts[name] += 1
        log.warning("%s %s; restarting it (restart %d of %d)", name, why, self.restarts[name], limit)

    def stop(self, bus) -> dict[str, str]:
        """`stop_processes` for the roles started last. Called again (a learner's restart stops them, then the part's
        end does: after a Ctrl-C that cut the first short, the roles told to stop still run), it waits only what is
        left of the first call's grace: the roles get one cluster.stop_grace_seconds, not one for each call."""
        grace = self.config.cluster.stop_grace_seconds
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + grace
        return stop_processes(bus, self.processes.values(), grace, self.stop_deadline)

    def kill(self) -> dict[str, str]:
        """Every role still running killed now, with no grace: a second Ctrl-C (or SIGTERM) during the stop, or a
        stop as the roles start. Returns how each role that did not end cleanly ended, as `stop` does."""
        return kill_the_rest(self.processes.values(), "was killed as the run was stopped at once (a second Ctrl-C or "
                             "SIGTERM during its stop, or one as its roles started)")


def stop_processes(bus, processes, grace: float, deadline: float | None = None) -> dict[str, str]:
    """Tells every role to stop (the learner finishes its step and saves a checkpoint), then kills what outlives
    `grace` seconds (cluster.stop_grace_seconds), or `deadline` (time.monotonic()'s) where an earlier stop of the same
    roles set it. Returns how each role that did not end cleanly ended, by its name: a role that crashes on its way out
    has finished its part, but what it left (its log's end, a checkpoint) deserves a look."""
    with contextlib.suppress(Exception):
        bus.set(protocol.STOP, 1)
    deadline = time.monotonic() + grace if deadline is None else deadline
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    return kill_the_rest(processes, f"was still running {grace:g} s after the stop, and was killed (a learner that "
                         "needs longer to finish its step and save: cluster.stop_grace_seconds)")


def kill_the_rest(processes, killed: str) -> dict[str, str]:
    """Kills what still runs of `processes`; returns how each that did not end cleanly ended, by its name (`killed`
    for those killed here)."""
    unclean = {}
    for p in processes:
        if p.is_alive():
            p.kill()
            unclean[p.name] = killed
        elif p.exitcode != 0:
            unclean[p.name] = p.exit_reason
    return unclean
