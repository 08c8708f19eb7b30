"""RedisBus: the bus between processes (and machines), on redis-py's sync client.

Queues are Redis lists (RPUSH / BLPOP / LPOP count), keys are strings, counters use INCRBY. One
redis-py client with its connection pool is thread-safe, so one RedisBus serves every thread of a role.
"""

import urllib.parse

import redis

from rlsys.bus.base import Bus, BusError, decode, decode_value, encode, encode_value

# A blocking command must return before the socket times out, or redis-py drops the connection while
# the server may already have popped a message for it (lost). Long waits are therefore cut into slices.
SOCKET_TIMEOUT = 30.0
MAX_BLOCK = 10.0


class RedisBus(Bus):
    """A Bus on one Redis database; `namespace` prefixes every key so several runs can share a server."""

    def __init__(self, client: redis.Redis, namespace: str = ""):
        self._client = client
        self._prefix = f"{namespace}:" if namespace else ""

    @classmethod
    def from_url(cls, url: str, namespace: str = "") -> "RedisBus":
        """`redis://[:PASSWORD@]HOST:PORT/DB[?namespace=NAME]`; an explicit `namespace` argument wins."""
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parts.query)
        namespace = namespace or query.pop("namespace", [""])[0]
        url = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, doseq=True)))
        client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=10,
                                      decode_responses=False)
        return cls(client, namespace)

    def _k(self, name: str) -> str:
        return self._prefix + name

    def put(self, queue: str, message) -> None:
        self._client.rpush(self._k(queue), encode(message, f"queue {queue}"))

    def put_many(self, queue: str, messages: list) -> None:
        encoded = [encode(m, f"queue {queue}") for m in messages]
        if encoded:
            self._client.rpush(self._k(queue), *encoded)

    def get_many(self, queue: str, max_count: int, timeout: float) -> list:
        """One round trip per call: BLPOP and `LPOP key n` are pipelined (not a transaction).

        Redis runs a blocked client's next pipelined command right after BLPOP returns, so the
        LPOP takes whatever else is already queued without a second network wait.
        """
        if max_count <= 0:
            return []
        key = self._k(queue)
        if timeout <= 0:  # BLPOP 0 would block forever; a non-blocking read is what was asked for
            return self._decode_all(queue, self._client.lpop(key, max_count) or [])
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
                return self._decode_all(queue, raw)
            remaining -= block
            if remaining <= 0:
                return []

    @staticmethod
    def _decode_all(queue: str, raw: list) -> list:
        return [decode(m, f"queue {queue}") for m in raw]

    def qsize(self, queue: str) -> int:
        return self._client.llen(self._k(queue))

    def set(self, key: str, value) -> None:
        self._client.set(self._k(key), encode_value(value, key))

    def get(self, key: str, default=None):
        data = self._client.get(self._k(key))
        return default if data is None else decode_value(data, key)

    def incr(self, key: str, amount: int = 1) -> int:
        try:
            return self._client.incrby(self._k(key), amount)
        except redis.ResponseError as e:
            raise BusError(f"key {key!r} does not hold an integer; cannot incr it ({e})") from e

    def delete(self, *keys: str) -> None:
        if keys:
            self._client.delete(*(self._k(k) for k in keys))

    def close(self) -> None:
        self._client.close()
