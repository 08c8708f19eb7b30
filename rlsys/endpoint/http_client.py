"""One HTTP connection pool for every agent run of a rollout worker, each call still sent with its own key.

Agent functions get a base URL and an API key per run. Building an `openai.AsyncOpenAI` client the plain way
makes an HTTP client (httpx2, the `openai` client's httpx), whose SSL context alone costs about 50 ms of CPU:
one per run, that was nearly all of the rollout worker's time (BENCHMARKS.md, the endpoint section). A client built over `shared_http_client()`
costs a fraction of a millisecond, reuses the pool's open connections, and still sends the key it was given,
so every call stays attributed to its own episode:

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=shared_http_client())

An HTTP client belongs to the event loop it first ran in, so there is one per loop (the rollout worker has
one; tests may run several).
"""

import asyncio
import weakref

import httpx2
import openai

# Every run of the worker's episodes may wait on the engine at once (64 episodes x 8 runs in the default
# bench): no cap on connections, or requests would queue in the pool rather than at the engine, and idle ones
# kept so the next call does not open a new connection. The server keeps them longer (rlsys/endpoint/server.py)
# so the client never reuses one the server has just closed.
LIMITS = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=5.0)

_CLIENTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx2.AsyncClient]" = weakref.WeakKeyDictionary()


def shared_http_client() -> httpx2.AsyncClient:
    """This event loop's HTTP client, with the `openai` client's defaults (timeouts, redirects) and no
    connection cap; made on first use."""
    loop = asyncio.get_running_loop()
    if loop not in _CLIENTS:
        _CLIENTS[loop] = openai.DefaultAsyncHttpxClient(limits=LIMITS)
    return _CLIENTS[loop]
