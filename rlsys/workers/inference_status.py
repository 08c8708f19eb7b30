"""An inference worker's status key: the one owner of what routers know about a worker's life.

The worker publishes its status on every heartbeat. The launcher's supervisor marks it dead the moment it
sees the worker's process exit, so routers re-send that worker's requests at once instead of waiting
`cluster.inference_dead_after` seconds for a missed beat. The missed beat still counts, for workers on
other machines that no launcher watches. A restarted worker publishes a new epoch, which clears the mark.
"""

import logging

from rlsys import protocol
from rlsys.api.messages import WorkerStatus, parse_worker_status
from rlsys.bus.dead_letters import parse_beat

log = logging.getLogger(__name__)


class InferenceStatus:
    """Reads and writes protocol.inference_status(index)."""

    def __init__(self, bus, index: int):
        self.bus, self.key = bus, protocol.inference_status(index)

    def publish(self, status: WorkerStatus) -> None:
        self.bus.set(self.key, status.to_message())

    def read(self) -> WorkerStatus | None:
        """The status, or None if there is none yet or it is malformed (set aside with its reason)."""
        return self.parsed(self.bus.get(self.key))

    def parsed(self, message) -> WorkerStatus | None:
        """`message`, read from this key, as `read` gives it."""
        return parse_beat(self.bus, self.key, message, parse_worker_status)

    def mark_dead(self) -> None:
        """The process serving the epoch now published has exited (its successor has not started yet)."""
        status = self.read()
        if status is not None and not status.dead:
            self.publish(WorkerStatus(status.epoch, status.beat, status.version, 0, dead=True,
                                     weights_streamed=status.weights_streamed))


def read_statuses(bus, statuses: list[InferenceStatus]) -> list[WorkerStatus | None]:
    """Each of `statuses` as its `read` gives it, all read in one round trip (a router reads them every 50 ms)."""
    messages = bus.get_keys([status.key for status in statuses])
    return [status.parsed(message) for status, message in zip(statuses, messages)]
