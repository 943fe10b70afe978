"""The FastAPI application: routes, API-key check, the browser guard, CORS, error shapes, request metrics, the
request trace, the scheduler lifecycle, and the uvicorn server that drains on SIGTERM / SIGINT.

`create_app(scheduler, ...)` builds the app around a Scheduler (which loads the engine in its own thread when
the app starts, so /health answers 503 "loading" meanwhile). Every error leaves as a 4xx/5xx JSON body in the
shape the client's SDK expects: Anthropic's under /v1/messages, OpenAI's elsewhere; nothing a client sends
can turn into an unhandled exception or stop the server. A request that fails because the engine went away
under it (a stage died and the route restarts, or the server shuts down) is a 503 with Retry-After.

Without an API key, `BrowserGuard` keeps web pages out: DNS rebinding (a Host header naming anything but this
machine's loopback names, the listening address or `--allow-host` names) and cross-origin browser requests
(an Origin that `--cors` does not allow, "simple" text/plain POSTs that skip the CORS preflight included)
are refused with 403. `serve(app, ...)` runs uvicorn with a graceful drain: see `Server`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ds4station.engine.scheduler import Scheduler
from ds4station.ports import free_port

from . import anthropic, openai, status, warmup
from .errors import ApiError
from .generation import ServerState
from .trace import RequestTrace
from .warmup import WARMING

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Seconds uvicorn still waits for connections once the drain is over (the streams have ended by then).
_CLOSE_WAIT = 3
# The served process's interpreter-lock switch interval (see serve).
GIL_SWITCH_S = 0.001


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(_is_anthropic(request.url.path)), status_code=err.status, headers=err.headers)


def require_key(request: Request) -> None:
    """With --api-key, every route but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    key = request.app.state.ds4.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "missing or invalid API key: send it as `Authorization: Bearer KEY` or `x-api-key`",
                       code="invalid_api_key")


