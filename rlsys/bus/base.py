"""The message-bus contract every role codes against, and the one wire format (msgpack) all buses share.

Roles are separate processes; the bus is the only thing they share. Keeping the interface small and
synchronous lets the same role code run over an in-process bus (tests, single process) or Redis
(real runs); asyncio callers wrap calls in `asyncio.to_thread`. Payloads are msgpack, never pickle:
a bus message must never be able to run code in the process that reads it.
"""

import abc
import dataclasses
import re

import msgpack


class BusError(Exception):
    """Base class of the bus's own errors."""


class BusEncodeError(BusError, TypeError):
    """A value cannot be sent: it is not msgpack-serializable (only dict/list/str/int/float/bytes/bool/None)."""


class BusDecodeError(BusError, ValueError):
    """Bytes read from the bus are not a valid message; someone other than a Bus wrote them."""


def encode(value, where: str) -> bytes:
    """msgpack bytes of `value`; `where` names the queue/key in the error."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise BusEncodeError(f"cannot send {type(value).__name__} on {where!r}: not msgpack-serializable ({e})") from e


def decode(data: bytes, where: str):
    """The value msgpack-encoded in `data`; a clear BusDecodeError naming `where` for anything else."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, UnicodeDecodeError...)
        if unholdable := _unholdable_key(data):
            raise BusDecodeError(f"undecodable message on {where!r}: {unholdable}") from e
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise BusDecodeError(f"undecodable message on {where!r}, not msgpack written by a Bus ({reason}); "
                             f"first bytes {bytes(data[:16])!r}") from e


class _Pairs(list):
    """A map as `_unholdable_key` reads it: its (key, value) pairs, no key hashed."""


def _unholdable_key(data: bytes) -> str | None:
    """Which map of `data` has a key no reader can hold (an array or a map), or None.

    encode sends any key msgpack packs, a tuple too (as an array, which decodes into a list), and checking every
    message's keys on the writer's side costs several times the encoding. So the reader, once a message fails,
    reads it again keeping maps as pairs, and names the writer's bug."""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=_Pairs)
    except Exception:  # not msgpack at all: the caller's reason stands
        return None
    stack = [(value, "")]
    while stack:  # depth first in the message's order, without recursion (msgpack nests up to its own limit)
        value, path = stack.pop()
        if isinstance(value, _Pairs):
            for key, _ in value:
                if isinstance(key, list):
                    kind = "a map" if isinstance(key, _Pairs) else "an array"
                    return (f"the map at {path or 'the top'} has a key that is {kind}, which no reader can hold as a "
                            "key (a tuple key is sent as an array); keys must be strings, numbers, booleans, None "
                            "or bytes")
            stack.extend(reversed([(v, f"{path}[{k!r:.40}]") for k, v in value]))
        elif isinstance(value, list):
            stack.extend(reversed([(v, f"{path}[{i}]") for i, v in enumerate(value)]))
    return None


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A queue message that is not msgpack written by a Bus, or over the reader's size limit. get_many hands
    it to the reader in its place instead of raising, so the good messages taken with it are not lost and
    the reader can set it aside with `reason`."""

    reason: str
    head: bytes  # the first bytes, for inspection
    size: int


def oversize(size: int, max_bytes: int | None) -> str | None:
    """Why a payload of `size` bytes is refused unread, or None."""
    if max_bytes is not None and size > max_bytes:
        return f"message of {size / 2**20:.1f} MiB exceeds the limit of {max_bytes / 2**20:.1f} MiB"
    return None


def decode_or_undecodable(data: bytes, where: str, max_bytes: int | None = None):
    """The decoded message, or Undecodable (too large: not decoded at all)."""
    if too_large := oversize(len(data), max_bytes):
        return Undecodable(f"{too_large} on {where!r}", bytes(data[:64]), len(data))
    try:
        return decode(data, where)
    except BusDecodeError as e:
        return Undecodable(str(e), bytes(data[:64]), len(data))


# Keys hold counters too: Redis INCR needs the value stored as decimal text, so integer values of keys are
# stored that way and everything else as msgpack. This is unambiguous: the only msgpack encodings made of
# ASCII digits are the single bytes b"0".."9" (ints 48..57), which `encode_value` never produces.
_DECIMAL = re.compile(rb"-?[0-9]+")


def encode_value(value, key: str) -> bytes:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    return encode(value, f"key {key}")


def decode_value(data: bytes, key: str):
    if _DECIMAL.fullmatch(data):
        return int(data)
    return decode(data, f"key {key}")


def check_integer(value, what: str) -> None:
    """TypeError unless `value` is an int: Redis counts only in integers (INCRBY refuses 1.5, redis-py refuses True),
    and the in-process bus, which would add anything, must refuse what Redis refuses or tests pass that real runs
    fail."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r:.80}")


