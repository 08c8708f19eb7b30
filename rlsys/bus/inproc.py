"""InProcessBus: the bus for tests and single-process runs, with exactly the Redis bus's semantics.

Every message is still msgpack-encoded on the way in and decoded on the way out, so a payload that
would fail over Redis fails here too, and readers never share mutable objects with writers.
"""

import collections
import threading
import time

from rlsys.bus.base import Bus, BusError, decode, decode_value, encode, encode_value


class InProcessBus(Bus):
    """Queues and keys in memory, guarded by one lock; a Condition wakes blocked `get_many` callers."""

    _registry: dict[str, "InProcessBus"] = {}
    _registry_lock = threading.Lock()

    def __init__(self):
        self._cond = threading.Condition()
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._values: dict[str, bytes] = {}

    @classmethod
    def named(cls, name: str) -> "InProcessBus":
        """The bus registered under `name` in this process, created on first use (what connect() returns)."""
        with cls._registry_lock:
            if name not in cls._registry:
                cls._registry[name] = cls()
            return cls._registry[name]

    def put(self, queue: str, message) -> None:
        self.put_many(queue, [message])

    def put_many(self, queue: str, messages: list) -> None:
        encoded = [encode(m, f"queue {queue}") for m in messages]  # all or nothing, like one RPUSH
        if not encoded:
            return
        with self._cond:
            self._queues[queue].extend(encoded)
            self._cond.notify_all()

    def get_many(self, queue: str, max_count: int, timeout: float) -> list:
        if max_count <= 0:
            return []
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            items = self._queues[queue]
            while not items:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)
            taken = [items.popleft() for _ in range(min(max_count, len(items)))]
        return [decode(m, f"queue {queue}") for m in taken]

    def qsize(self, queue: str) -> int:
        with self._cond:
            return len(self._queues.get(queue, ()))

    def set(self, key: str, value) -> None:
        data = encode_value(value, key)
        with self._cond:
            self._values[key] = data

    def get(self, key: str, default=None):
        with self._cond:
            data = self._values.get(key)
        return default if data is None else decode_value(data, key)

    def incr(self, key: str, amount: int = 1) -> int:
        with self._cond:
            current = decode_value(self._values.get(key, b"0"), key)
            if not isinstance(current, int):
                raise BusError(f"key {key!r} does not hold an integer; cannot incr it")
            self._values[key] = str(current + amount).encode()
            return current + amount

    def delete(self, *keys: str) -> None:
        with self._cond:
            for key in keys:
                self._queues.pop(key, None)
                self._values.pop(key, None)

    def close(self) -> None:
        """Nothing to release: the bus is shared by everyone in the process who connected to its name."""
