"""The FastAPI application: routes, API-key check, CORS, error shapes, request metrics, scheduler lifecycle.

`create_app(scheduler, ...)` builds the app around a Scheduler (which loads the engine in its own thread when
the app starts, so /health answers 503 "loading" meanwhile). Every error leaves as a 4xx/5xx JSON body in the
shape the client's SDK expects: Anthropic's under /v1/messages, OpenAI's elsewhere; nothing a client sends
can turn into an unhandled exception or stop the server.
"""

from __future__ import annotations

import hmac
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ds4station.engine.scheduler import Scheduler

from . import anthropic, openai, status
from .errors import ApiError
from .generation import ServerState


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
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.state.metrics.http.labels(path, str(code["status"])).inc()


def create_app(scheduler: Scheduler, *, model_name: str, model_path: str, ctx: int, api_key: str | None = None,
               cors: Sequence[str] = (), max_body_bytes: int = 32 * 1024 * 1024, default_max_tokens: int = 4096,
               keepalive_s: float = 10.0) -> FastAPI:
    """The API server around `scheduler` (started when the app starts, stopped when it stops)."""
    state = ServerState(scheduler=scheduler, model_name=model_name, model_path=model_path, ctx=ctx,
                        default_max_tokens=default_max_tokens, keepalive_s=keepalive_s,
                        max_body_bytes=max_body_bytes, api_key=api_key)
    state.metrics = status.Metrics(scheduler)
    scheduler.on_finish = state.metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

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
    app.add_middleware(RequestCounter, state=state)
    return app


class BackgroundServer:
    """Run an app under uvicorn in a daemon thread on a free port (tests, the TUI's demo mode); `url` once up."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
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

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
