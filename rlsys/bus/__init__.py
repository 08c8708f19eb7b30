"""The message bus joining a run's role processes: queues and keys, msgpack payloads, Redis or in-process.

`connect(url)` chooses the implementation here, above them, so that the contract (rlsys.bus.base) imports
none of the buses built on it.
"""

from rlsys.bus.base import (Bus, BusDecodeError, BusEncodeError, BusError, ServerRestarts, Step, StreamEntry,
                            Undecodable)
from rlsys.bus.inproc import InProcessBus
from rlsys.bus.redis_bus import RedisBus
from rlsys.bus.redis_server import EmbeddedRedis, EmbeddedRedisError, raise_on_sigterm

__all__ = ["Bus", "BusDecodeError", "BusEncodeError", "BusError", "ServerRestarts", "Step", "StreamEntry",
           "Undecodable", "connect", "InProcessBus", "RedisBus", "EmbeddedRedis", "EmbeddedRedisError",
           "raise_on_sigterm"]


def connect(url: str, wait_out_restarts: bool = True) -> Bus:
    """The bus at `url`: "inproc://NAME" (one shared object per NAME in this process) or "redis://...".

    A Redis URL may carry `?namespace=NAME` to prefix every key, so several runs can share one server.
    Commands wait out a restarting Redis unless `wait_out_restarts=False` (for the server's own keeper, who
    restarts it and so must not wait for it).
    """
    if url.startswith("inproc://"):
        return InProcessBus.named(url[len("inproc://"):])
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisBus.from_url(url, wait_out_restarts=wait_out_restarts)
    raise ValueError(f"unsupported bus url {url!r}: expected inproc://NAME or redis://[:PASSWORD@]HOST:PORT/DB")
