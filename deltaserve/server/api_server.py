"""The FastAPI app: routes, OpenAI-style errors, API-key check, request-body limit, CORS, and `run_server`
(uvicorn; the process's life around it, shutdown included, is in lifecycle.py).

Every error a client can cause is answered with {"error": {...}} and a 4xx status; an unexpected
exception is a 500 with the same shape (and is logged), never a bare traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import logging
import socket
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from .. import __version__
from .async_engine import AsyncEngine, EngineDeadError, EngineLike
from .lifecycle import DEFAULT_SHUTDOWN_TIMEOUT, Lifecycle, LifecycleMiddleware, bind_socket, serve, watch_engine
from .metrics import ServerMetrics
from .openapi import install_openapi
from .protocol import APIError
from .serving_chat import create_chat_completion
from .serving_completions import create_completion
from .serving_messages import anthropic_error_body, count_tokens, create_message
from .serving_responses import create_response
from .serving_tokenize import detokenize, model_card, tokenize
from .state import ClientGone, ServerConfig, ServerState

logger = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/")   # "/": the chat page, whose API calls send the key typed into it
ANTHROPIC_PATHS = ("/v1/messages",)   # and below: errors in Anthropic's body shape
CHAT_PAGE = importlib.resources.files(__package__).joinpath("static/chat.html").read_text(encoding="utf-8")


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """An error's body in the shape of the API the path belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(error.status, error.message)
    return error.body()


def build_app(engine: EngineLike, config: ServerConfig) -> FastAPI:
    """An app serving `engine`; its engine thread starts and stops with the app's lifespan, watched for
    death and stalled streams while it runs."""
    metrics = ServerMetrics(engine.get_stats)
    async_engine = AsyncEngine(engine, metrics, config.stream_interval)
    state = ServerState(async_engine, config, metrics)
    lifecycle = Lifecycle()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        watcher = asyncio.ensure_future(watch_engine(async_engine, lifecycle, config.stream_inactivity_timeout))
        try:
            yield
        finally:
            watcher.cancel()
            async_engine.shutdown()
            state.close()

    app = FastAPI(title="deltaserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.state.lifecycle = lifecycle
    # added innermost first: lifecycle (refusals while draining, stalled clients), body limit, API key, CORS
    # (outermost, so preflights and errors carry its headers)
    app.add_middleware(LifecycleMiddleware, lifecycle=lifecycle, send_timeout=config.stream_inactivity_timeout)
    _add_body_limit(app, config, metrics)
    if config.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key, on_reject=metrics)
    _add_cors(app, config)
    _add_error_handlers(app, metrics)
    _add_routes(app, state)
    install_openapi(app)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await create_completion(state, request)
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            return await create_chat_completion(state, request)
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    _add_api_routes(app, state)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return HTMLResponse(CHAT_PAGE)

    @app.get("/health")
    async def health():
        if not state.engine.healthy:
            return JSONResponse(APIError("the engine loop is not running", status=503,
                                         type="internal_server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        reset = getattr(state.engine.engine, "reset_prefix_cache", None)
        if reset is None or not reset():
            return JSONResponse(APIError("prefix caching is off (--no-enable-prefix-caching)").body(), status_code=400)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    """Anthropic Messages, Responses, tokenize / detokenize and the model card by id."""

    def guarded(handler):
        async def run(request: Request):
            try:
                return await handler(state, request)
            except ClientGone:
                return Response(status_code=499)
        return run

    for path, handler in (("/v1/messages", create_message), ("/v1/messages/count_tokens", count_tokens),
                          ("/v1/responses", create_response), ("/tokenize", tokenize),
                          ("/detokenize", detokenize)):
        app.add_api_route(path, guarded(handler), methods=["POST"], name=handler.__name__)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.config.served_model_name:
            raise APIError(f"The model {model_id!r} does not exist", status=404, param="model",
                           code="model_not_found")
        return model_card(state)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(request: Request, error: APIError) -> JSONResponse:
        refused = error.status < 500 or error.code == "server_overloaded"   # turned away, not failed
        metrics.requests.labels(outcome="rejected" if refused else "error").inc()
        return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return reply(request, exc)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return reply(request, APIError(str(exc), status=503, type="internal_server_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return reply(request, APIError(f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(request, APIError(f"{request.method} {request.url.path}: {exc.detail}",
                                       status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return reply(request, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                       type="internal_server_error"))


class _APIKeyMiddleware:
    """Plain ASGI middleware (keeps streaming and disconnect detection untouched): every path but
    /health needs `Authorization: Bearer <key>` or (Anthropic's clients) `x-api-key: <key>`."""

    def __init__(self, app: Any, api_key: str, on_reject: ServerMetrics):
        self.app, self.metrics = app, on_reject
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"], self.key)
        if bearer_ok or key_ok:
            return await self.app(scope, receive, send)
        self.metrics.requests.labels(outcome="rejected").inc()
        error = APIError("invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                         status=401, code="invalid_api_key")
        await JSONResponse(error_body(scope["path"], error), status_code=401)(scope, receive, send)


def _add_body_limit(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_request_bytes, metrics=metrics)


def _add_cors(app: FastAPI, config: ServerConfig) -> None:
    """CORS only when origins were given (--allowed-origins): by default browsers on other origins get no
    CORS headers, so they cannot read responses."""
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])


class _BodyLimitMiddleware:
    """Request bodies above `max_bytes` get 413: at once when Content-Length says so, else as soon as the
    bytes received pass the limit (a chunked upload is not read to its end first)."""

    def __init__(self, app: Any, max_bytes: int, metrics: ServerMetrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    def _error(self) -> APIError:
        return APIError(f"the request body is larger than this server accepts ({self.max_bytes} bytes, "
                        "--max-request-bytes)", status=413, code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.metrics.requests.labels(outcome="rejected").inc()
            body = error_body(scope["path"], self._error())
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()  # answered by the APIError handler
            return message

        await self.app(scope, limited_receive, send)


def uvicorn_ssl_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's TLS arguments from --ssl-keyfile / --ssl-certfile (none: plain HTTP)."""
    if config.ssl_certfile is None:
        return {}
    return {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile}


def run_server(engine: EngineLike, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", *, sock: socket.socket | None = None,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, **uvicorn_options: Any) -> int:
    """Serve until SIGTERM / SIGINT or engine death; returns the exit status (0 after a signal, 1 when the
    engine loop died). `sock`: a socket already bound to host:port (`lifecycle.bind_socket`, done before the
    model loads); bound here otherwise. `uvicorn_options` go to uvicorn.Config (e.g. ssl_keyfile)."""
    app = build_app(engine, config)
    sock = sock if sock is not None else bind_socket(host, port)
    scheme = "https" if config.ssl_certfile else "http"
    logger.info("serving %r on %s://%s:%d/v1", config.served_model_name, scheme, host, port)
    return serve(app, sock, shutdown_timeout=shutdown_timeout, log_level=log_level,
                 **{**uvicorn_ssl_options(config), **uvicorn_options})