@dataclasses.dataclass(frozen=True)
class StreamEntry:
    """One stream message as a consumer group delivered it: raw bytes, so a bad one can be set aside whole."""

    id: str  # the stream's id for it, "<ms>-<seq>", increasing
    payload: bytes  # the msgpack bytes as stored (b"" where `problem` says why they were not fetched)
    deliveries: int  # times the group has handed it to a consumer, this one included (see stream_claim); 0 from range
    problem: str | None = None  # the entry has no payload field, or it is over the reader's max_bytes
    stored_size: int | None = None  # the size of a payload that was not fetched
    label: str = ""  # what its writer labelled it with (stream_add), read even where the payload is not

    @property
    def size(self) -> int:
        return len(self.payload) if self.stored_size is None else self.stored_size

    def decode(self, stream: str):
        if self.problem:
            raise BusDecodeError(f"stream {stream} entry {self.id}: {self.problem}")
        return decode(self.payload, f"stream {stream} entry {self.id}")


LABEL_MAX_BYTES = 256  # a stream entry's label is read even where its payload is too large to be: it stays small


def check_label(label, stream: str) -> None:
    """TypeError unless `label` is a str of at most LABEL_MAX_BYTES bytes in UTF-8."""
    if not isinstance(label, str) or len(label.encode()) > LABEL_MAX_BYTES:
        raise TypeError(f"the label of an entry of stream {stream!r} must be a str of at most {LABEL_MAX_BYTES} bytes, "
                        f"got {type(label).__name__} {label!r:.80}")


@dataclasses.dataclass(frozen=True)
class Step:
    """One part of an atomic `Bus.change`: a guard, which must hold, or a write. Build them with the class methods."""

    op: str  # a guard (absent, present, at_most) or a write (incr, add, remove, append)
    key: str
    arg: object = None  # the member, the amount, the limit or the message
    label: str = ""  # an append's label (Bus.stream_add)

    def __post_init__(self):
        # Set members are strings: Redis would store 5 and "5" as the same member, and b"x" as "x", where a Python
        # set keeps them apart; refused here, both buses behave alike.
        if self.op in ("absent", "present", "add", "remove") and not isinstance(self.arg, str):
            raise TypeError(f"{self.op} on set {self.key!r}: the member must be a str, got "
                            f"{type(self.arg).__name__} {self.arg!r:.80}")
        if self.op == "incr":
            check_integer(self.arg, f"incr on key {self.key!r}: the amount")
        if self.op == "append":
            check_label(self.label, self.key)

    @classmethod
    def absent(cls, key: str, member: str) -> "Step":
        """Guard: `member` is not in the set under `key`."""
        return cls("absent", key, member)

    @classmethod
    def present(cls, key: str, member: str) -> "Step":
        """Guard: `member` is in the set under `key`."""
        return cls("present", key, member)

    @classmethod
    def at_most(cls, key: str, limit: int) -> "Step":
        """Guard: the integer under `key`, this change's increments of it included, is at most `limit`."""
        return cls("at_most", key, limit)

    @classmethod
    def incr(cls, key: str, amount: int = 1) -> "Step":
        """Write: add `amount` to the integer under `key` (unset counts as 0)."""
        return cls("incr", key, amount)

    @classmethod
    def add(cls, key: str, member: str) -> "Step":
        """Write: add `member` to the set under `key`."""
        return cls("add", key, member)

    @classmethod
    def remove(cls, key: str, member: str) -> "Step":
        """Write: remove `member` from the set under `key`."""
        return cls("remove", key, member)

    @classmethod
    def append(cls, stream: str, message, label: str = "") -> "Step":
        """Write: append `message` to `stream`, labelled with `label` (Bus.stream_add)."""
        return cls("append", stream, message, label)


