"""HTTP connection pools shared by every agent run of a rollout worker, each call still sent with its own key.

Agent functions get a base URL and an API key per run. Building an `openai.AsyncOpenAI` client the plain way
makes an HTTP client (httpx2, the `openai` client's httpx), whose SSL context alone costs tens of milliseconds of
CPU: one per run, that was nearly all of the rollout worker's time (BENCHMARKS.md, the endpoint section). A client
built over `shared_http_client()` costs a fraction of a millisecond, reuses open connections, and still sends
the key it was given, so every call stays attributed to its own episode:

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=shared_http_client())

Why several pools, not one: every run of the worker's episodes may wait on the engine at once (64 episodes x
8 runs in the default bench, one connection each), and httpcore scans all of a pool's connections on every
request and response, probing each idle one's socket. One pool of hundreds of connections cost several times
the client CPU per request of 32 pools of about 16, which cost what a pool per request costs (the openai client
itself; BENCHMARKS.md, the endpoint section).

An HTTP client belongs to the event loop it first ran in, so the pools are per loop (the rollout worker has
one; tests may run several).
"""

import asyncio
import functools
import ssl
import weakref

import httpx2
import openai

POOLS = 32
# No cap on connections, or requests would queue in a pool rather than at the engine; idle ones kept so the next
# call does not open a new one. The server keeps them longer (rlsys/endpoint/server.py), so a client never
# sends on a connection the server is closing.
LIMITS = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=5.0)


class _Pools:
    def __init__(self):
        self.clients: list[httpx2.AsyncClient] = []
        self.next = 0

    def take(self) -> httpx2.AsyncClient:
        if len(self.clients) < POOLS:  # made on first use: a test's few runs make a few
            self.clients.append(openai.DefaultAsyncHttpxClient(limits=LIMITS, verify=_ssl_context()))
            return self.clients[-1]
        self.next = (self.next + 1) % POOLS
        return self.clients[self.next]


_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pools]" = weakref.WeakKeyDictionary()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One for the process: building it is the slow part (the endpoint speaks plain HTTP, but a client wants one)."""
    return httpx2.create_ssl_context()


def shared_http_client() -> httpx2.AsyncClient:
    """One of this event loop's pools, in turn, with the `openai` client's defaults (timeouts, redirects) and no
    connection cap. A run takes one when it builds its client and keeps it for all of its calls."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = _Pools()
    return _POOLS[loop].take()
