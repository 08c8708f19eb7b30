"""InProcessBus: the bus for tests and single-process runs, with exactly the Redis bus's semantics.

Every message is still msgpack-encoded on the way in and decoded on the way out, so a payload that
would fail over Redis fails here too, and readers never share mutable objects with writers.
"""

import collections
import dataclasses
import threading
import time
import uuid

from rlsys.bus.base import (Bus, BusError, Step, StreamEntry, check_integer, check_label, decode_or_undecodable,
                            decode_value, encode, encode_value, oversize)


@dataclasses.dataclass
class _Pending:
    consumer: str
    delivered_at: float  # time.monotonic() of the last delivery
    deliveries: int


@dataclasses.dataclass
class _Group:
    last_delivered: tuple[int, int] = (0, 0)
    pending: dict[str, _Pending] = dataclasses.field(default_factory=dict)  # entry id -> who holds it


@dataclasses.dataclass
class _Stream:
    entries: dict[str, bytes] = dataclasses.field(default_factory=dict)  # entry id -> payload, in id order
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # entry id -> its label, where it has one
    last_id: tuple[int, int] = (0, 0)
    groups: dict[str, _Group] = dataclasses.field(default_factory=dict)

    def next_id(self) -> str:
        """Redis's scheme: milliseconds of the clock, and a sequence number when the clock did not move."""
        ms = int(time.time() * 1000)
        self.last_id = (ms, 0) if ms > self.last_id[0] else (self.last_id[0], self.last_id[1] + 1)
        return _format_id(self.last_id)


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _format_id(parts: tuple[int, int]) -> str:
    return f"{parts[0]}-{parts[1]}"


def _entry(s: _Stream, entry_id: str, deliveries: int, max_bytes: int | None) -> StreamEntry:
    payload, label = s.entries[entry_id], s.labels.get(entry_id, "")
    if too_large := oversize(len(payload), max_bytes):
        return StreamEntry(entry_id, b"", deliveries, too_large, len(payload), label)
    return StreamEntry(entry_id, payload, deliveries, label=label)


