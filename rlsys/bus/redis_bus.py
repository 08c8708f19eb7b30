"""RedisBus: the bus between processes (and machines), on redis-py's sync client.

Queues are Redis lists (RPUSH / BLPOP / LPOP count), keys are strings, counters use INCRBY, sets are
sets, and streams are Redis streams with one consumer group each (XADD / XREADGROUP / XCLAIM / XACK).
One redis-py client with its connection pool is thread-safe, so one RedisBus serves every thread of a role.
"""

import time
import urllib.parse

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from rlsys.bus.base import (LABEL_MAX_BYTES, Bus, BusError, Step, StreamEntry, check_integer, check_label,
                            decode_or_undecodable, decode_value, encode, encode_value, oversize)

# A blocking command must return before the socket times out, or redis-py drops the connection while
# the server may already have popped a message for it (lost). Long waits are therefore cut into slices.
SOCKET_TIMEOUT = 30.0
MAX_BLOCK = 10.0
PAYLOAD = b"m"  # the field of a stream entry that holds its msgpack payload
LABEL = b"l"  # and the one that holds its label, where it has one (Bus.stream_add)
PENDING_PAGE = 100
RECONNECT_SECONDS = 60.0  # how long roles keep retrying while Redis restarts
RECONNECT_BACKOFF_CAP = 1.0

# Bus.change: KEYS[i] is step i's key, ARGV[3i-2], ARGV[3i-1] and ARGV[3i] its op, arg and label. Guards are
# checked before any write, and so are the keys that steps count: a script that fails keeps the writes it made.
# Returns the index of the first guard that does not hold, or 0 when every write was made.
_CHANGE = """
local function integer(key)
  local value = redis.call('GET', key)
  if value and not string.match(value, '^-?%d+$') then
    return redis.error_reply('key ' .. key .. ' does not hold an integer')
  end
  return tonumber(value or '0')
end
local increments = {}
for i, key in ipairs(KEYS) do
  local op = ARGV[3 * i - 2]
  if op == 'incr' or op == 'at_most' then
    local value = integer(key)
    if type(value) == 'table' then return value end
    if op == 'incr' then increments[key] = (increments[key] or 0) + tonumber(ARGV[3 * i - 1]) end
  end
end
for i, key in ipairs(KEYS) do
  local op, arg = ARGV[3 * i - 2], ARGV[3 * i - 1]
  if op == 'absent' and redis.call('SISMEMBER', key, arg) == 1 then return i end
  if op == 'present' and redis.call('SISMEMBER', key, arg) == 0 then return i end
  if op == 'at_most' and integer(key) + (increments[key] or 0) > tonumber(arg) then return i end
end
for i, key in ipairs(KEYS) do
  local op, arg, label = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  if op == 'incr' then redis.call('INCRBY', key, arg)
  elseif op == 'add' then redis.call('SADD', key, arg)
  elseif op == 'remove' then redis.call('SREM', key, arg)
  elseif op == 'append' and label == '' then redis.call('XADD', key, '*', 'm', arg)
  elseif op == 'append' then redis.call('XADD', key, '*', 'm', arg, 'l', label) end
end
return 0
"""


