"""The run's OpenAI-compatible HTTP endpoint, served by the rollout worker in its own event loop.

One server per rollout worker process (FastAPI on uvicorn), started by the first endpoint episode. Each
episode opens a session under an API key of its own (a random secret, so the key both authenticates and
attributes every call): `/v1/chat/completions`, `/v1/completions` and `/v1/models` answer for that
episode only; so do `/v1/responses` (OpenAI's Responses API) and `/v1/messages` (Anthropic's Messages API), both
answered by the chat path. A call with a key nobody opened is refused with 401, one with the key of an episode that
ended with 410, a malformed request with 400, one over MAX_BODY_BYTES with 413 and a chat, Responses or Messages call
to a model without a chat template with 404; OpenAI's error body says why, and for 400 which field
(rlsys/endpoint/request_checks.py); so does a 404 or 405 for a path or method not served (`GET /v1/responses/{id}`,
say: nothing is stored). Under /v1/messages the error body is Anthropic's (`{"type": "error", "error": {"type",
"message"}}`, the message naming the field), and the key may come as Anthropic's clients send it, in `x-api-key`
(a `Bearer` key comes first); no other path reads that header.
Headers over MAX_HEADER_BYTES get a plain 400 and the connection closed, whatever the key; so is a request that has
not arrived whole within 30 s, and a connection over the server's cap is answered 503
(rlsys/endpoint/http_protocol.py). A call with `"stream": true` is answered as Server-Sent Events once the model has
answered it whole (rlsys/endpoint/streaming.py).
"""

import asyncio
import collections
import contextlib
import json
import logging
import secrets
import socket
from collections.abc import Mapping

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rlsys.endpoint.address import listen_address
from rlsys.endpoint.http_protocol import bounded_protocol, connection_cap, raise_descriptor_limit
from rlsys.endpoint.request_checks import MAX_BODY_BYTES, RequestError, json_body, too_large
from rlsys.endpoint.session import EpisodeSession

log = logging.getLogger(__name__)
# The clients' HTTP libraries log every request at INFO: thousands of lines a minute in the rollout worker's log.
for _chatty in ("httpx", "httpx2", "httpcore", "httpcore2", "openai"):
    logging.getLogger(_chatty).setLevel(logging.WARNING)
KEEP_ALIVE_SECONDS = 30
FINISHED_KEYS_KEPT = 100_000  # keys of ended episodes remembered, to answer 410 rather than 401
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers; OpenAI clients send about 1 KiB
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API: its errors in its shape, its key also as x-api-key