class InProcessBus(Bus):
    """Queues, keys, sets and streams in memory, guarded by one lock; a Condition wakes blocked readers."""

    _registry: dict[str, "InProcessBus"] = {}
    _registry_lock = threading.Lock()

    def __init__(self):
        self._cond = threading.Condition()
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._values: dict[str, bytes] = {}
        self._sets: dict[str, set[str]] = collections.defaultdict(set)
        self._streams: dict[str, _Stream] = collections.defaultdict(_Stream)
        self._id = uuid.uuid4().hex

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

    def get_many(self, queue: str, max_count: int, timeout: float, max_bytes: int | None = None) -> list:
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
        return [decode_or_undecodable(m, f"queue {queue}", max_bytes) for m in taken]

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

    def get_keys(self, keys: list[str], default=None) -> list:
        return self._values_of(keys, default)

    def _values_of(self, keys: list[str], default) -> list:
        """get_keys's reading, which server_id_and_keys shares: on Redis that is one script, not a get_keys, and a
        test's bus that counts the get_keys calls a role makes (a pass of the train loop, a refresh) must not count
        it."""
        with self._cond:
            values = [self._values.get(key) for key in keys]
        return [default if data is None else decode_value(data, key) for key, data in zip(keys, values)]

    def incr(self, key: str, amount: int = 1) -> int:
        check_integer(amount, f"incr of key {key!r}: the amount")
        with self._cond:
            return self._incr(key, amount)

    def _incr(self, key: str, amount: int) -> int:
        current = self._integer(key)
        self._values[key] = str(current + amount).encode()
        return current + amount

    def _integer(self, key: str) -> int:
        current = decode_value(self._values.get(key, b"0"), key)
        if not isinstance(current, int):
            raise BusError(f"key {key!r} does not hold an integer; cannot incr it")
        return current

    def delete(self, *keys: str) -> None:
        with self._cond:
            for key in keys:
                self._queues.pop(key, None)
                self._values.pop(key, None)
                self._sets.pop(key, None)
                self._streams.pop(key, None)

    def change(self, steps: list[Step]) -> Step | None:
        payloads = {i: encode(step.arg, f"stream {step.key}") for i, step in enumerate(steps) if step.op == "append"}
        with self._cond:
            increments = collections.Counter()
            for step in steps:  # first: a key that is not an integer changes nothing, as in Redis
                if step.op in ("incr", "at_most"):
                    self._integer(step.key)
                if step.op == "incr":
                    increments[step.key] += step.arg
            for step in steps:
                if step.op == "absent" and step.arg in self._sets.get(step.key, ()):
                    return step
                if step.op == "present" and step.arg not in self._sets.get(step.key, ()):
                    return step
                if step.op == "at_most" and self._integer(step.key) + increments[step.key] > step.arg:
                    return step
            for i, step in enumerate(steps):
                if step.op == "incr":
                    self._incr(step.key, step.arg)
                elif step.op == "add":
                    self._sets[step.key].add(step.arg)
                elif step.op == "remove":
                    self._sets[step.key].discard(step.arg)
                elif step.op == "append":
                    self._append(step.key, payloads[i], step.label)
            self._cond.notify_all()
            return None

    def set_size(self, key: str) -> int:
        with self._cond:
            return len(self._sets.get(key, ()))

    def set_members(self, key: str) -> list[str]:
        with self._cond:
            return sorted(self._sets.get(key, ()))

    def stream_add(self, stream: str, message, label: str = "") -> str:
        check_label(label, stream)
        payload = encode(message, f"stream {stream}")
        with self._cond:
            entry_id = self._append(stream, payload, label)
            self._cond.notify_all()
            return entry_id

    def _append(self, stream: str, payload: bytes, label: str) -> str:
        s = self._streams[stream]
        entry_id = s.next_id()
        s.entries[entry_id] = payload
        if label:
            s.labels[entry_id] = label
        return entry_id

    def stream_read(self, stream: str, group: str, consumer: str, max_count: int, timeout: float,
                    max_bytes: int | None = None) -> list[StreamEntry]:
        if max_count <= 0:
            return []
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                s = self._streams[stream]
                g = s.groups.setdefault(group, _Group())
                fresh = [i for i in s.entries if _parse_id(i) > g.last_delivered][:max_count]
                if fresh:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)
            g.last_delivered = _parse_id(fresh[-1])
            now = time.monotonic()
            for i in fresh:
                g.pending[i] = _Pending(consumer, now, 1)
            return [_entry(s, i, 1, max_bytes) for i in fresh]

    def stream_claim(self, stream: str, group: str, consumer: str, min_idle: float,
                     max_count: int, max_bytes: int | None = None, counted: bool = True) -> list[StreamEntry]:
        with self._cond:
            s = self._streams[stream]
            g = s.groups.setdefault(group, _Group())
            now = time.monotonic()
            claimed = []
            for entry_id, p in list(g.pending.items()):
                if len(claimed) >= max_count:
                    break
                if p.consumer == consumer or now - p.delivered_at < min_idle:
                    continue
                if entry_id not in s.entries:  # deleted while pending: nothing left to deliver
                    del g.pending[entry_id]
                    continue
                p.consumer, p.delivered_at, p.deliveries = consumer, now, p.deliveries + (1 if counted else 0)
                claimed.append(_entry(s, entry_id, p.deliveries, max_bytes))
            return claimed

    def stream_ack(self, stream: str, group: str, ids: list[str]) -> int:
        with self._cond:
            s = self._streams[stream]
            g = s.groups.setdefault(group, _Group())
            acked = 0
            for entry_id in ids:
                acked += g.pending.pop(entry_id, None) is not None
                s.entries.pop(entry_id, None)
                s.labels.pop(entry_id, None)
            return acked

    def stream_pending(self, stream: str, group: str) -> int:
        with self._cond:
            g = self._streams[stream].groups.get(group)
            return len(g.pending) if g else 0

    def stream_length(self, stream: str) -> int:
        with self._cond:
            return len(self._streams[stream].entries)

    def stream_range(self, stream: str, max_count: int) -> list[StreamEntry]:
        if max_count <= 0:  # as get_many and stream_read; a slice to -1 would take all but the newest
            return []
        with self._cond:
            s = self._streams[stream]
            return [_entry(s, i, 0, None) for i in list(s.entries)[:max_count]]

    def stream_delete(self, stream: str, ids: list[str]) -> int:
        with self._cond:
            s = self._streams[stream]
            for entry_id in ids:
                s.labels.pop(entry_id, None)
            return sum(s.entries.pop(entry_id, None) is not None for entry_id in ids)

    def server_id_and_keys(self, keys: list[str], default=None) -> tuple[str, list]:
        return self._id, self._values_of(keys, default)  # the id lives and dies with this process: it never restarts

    def close(self) -> None:
        """Nothing to release: the bus is shared by everyone in the process who connected to its name."""