def host_name(host: str) -> str:
    """The name part of a Host header or an --allow-host value: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


class BrowserGuard:
    """Pure ASGI middleware refusing, with 403, what only a web page would send (used without --api-key): a
    Host that is not this machine (DNS rebinding: a page on attacker.example whose name now resolves to
    127.0.0.1) and an Origin that is neither the server's own nor allowed by --cors. /health stays open."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str], origins: Sequence[str]) -> None:
        self.app = app
        self.any_host = "*" in hosts
        self.hosts = {host_name(h) for h in (*LOOPBACK_NAMES, *hosts) if h != "*"}
        self.any_origin = "*" in origins
        self.origins = {o.strip().rstrip("/").lower() for o in origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(headers.get("host", ""), headers.get("origin"))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        message, code = refusal
        err = ApiError(403, message, code=code)
        await JSONResponse(err.body(_is_anthropic(scope["path"])), status_code=403)(scope, receive, send)

    def _refusal(self, host: str, origin: str | None) -> tuple[str, str] | None:
        name = host_name(host)
        if not self.any_host and not self._is_this_machine(name):
            shown = name or "(none)"
            return (f"Host {shown!r} is refused: without --api-key this server answers only requests addressed to "
                    "localhost, 127.0.0.1, [::1] or its listening address (a defence against DNS rebinding); "
                    f"allow the name with `serve --allow-host {name or 'NAME'}`, or require a key with --api-key",
                    "host_not_allowed")
        if origin is None or self.any_origin or origin.strip().rstrip("/").lower() in self.origins:
            return None
        if urlsplit(origin.strip()).netloc.lower() == host.strip().lower():
            return None  # the server's own origin (the Host itself passed above)
        return (f"cross-origin request from {origin!r} refused: allow that origin with `serve --cors {origin}`, "
                "or require a key with --api-key", "origin_not_allowed")

    def _is_this_machine(self, name: str) -> bool:
        if name in self.hosts:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


class RequestCounter:
    """Pure ASGI middleware counting responses by route and status (no buffering of streamed bodies)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        code = {"status": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                code["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not WARMING.get():  # the server's own warm-up requests are not traffic
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.state.metrics.http.labels(path, str(code["status"])).inc()


def create_app(scheduler: Scheduler, *, model_name: str, model_path: str, ctx: int, api_key: str | None = None,
               cors: Sequence[str] = (), allowed_hosts: Sequence[str] = (), max_body_bytes: int = 32 * 1024 * 1024,
               default_max_tokens: int = 4096, keepalive_s: float = 10.0,
               trace: RequestTrace | None = None) -> FastAPI:
    """The API server around `scheduler` (started when the app starts, stopped when it stops). Without
    `api_key`, the Host header must name a loopback address or one of `allowed_hosts` ("*": any), and an
    Origin header must be one of `cors`. `trace` records every finished request."""
    state = ServerState(scheduler=scheduler, model_name=model_name, model_path=model_path, ctx=ctx,
                        default_max_tokens=default_max_tokens, keepalive_s=keepalive_s,
                        max_body_bytes=max_body_bytes, api_key=api_key)
    state.metrics = status.Metrics(scheduler)
    scheduler.observers.append(state.metrics.observe)
    if trace is not None:
        scheduler.observers.append(trace.observe)

    async def warm_up(app: FastAPI) -> None:
        """Once the engine is ready: the server's own first requests, then /health says ok."""
        try:
            while not await asyncio.to_thread(scheduler.ready.wait, 1.0):
                pass
            if scheduler.state == "ready":
                await warmup.warm(app, model_name, api_key)
        finally:
            state.warm.set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        warming = asyncio.create_task(warm_up(app))
        yield
        warming.cancel()
        scheduler.stop()
        if trace is not None:
            trace.close()

    app = FastAPI(title="ds4station", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ds4 = state
    app.include_router(status.router)  # /health stays open: liveness probes carry no key
    for router in (openai.router, anthropic.router):
        app.include_router(router, dependencies=[Depends(require_key)])
    app.add_api_route("/status", status.status, methods=["GET"], dependencies=[Depends(require_key)])
    app.add_api_route("/metrics", status.metrics, methods=["GET"], dependencies=[Depends(require_key)])

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return _error_response(request, ApiError(400, f"{loc}: {first.get('msg', 'invalid request')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                       str(exc.detail))
        return _error_response(request, ApiError(exc.status_code, msg, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc)
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 code="internal_error"))

    if cors:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After"])
    if not api_key:  # outside CORS: a refused origin's preflight is refused too
        app.add_middleware(BrowserGuard, hosts=list(allowed_hosts), origins=list(cors))
    app.add_middleware(RequestCounter, state=state)
    return app


class Server(uvicorn.Server):
    """uvicorn's server with a graceful drain. The first SIGTERM / SIGINT makes the scheduler refuse new requests
    (503, and /health 503 "stopping") while the running and queued ones finish, for up to `grace` seconds;
    those still open then end with an error event in their API's shape (the SDKs raise; nothing looks
    complete that is not), and the server exits. A second signal ends them at once, a third quits outright."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float,
                 parent_pid: int | None = None) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.grace = grace
        self.parent_pid = parent_pid  # exit at once when this process stops being the parent (it died)
        self._now = threading.Event()
        self._drain: threading.Thread | None = None
        self.load_failed = False

    async def on_tick(self, counter: int) -> bool:
        # A model that never loaded leaves nothing to serve: exit (non-zero, see `serve`) rather than answer
        # 503 forever. A route that failed later, after its restarts, stays up to say why (/health).
        if self.scheduler.load_error is not None and not self.load_failed:
            self.load_failed = True
            print(f"ds4station serve: {self.scheduler.load_error}", file=sys.stderr)
            self.should_exit = True
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            print(f"ds4station serve: the process that started it (pid {self.parent_pid}) is gone: stopping now",
                  file=sys.stderr, flush=True)
            self.parent_pid = None
            self.handle_exit(signal.SIGTERM, None)
            self._now.set()  # nobody is left to wait for: open requests end at once
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as uvicorn's captured signal: a drained server exits normally (status 0), it does not
        # re-raise the signal once it is done.
        if self._drain is None:
            print(f"ds4station serve: {signal.Signals(sig).name}: finishing open requests (up to {self.grace:g} s; "
                  "again to end them now)", file=sys.stderr, flush=True)
            self._drain = threading.Thread(target=self._drain_then_exit, name="ds4-drain", daemon=True)
            self._drain.start()
        elif not self._now.is_set():
            self._now.set()
        else:
            self.should_exit = self.force_exit = True

    def _drain_then_exit(self) -> None:
        try:
            self.scheduler.drain(self.grace, self._now)
        finally:
            self.should_exit = True


def serve(app: FastAPI, host: str, port: int, shutdown_grace: float, log_level: str = "info",
          parent_pid: int | None = None) -> int:
    """Run `app` (made by create_app) in this thread until a signal has drained it (see Server); -> the exit
    status: 0, or 1 when the model failed to load (the reason is printed). `parent_pid`: stop at once when
    that process is no longer this one's parent (the control panel that started it was killed).

    The process's interpreter lock changes hands every GIL_SWITCH_S instead of Python's 5 ms: the engine's
    worker thread gives it up while the GPU runs a step, and must not then wait up to 5 ms for the event
    loop (writing the previous token's chunk) to hand it back."""
    sys.setswitchinterval(GIL_SWITCH_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=_CLOSE_WAIT)
    server = Server(config, app.state.ds4.scheduler, shutdown_grace, parent_pid)
    server.run()
    return 1 if server.load_failed else 0


class BackgroundServer:
    """Run an app under uvicorn in a daemon thread on a free port (tests, the TUI's demo mode); `url` once up."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="ds4-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait until /health would say ok (the engine loaded and the server's own first requests made)."""
        state = self.server.config.app.state.ds4
        deadline = time.monotonic() + timeout
        return state.scheduler.ready.wait(timeout) and state.warm.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