# XREADGROUP (no BLOCK: not allowed in scripts) or XCLAIM, with each payload measured on the server: one over
# the reader's limit, or missing, is not sent back, only its size. Per entry: {id, status, size, payload, label,
# deliveries}, the label '' where the entry has none or one over LABEL_MAX_BYTES (a foreign writer's: the limit holds
# for it too). A claim (ARGV[5] the minimum idle time, ARGV[6] COUNTED or KEPT, then the ids) reads each entry's
# delivery count as it claims it: XCLAIM adds one to it, or with RETRYCOUNT sets it where it was (Bus.stream_claim).
_FETCH_ENTRIES = """
local entries, deliveries = {}, {}
if ARGV[1] == 'READ' then
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[5], 'STREAMS', KEYS[1], '>')
  if not reply then return {} end
  entries = reply[1][2]
else
  for i = 7, #ARGV do
    local pending = redis.call('XPENDING', KEYS[1], ARGV[2], ARGV[i], ARGV[i], 1)[1]
    if pending then
      local count, claimed = pending[4], nil
      if ARGV[6] == 'KEPT' then
        claimed = redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[5], ARGV[i], 'RETRYCOUNT', count)
      else
        claimed = redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[5], ARGV[i])
        count = count + 1
      end
      if claimed[1] then
        table.insert(entries, claimed[1])
        deliveries[claimed[1][1]] = count
      end
    end
  end
end
local limit = tonumber(ARGV[4])
local out = {}
for _, e in ipairs(entries) do
  local fields = e[2]
  if fields and #fields > 0 then  -- an entry deleted meanwhile comes back from XCLAIM without fields
    local payload, label = nil, ''
    for i = 1, #fields, 2 do
      if fields[i] == 'm' then payload = fields[i + 1] end
      if fields[i] == 'l' and #fields[i + 1] <= LABEL_MAX_BYTES then label = fields[i + 1] end
    end
    local count = deliveries[e[1]] or 1
    if payload == nil then
      table.insert(out, {e[1], 1, 0, '', label, count})
    elseif limit >= 0 and #payload > limit then
      table.insert(out, {e[1], 2, #payload, '', label, count})
    else
      table.insert(out, {e[1], 0, #payload, payload, label, count})
    end
  end
end
return out
""".replace("LABEL_MAX_BYTES", str(LABEL_MAX_BYTES))
# Bus.server_id_and_keys (and so Bus.server_id, with no keys): the run id INFO reports (a random id each redis-server
# process draws at start), picked out on the server: INFO's whole section, parsed by redis-py, cost more than the round
# trip (BENCHMARKS.md, 2026-12-07); and MGET's values (false, sent back as nil, where a key holds none). The learner's
# inbox asks it before each read, with STOP.
_RUN_ID_AND_KEYS = """
local values = {}
if #KEYS > 0 then values = redis.call('MGET', unpack(KEYS)) end
return {string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'), values}
"""
STREAM_POLL = (0.005, 0.05)  # a stream read waits by polling (scripts cannot block): first and longest pause
_OK, _NO_PAYLOAD, _OVERSIZE = 0, 1, 2


def _reconnect_retry() -> Retry:
    """Commands wait out a restarting server (down, then loading its append-only file) for about RECONNECT_SECONDS.

    Only what a restart raises is retried: a refused or dropped connection, then LOADING. Not a timeout (Retry's
    default list has it): each try of a server that stopped answering lasts SOCKET_TIMEOUT, so the retries would wait
    half an hour rather than a minute, and send again a command the server may have run."""
    backoff = ExponentialBackoff(cap=RECONNECT_BACKOFF_CAP, base=0.05)
    return Retry(backoff, retries=int(RECONNECT_SECONDS / RECONNECT_BACKOFF_CAP) + 5,
                 supported_errors=(redis.ConnectionError, redis.BusyLoadingError))


