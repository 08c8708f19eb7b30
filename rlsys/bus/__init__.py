"""The message bus joining a run's role processes: queues and keys, msgpack payloads, Redis or in-process."""

from rlsys.bus.base import (Bus, BusDecodeError, BusEncodeError, BusError, ServerRestarts, StreamEntry, Undecodable,
                            connect)
from rlsys.bus.inproc import InProcessBus
from rlsys.bus.redis_bus import RedisBus
from rlsys.bus.redis_server import EmbeddedRedis, EmbeddedRedisError, raise_on_sigterm

__all__ = ["Bus", "BusDecodeError", "BusEncodeError", "BusError", "ServerRestarts", "StreamEntry", "Undecodable", "connect",
           "InProcessBus", "RedisBus", "EmbeddedRedis", "EmbeddedRedisError", "raise_on_sigterm"]