class _Server(uvicorn.Server):
    """uvicorn inside a process that owns its signals: the rollout worker stops on SIGTERM, not the server."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Endpoint:
    """Sessions by API key, and the HTTP server that serves them."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.sessions: dict[str, EpisodeSession] = {}
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.app = self.build_app()
        self.port: int | None = None
        self.task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address is bracketed in a URL
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Listens on `host`, on a port the system picks (so runs and tests never collide)."""
        family, kind, proto, _, address = listen_address(self.host)  # IPv4 or IPv6
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        self.port = sock.getsockname()[1]
        # Idle connections kept longer than the agents' pool keeps them (rlsys/endpoint/http_client.py), so a
        # client never sends on a connection the server is closing. h11, not httptools (uvicorn's choice where it is
        # installed): httptools keeps a request's headers however long they grow, before any key is checked, so any
        # local user could fill this process's memory; h11 refuses a header block over MAX_HEADER_BYTES. Its
        # protocol here also bounds how long a request may take to arrive and how many connections are open.
        protocol = bounded_protocol(connection_cap(raise_descriptor_limit()))
        server = _Server(uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                        timeout_keep_alive=KEEP_ALIVE_SECONDS, http=protocol,
                                        h11_max_incomplete_event_size=MAX_HEADER_BYTES))
        self.task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self.task.done():
                self.task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible endpoint at %s", self.base_url)

    def open(self, session: EpisodeSession) -> str:
        key = "rlsys-" + secrets.token_urlsafe(24)
        self.sessions[key] = session
        return key

    def close(self, key: str) -> None:
        self.sessions.pop(key, None)
        self.finished[key] = None
        while len(self.finished) > FINISHED_KEYS_KEPT:
            self.finished.popitem(last=False)

    def session(self, request: Request) -> EpisodeSession:
        header = request.headers.get("authorization", "")
        key = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        if not key and request.url.path == MESSAGES_PATH:  # Anthropic's clients send the key as x-api-key
            key = request.headers.get("x-api-key", "")
        if key in self.sessions:
            return self.sessions[key]
        if key in self.finished:
            raise RequestError(410, "this API key's episode has ended; its calls are no longer served",
                               "episode_ended")
        raise RequestError(401, "unknown API key: each episode calls with the key it was given",
                           "invalid_api_key")

    async def session_and_body(self, request: Request) -> tuple[EpisodeSession, dict]:
        """The key is checked before the body is read, and again once it has arrived: an episode that ended meanwhile
        no longer answers its model's replies, so a call on it would wait forever."""
        self.session(request)
        body = await _json_body(request)
        return self.session(request), body

    def build_app(self) -> FastAPI:
        app = FastAPI(title="rlsys episode endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def refused(request: Request, error: RequestError) -> JSONResponse:
            return _error_response(request, error)

        @app.exception_handler(HTTPException)
        async def not_served(request: Request, error: HTTPException) -> JSONResponse:
            """OpenAI's error shape (Anthropic's under /v1/messages), as clients parse it, rather than FastAPI's
            {"detail": ...}."""
            message = (f"{error.detail}: {request.method} {request.url.path}; this endpoint serves POST "
                       f"/v1/chat/completions, POST /v1/completions, POST /v1/responses, POST {MESSAGES_PATH} and "
                       f"GET /v1/models")
            return _error_response(request, RequestError(error.status_code, message, code=None), error.headers)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            session, body = await self.session_and_body(request)
            return await session.chat(body, request.is_disconnected)

        @app.post("/v1/completions")
        async def completions(request: Request):
            session, body = await self.session_and_body(request)
            return await session.complete(body, request.is_disconnected)

        @app.post("/v1/responses")
        async def responses(request: Request):
            session, body = await self.session_and_body(request)
            return await session.respond(body, request.is_disconnected)

        @app.post(MESSAGES_PATH)
        async def messages(request: Request):
            session, body = await self.session_and_body(request)
            return await session.message(body, request.is_disconnected)

        @app.get("/v1/models")
        async def models(request: Request):
            session = self.session(request)
            return {"object": "list", "data": [{"id": session.model_name, "object": "model", "created": 0,
                                                "owned_by": "rlsys"}]}

        return app


class _OpenAIErrorResponse(JSONResponse):
    """OpenAI's error body as OpenAI's API sends it, indented (Starlette's JSONResponse leaves out the spaces): clients
    read it as text too, as LiteLLM tells a context overflow by `"code": "context_length_exceeded"`, with the space."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=4).encode()


def _error_response(request: Request, error: RequestError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A refusal in its API's error shape: Anthropic's under /v1/messages, as compact as Anthropic sends it."""
    if request.url.path == MESSAGES_PATH:
        return JSONResponse(error.anthropic_body(), status_code=error.status, headers=headers)
    return _OpenAIErrorResponse(error.body(), status_code=error.status, headers=headers)


async def _json_body(request: Request) -> dict:
    """The body as a JSON object; read no further than MAX_BODY_BYTES, whatever length the client declares."""
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large()
    except ClientDisconnect:  # answered to nobody; uncaught, it was an ASGI traceback in the worker's log
        raise RequestError(400, "the client disconnected before its request arrived whole") from None
    return json_body(bytes(raw))


_ENDPOINTS: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Task] = {}


async def shared_endpoint(host: str = "127.0.0.1") -> Endpoint:
    """This event loop's endpoint on `host` (one per rollout worker), started by the first episode that asks;
    the episodes that ask while it starts wait for it."""
    key = (asyncio.get_running_loop(), host)
    if key not in _ENDPOINTS:
        _ENDPOINTS[key] = asyncio.create_task(_started(Endpoint(host)))
    return await asyncio.shield(_ENDPOINTS[key])


async def _started(endpoint: Endpoint) -> Endpoint:
    await endpoint.start()
    return endpoint
