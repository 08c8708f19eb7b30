"""The endpoint's HTTP/1.1 connections: uvicorn's h11 protocol with the bounds a server every local user reaches needs.

uvicorn bounds how long a connection idles between requests (its keep-alive timeout), but neither how long a request
takes to arrive nor how many connections are open. A client that opens connections and never finishes a request
holds a descriptor for each, forever, and a rollout worker out of descriptors loses its bus connection and cannot
open a weight file. So here:

- a request (its line, headers and body) must arrive whole within REQUEST_READ_SECONDS of its first byte, or of the
  connection's opening for the first one, or the connection is closed; more bytes do not restart the clock, so a
  client that trickles a byte a second is closed too. The time the model takes to answer is not counted;
- a connection beyond `connection_cap()` is answered 503 as it opens and closed, so the endpoint never holds more
  than its share of the process's descriptors. The `openai` client retries a 503.
"""

import asyncio
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_READ_SECONDS = 30.0  # a local client sends a request in milliseconds; this bounds a stalled one
RESERVED_DESCRIPTORS = 256  # kept for everything else the process opens: the bus, weight files, the engine, logs
DESCRIPTORS_WANTED = 65536  # the soft limit asked for where the hard one is unlimited
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"


def raise_descriptor_limit() -> int:
    """Raises this process's soft limit on open descriptors to its hard limit (usually far higher) and returns it:
    under the usual soft limit of 1024 the connection cap would be 384, and every call an episode has in flight
    holds a connection (the openai-agent experiment allows 64 episodes of 8 runs at once)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else DESCRIPTORS_WANTED
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel allows (nr_open): keep the soft one
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(descriptors: int) -> int:
    """Connections the server keeps open at once: half of what the process may open beyond RESERVED_DESCRIPTORS,
    since the agents' clients in the same process hold the other end of each."""
    return max(16, (descriptors - RESERVED_DESCRIPTORS) // 2)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's arrival and a cap on open connections."""

    max_connections = 1024  # set per server by `bounded_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.read_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(BUSY)
            transport.close()
            return
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # bytes of a request that has not all arrived
            self._arm_read_deadline()
        else:  # the request is in (DONE), or the client is done with the connection
            self._disarm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        if self.read_deadline is None:
            self.read_deadline = self.loop.call_later(REQUEST_READ_SECONDS, self._request_too_slow)

    def _disarm_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _request_too_slow(self) -> None:
        self.read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class for one server, with its connection cap."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"max_connections": max_connections})