class Bus(abc.ABC):
    """FIFO queues, a key/value store with atomic counters, sets of strings, and streams read by consumer
    groups with acknowledgement. Sync and thread-safe.

    Messages and values are msgpack-serializable Python values; tuples come back as lists, so a tuple map key
    cannot be read back: the reader's BusDecodeError (or Undecodable) names the map that holds it.

    Streams give at-least-once delivery: an entry read by a consumer stays pending until acknowledged,
    and if that consumer dies another one can claim it. Each stream here has one consumer group, so an
    acknowledged entry is deleted: a stream only ever holds what is unread or unacknowledged.
    """

    @abc.abstractmethod
    def put(self, queue: str, message) -> None:
        """Append one message to the tail of `queue`."""

    @abc.abstractmethod
    def put_many(self, queue: str, messages: list) -> None:
        """Append messages, in order, to the tail of `queue` (one round trip)."""

    @abc.abstractmethod
    def get_many(self, queue: str, max_count: int, timeout: float, max_bytes: int | None = None) -> list:
        """Wait up to `timeout` s for one message, then also take up to `max_count` - 1 more already there.

        Returns [] on timeout; never waits for a second message. `timeout` <= 0 means do not wait. A message
        that cannot be decoded, or is over `max_bytes`, comes back as an Undecodable in its place.
        """

    @abc.abstractmethod
    def qsize(self, queue: str) -> int:
        """Number of messages waiting in `queue`."""

    @abc.abstractmethod
    def set(self, key: str, value) -> None:
        """Store `value` under `key`, replacing what was there."""

    @abc.abstractmethod
    def get(self, key: str, default=None):
        """The value under `key` (an int for counters), or `default` if unset."""

    @abc.abstractmethod
    def get_keys(self, keys: list[str], default=None) -> list:
        """The values under `keys`, in their order, each as `get` gives it, all read in one step (one round trip).
        A key that holds no value (unset, or a queue, set or stream) gives `default`."""

    @abc.abstractmethod
    def incr(self, key: str, amount: int = 1) -> int:
        """Atomically add `amount` to the integer under `key` (unset counts as 0); returns the new value."""

    @abc.abstractmethod
    def delete(self, *keys: str) -> None:
        """Remove keys or queues; missing ones are ignored."""

    @abc.abstractmethod
    def change(self, steps: list[Step]) -> Step | None:
        """All of `steps` in one atomic step: if every guard holds, every write is made, in order, and None is
        returned; otherwise nothing changes and the first guard that does not hold is returned. So a process that
        dies between two of a change's writes cannot leave one made without the other, and of several callers
        whose guards exclude each other exactly one changes anything. BusError, and nothing changed, if a key
        that a step counts holds something other than an integer."""

    @abc.abstractmethod
    def set_size(self, key: str) -> int:
        """Number of members of the set under `key` (0 if unset)."""

    @abc.abstractmethod
    def set_members(self, key: str) -> list[str]:
        """The members of the set under `key`, sorted; [] if it is unset."""

    @abc.abstractmethod
    def stream_add(self, stream: str, message, label: str = "") -> str:
        """Append `message` to `stream`; returns its entry id. Nothing is ever trimmed by adding.

        `label` (at most LABEL_MAX_BYTES) is stored beside the payload and comes back as the entry's `label` even
        where the payload is over the reader's limit or undecodable: a reader that must settle what an entry stood
        for (the learner, a group's prompt) still knows what."""

    @abc.abstractmethod
    def stream_read(self, stream: str, group: str, consumer: str, max_count: int, timeout: float,
                    max_bytes: int | None = None) -> list[StreamEntry]:
        """Entries of `stream` that `group` has not handed out yet, now pending for `consumer` until acked.

        The group is created on first use, at the start of the stream. Waits like get_many: up to
        `timeout` s for the first entry, then takes up to `max_count` - 1 more already there. A payload
        over `max_bytes` is measured where it is stored and not fetched: its entry comes with a `problem`.
        """

    @abc.abstractmethod
    def stream_claim(self, stream: str, group: str, consumer: str, min_idle: float,
                     max_count: int, max_bytes: int | None = None, counted: bool = True) -> list[StreamEntry]:
        """Take over up to `max_count` entries pending with *other* consumers of `group` for at least
        `min_idle` s (their consumer died or stalls); their delivery count goes up by one. `max_bytes`
        as in stream_read. `counted=False`: the counts stay as they are, for a reader taking back what a server
        restart or a lost reply kept from it, which is no delivery that failed."""

    @abc.abstractmethod
    def stream_ack(self, stream: str, group: str, ids: list[str]) -> int:
        """Acknowledge entries and delete them from the stream; returns how many were pending."""

    @abc.abstractmethod
    def stream_pending(self, stream: str, group: str) -> int:
        """Entries of `stream` handed to consumers of `group` and not acknowledged yet."""

    @abc.abstractmethod
    def stream_length(self, stream: str) -> int:
        """Entries in `stream`: unread plus pending."""

    @abc.abstractmethod
    def stream_range(self, stream: str, max_count: int) -> list[StreamEntry]:
        """The oldest `max_count` entries, for inspection (e.g. of a dead-letter stream); reads nothing."""

    @abc.abstractmethod
    def stream_delete(self, stream: str, ids: list[str]) -> int:
        """Deletes entries from `stream` (a resume drops the dead letters of the steps it abandoned); returns how many
        were there."""

    def server_id(self) -> str:
        """Changes whenever the server behind the bus restarts (see ServerRestarts)."""
        return self.server_id_and_keys([])[0]

    @abc.abstractmethod
    def server_id_and_keys(self, keys: list[str], default=None) -> tuple[str, list]:
        """(`server_id`, the values under `keys` as `get_keys` gives them), all read in one step (one round trip): a
        reader that asks before each read whether the server restarted learns whether to go on in the same trip."""

    def close(self) -> None:
        """Release connections. The bus must not be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServerRestarts:
    """Notices that the server behind a bus restarted.

    A client retries a command the dying server ran but never answered: a message being pushed arrives
    twice, and one being popped or read from a stream is gone from the server without reaching its reader.
    So whoever waits for an answer sends again what is unanswered, and receivers drop copies.
    """

    def __init__(self, bus: Bus):
        self.bus = bus
        self.server = bus.server_id()

    def happened(self) -> bool:
        """True once after each restart since the last call (or `happened_reading`'s)."""
        return self.happened_reading([])[0]

    def happened_reading(self, keys: list[str]) -> tuple[bool, list]:
        """(`happened`, the values under `keys`, None where unset), in one round trip."""
        server, values = self.bus.server_id_and_keys(keys)
        restarted, self.server = server != self.server, server
        return restarted, values
