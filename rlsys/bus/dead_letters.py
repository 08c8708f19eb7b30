"""Queue messages a role could not use (generation requests and replies, bad or undecodable): kept with the
reason in one stream, so the role goes on and a person can see what was refused and why.

Trajectory messages have their own dead letters (rlsys.delivery), which also settle the prompt they carried.
"""

import logging
from collections.abc import Callable
from typing import TypeVar

from rlsys.api.messages import InvalidMessage
from rlsys.bus.base import Undecodable, encode
from rlsys.protocol import DEAD_MESSAGES

log = logging.getLogger(__name__)

HEAD_BYTES = 4096  # the start of the message kept for inspection
T = TypeVar("T")


def set_aside(bus, source: str, reason: str, message) -> None:
    """Records `message` (decoded, or Undecodable) read from `source` as refused for `reason`; never raises
    for the message itself, so a role can call it on anything it read."""
    if isinstance(message, Undecodable):
        head, size = message.head, message.size
    else:
        try:
            data = encode(message, source)
        except TypeError:  # decoded msgpack always encodes again; this only guards the role
            data = repr(message)[:HEAD_BYTES].encode()
        head, size = data[:HEAD_BYTES], len(data)
    try:
        bus.stream_add(DEAD_MESSAGES, {"source": source, "reason": reason, "size": size, "head": head})
    except Exception:  # the bus itself failing is the caller's problem on its next call; the role lives on
        log.warning("could not record a refused message from %s", source, exc_info=True)
    log.warning("message from %s set aside in %s: %s", source, DEAD_MESSAGES, reason)


def read_beat(bus, key: str, parse: Callable[[object], T]) -> T | None:
    """The message at `key`, which a role rewrites at each of its beats, parsed (`parse_beat`)."""
    return parse_beat(bus, key, bus.get(key), parse)


def parse_beat(bus, key: str, message, parse: Callable[[object], T]) -> T | None:
    """`message`, read from `key`, which a role rewrites at each of its beats, parsed; None if there is none, or it is
    malformed: set aside with its reason and deleted, so that the role's next beat writes a good one."""
    if message is None:
        return None
    try:
        return parse(message)
    except InvalidMessage as e:
        set_aside(bus, key, str(e), message)
        bus.delete(key)
        return None