class RedisBus(Bus):
    """A Bus on one Redis database; `namespace` prefixes every key so several runs can share a server."""

    def __init__(self, client: redis.Redis, namespace: str = ""):
        self._client = client
        self._prefix = f"{namespace}:" if namespace else ""
        self._change = client.register_script(_CHANGE)
        self._fetch_entries = client.register_script(_FETCH_ENTRIES)
        self._run_id_and_keys = client.register_script(_RUN_ID_AND_KEYS)

    @classmethod
    def from_url(cls, url: str, namespace: str = "", wait_out_restarts: bool = True) -> "RedisBus":
        """`redis://[:PASSWORD@]HOST:PORT/DB[?namespace=NAME]`; an explicit `namespace` argument wins.
        `wait_out_restarts=False`: a command on a server that is down raises redis.ConnectionError at once."""
        url, named = without_namespace(url)
        namespace = namespace or named
        retry = _reconnect_retry() if wait_out_restarts else Retry(NoBackoff(), 0)
        client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=10,
                                      decode_responses=False, retry=retry,
                                      retry_on_error=[redis.ConnectionError, redis.BusyLoadingError])
        return cls(client, namespace)

    def _k(self, name: str) -> str:
        return self._prefix + name

    def put(self, queue: str, message) -> None:
        self._client.rpush(self._k(queue), encode(message, f"queue {queue}"))

    def put_many(self, queue: str, messages: list) -> None:
        encoded = [encode(m, f"queue {queue}") for m in messages]
        if encoded:
            self._client.rpush(self._k(queue), *encoded)

    def get_many(self, queue: str, max_count: int, timeout: float, max_bytes: int | None = None) -> list:
        """One round trip per call: BLPOP and `LPOP key n` are pipelined (not a transaction).

        Redis runs a blocked client's next pipelined command right after BLPOP returns, so the
        LPOP takes whatever else is already queued without a second network wait.
        """
        if max_count <= 0:
            return []
        key = self._k(queue)
        if timeout <= 0:  # BLPOP 0 would block forever; a non-blocking read is what was asked for
            return self._decode_all(queue, self._client.lpop(key, max_count) or [], max_bytes)
        remaining = timeout
        while True:
            block = min(remaining, MAX_BLOCK)
            pipe = self._client.pipeline(transaction=False)
            pipe.blpop([key], timeout=block)
            if max_count > 1:
                pipe.lpop(key, max_count - 1)
            first, *rest = pipe.execute()
            raw = ([first[1]] if first is not None else []) + ((rest[0] or []) if rest else [])
            if raw:  # the LPOP may find messages that arrived just after BLPOP timed out: keep them
                return self._decode_all(queue, raw, max_bytes)
            remaining -= block
            if remaining <= 0:
                return []

    @staticmethod
    def _decode_all(queue: str, raw: list, max_bytes: int | None) -> list:
        return [decode_or_undecodable(m, f"queue {queue}", max_bytes) for m in raw]

    def qsize(self, queue: str) -> int:
        return self._client.llen(self._k(queue))

    def set(self, key: str, value) -> None:
        self._client.set(self._k(key), encode_value(value, key))

    def get(self, key: str, default=None):
        data = self._client.get(self._k(key))
        return default if data is None else decode_value(data, key)

    def get_keys(self, keys: list[str], default=None) -> list:
        if not keys:  # MGET refuses an empty list
            return []
        values = self._client.mget([self._k(key) for key in keys])  # nil for a key of another type too
        return _decoded(keys, values, default)

    def incr(self, key: str, amount: int = 1) -> int:
        check_integer(amount, f"incr of key {key!r}: the amount")
        try:
            return self._client.incrby(self._k(key), amount)
        except redis.ResponseError as e:
            raise BusError(f"key {key!r} does not hold an integer; cannot incr it ({e})") from e

    def delete(self, *keys: str) -> None:
        if keys:
            self._client.delete(*(self._k(k) for k in keys))

    def change(self, steps: list[Step]) -> Step | None:
        args = []
        for step in steps:
            arg = encode(step.arg, f"stream {step.key}") if step.op == "append" else step.arg
            args += [step.op, arg, step.label]
        try:
            unmet = self._change(keys=[self._k(step.key) for step in steps], args=args)
        except redis.ResponseError as e:
            raise BusError(f"change {[(step.op, step.key) for step in steps]} failed: {e}") from e
        return steps[unmet - 1] if unmet else None

    def set_size(self, key: str) -> int:
        return self._client.scard(self._k(key))

    def set_members(self, key: str) -> list[str]:
        return sorted(member.decode() for member in self._client.smembers(self._k(key)))

    def stream_add(self, stream: str, message, label: str = "") -> str:
        check_label(label, stream)
        fields = {PAYLOAD: encode(message, f"stream {stream}"), **({LABEL: label} if label else {})}
        return self._client.xadd(self._k(stream), fields).decode()

    def stream_read(self, stream: str, group: str, consumer: str, max_count: int, timeout: float,
                    max_bytes: int | None = None) -> list[StreamEntry]:
        """Polls a script that reads and measures on the server (see _FETCH_ENTRIES): a blocking XREADGROUP
        would send a payload whatever its size before the reader could refuse it."""
        if max_count <= 0:
            return []
        deadline = time.monotonic() + max(timeout, 0.0)
        pause = STREAM_POLL[0]
        while True:
            entries = self._fetch(stream, group, consumer, max_bytes, "READ", [max_count])
            if entries or time.monotonic() >= deadline:
                return entries
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, STREAM_POLL[1])

    def _fetch(self, stream: str, group: str, consumer: str, max_bytes: int | None, command: str,
               args: list) -> list[StreamEntry]:
        key = self._k(stream)
        argv = [command, group, consumer, -1 if max_bytes is None else max_bytes, *args]
        try:
            reply = self._fetch_entries(keys=[key], args=argv)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._create_group(key, group)
            reply = self._fetch_entries(keys=[key], args=argv)
        return [_stream_entry(entry_id, status, size, payload, deliveries, max_bytes, label)
                for entry_id, status, size, payload, label, deliveries in reply]

    def _create_group(self, key: str, group: str) -> None:
        try:
            self._client.xgroup_create(key, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if not str(e).startswith("BUSYGROUP"):  # another consumer created it first
                raise

    def stream_claim(self, stream: str, group: str, consumer: str, min_idle: float,
                     max_count: int, max_bytes: int | None = None, counted: bool = True) -> list[StreamEntry]:
        """XPENDING pages, then XCLAIM of those held by others. XCLAIM checks the idle time again, so of two
        consumers claiming the same entry only one gets it."""
        key, min_idle_ms = self._k(stream), int(min_idle * 1000)
        ids: list[bytes] = []
        start = "-"
        while len(ids) < max_count:
            try:
                page = self._client.xpending_range(key, group, start, "+", PENDING_PAGE, idle=min_idle_ms)
            except redis.ResponseError as e:
                if str(e).startswith("NOGROUP"):
                    return []
                raise
            ids += [p["message_id"] for p in page if p["consumer"].decode() != consumer][:max_count - len(ids)]
            if len(page) < PENDING_PAGE:
                break
            start = "(" + page[-1]["message_id"].decode()
        if not ids:
            return []
        return self._fetch(stream, group, consumer, max_bytes, "CLAIM",
                           [min_idle_ms, "COUNTED" if counted else "KEPT", *ids])

    def stream_ack(self, stream: str, group: str, ids: list[str]) -> int:
        if not ids:
            return 0
        key = self._k(stream)
        pipe = self._client.pipeline(transaction=True)
        pipe.xack(key, group, *ids)
        pipe.xdel(key, *ids)
        acked, _deleted = pipe.execute()
        return acked

    def stream_pending(self, stream: str, group: str) -> int:
        try:
            return self._client.xpending(self._k(stream), group)["pending"]
        except redis.ResponseError as e:
            if str(e).startswith("NOGROUP"):
                return 0
            raise

    def stream_length(self, stream: str) -> int:
        return self._client.xlen(self._k(stream))

    def stream_range(self, stream: str, max_count: int) -> list[StreamEntry]:
        if max_count <= 0:  # as get_many and stream_read; XRANGE refuses a COUNT below 1
            return []
        return [_stream_entry(entry_id, _OK if PAYLOAD in fields else _NO_PAYLOAD, 0, fields.get(PAYLOAD, b""), 0, None,
                              fields.get(LABEL, b""))
                for entry_id, fields in self._client.xrange(self._k(stream), count=max_count)]

    def stream_delete(self, stream: str, ids: list[str]) -> int:
        return self._client.xdel(self._k(stream), *ids) if ids else 0

    def server_id_and_keys(self, keys: list[str], default=None) -> tuple[str, list]:
        server, values = self._run_id_and_keys(keys=[self._k(key) for key in keys])
        return server.decode(), _decoded(keys, values, default)

    def close(self) -> None:
        self._client.close()


def without_namespace(url: str) -> tuple[str, str]:
    """(`url` without its `?namespace=NAME`, which redis-py would refuse as an unknown argument; NAME or "")."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    namespace = query.pop("namespace", [""])[0]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, doseq=True))), namespace


def _decoded(keys: list[str], values: list, default) -> list:
    """MGET's values under `keys`, each as Bus.get gives it, `default` for a nil."""
    return [default if data is None else decode_value(data, key) for key, data in zip(keys, values)]


def _stream_entry(entry_id: bytes, status: int, size: int, payload: bytes, deliveries: int,
                  max_bytes: int | None, label: bytes) -> StreamEntry:
    # a foreign writer's: over the limit dropped as the fetch script drops it, bytes that are not UTF-8 replaced
    label = label.decode(errors="replace") if len(label) <= LABEL_MAX_BYTES else ""
    if status == _NO_PAYLOAD:
        return StreamEntry(entry_id.decode(), b"", deliveries, f"the entry has no payload field {PAYLOAD!r}", 0, label)
    if status == _OVERSIZE:
        return StreamEntry(entry_id.decode(), b"", deliveries, oversize(size, max_bytes), size, label)
    return StreamEntry(entry_id.decode(), payload, deliveries, label=label)
