"""The server process's life around the app: the listening socket (bound before the model loads, answered
with 503 while it loads), readiness and engine death, the stalled-client guard, and graceful shutdown.

Shutdown (SIGTERM / SIGINT): the listening socket closes and any request that still arrives is answered
503; live requests get up to `shutdown_timeout` seconds to finish; then every one still running is ended
with an error (a stream gets a final error chunk and `data: [DONE]`) and its engine requests are aborted;
the process exits 0. A second signal forces the exit at once. A dead engine loop makes /health fail and
the process exit with status 1 within a second; its live requests get an error first.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import logging
import signal
import socket
import ssl
import sys
import threading
from typing import Any, Callable, Iterator

import uvicorn

from .async_engine import AsyncEngine, ServerShuttingDownError
from .protocol import APIError

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 5.0
DEFAULT_STREAM_INACTIVITY_TIMEOUT = 60.0
FLUSH_GRACE = 2.0          # after ending the streams, seconds left for their final chunks to go out
WATCH_INTERVAL = 0.2       # how often the engine thread's health and stalled streams are checked
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening). A port in use fails here, before anything loads,
    with a ValueError naming the address."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)  # as uvicorn does
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # restart while old connections sit in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: [Errno {exc.errno}] {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _error_body(message: str, status: int) -> bytes:
    return json.dumps(APIError(message, status=status, type="service_unavailable").body()).encode()


class _LoadingHandler(http.server.BaseHTTPRequestHandler):
    """Every request while the model loads: 503, Retry-After, connection closed."""

    protocol_version = "HTTP/1.1"
    MAX_BODY_READ = 1 << 20

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= self.MAX_BODY_READ:
            self.rfile.read(length)   # read the body, or closing would reset the connection under the reply
        body = _error_body("the model is loading; retry shortly", 503)
        self.send_response(503)
        for name, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("Retry-After", "1"), ("Connection", "close")):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _reply

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _LoadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def get_request(self):
        conn, address = self.socket.accept()
        if self.tls is not None:   # the handshake happens in the handler's thread, on its first read
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address


@contextlib.contextmanager
def answering_while_loading(sock: socket.socket, *, ssl_keyfile: str | None = None,
                            ssl_certfile: str | None = None) -> Iterator[None]:
    """Listen on `sock` and answer every request 503 in a background thread until the block ends (over TLS
    when given the server's key and certificate); the socket stays open, and listening, for the real server."""
    tls = None
    if ssl_certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(ssl_certfile, ssl_keyfile)
    sock.listen(2048)
    server = _LoadingServer(sock.getsockname()[:2], _LoadingHandler, bind_and_activate=False)
    server.socket.close()
    server.socket, server.tls = sock, tls
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="deltaserve-loading", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()   # stops the loop; server_close() would close the socket
        thread.join()


class Lifecycle:
    """Shared by the app and the process running it: whether new requests are refused, the exit status,
    and how to ask the process to stop."""

    def __init__(self) -> None:
        self.draining = False
        self.exit_status = 0
        self.request_exit: Callable[[], None] | None = None   # set by the process serving the app

    def fatal(self, error: BaseException) -> None:
        logger.critical("the engine loop has died (%r): exiting with status 1", error)
        self.exit_status = 1
        if self.request_exit is not None:
            self.request_exit()


async def watch_engine(engine: AsyncEngine, lifecycle: Lifecycle, stream_inactivity_timeout: float | None) -> None:
    """Runs for the app's life: a dead engine thread ends the process; streams whose client has stopped
    reading are aborted."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL)
        if not engine.healthy:
            lifecycle.fatal(engine.error or RuntimeError("the engine thread has stopped"))
            return
        if stream_inactivity_timeout:
            try:
                engine.abort_stalled(stream_inactivity_timeout)
            except Exception:   # never let it end the watch over the engine thread
                logger.exception("checking for stalled streams failed")


class _StalledClient(Exception):
    pass


async def _within(awaitable: Any, timeout: float) -> Any:
    if sys.version_info >= (3, 11):   # no task per call
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)


class LifecycleMiddleware:
    """Plain ASGI middleware: 503 for requests arriving while the server drains; a response send that
    blocks longer than the inactivity timeout (the client stopped reading) ends the response and closes
    the connection (the handler's cleanup aborts its engine requests)."""

    def __init__(self, app: Any, lifecycle: Lifecycle, send_timeout: float | None):
        self.app, self.lifecycle, self.send_timeout = app, lifecycle, send_timeout or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.lifecycle.draining:
            return await self._refuse(send)
        if self.send_timeout is None:
            return await self.app(scope, receive, send)
        timeout = self.send_timeout

        async def guarded_send(message):
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                return await _within(send(message), timeout)
            except asyncio.TimeoutError:
                raise _StalledClient() from None

        try:
            await self.app(scope, receive, guarded_send)
        except _StalledClient:
            logger.warning("%s %s: the client has not read its response for %.0f s: closing the connection",
                           scope.get("method"), scope.get("path"), timeout)

    @staticmethod
    async def _refuse(send) -> None:
        body = _error_body("the server is shutting down", 503)
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def serve(app: Any, sock: socket.socket, *, shutdown_timeout: float, log_level: str, **uvicorn_options: Any) -> int:
    """Run `app` (built by build_app) with uvicorn on the bound socket until a signal or engine death;
    returns the process exit status."""
    lifecycle: Lifecycle = app.state.lifecycle
    engine: AsyncEngine = app.state.server.engine
    config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + FLUSH_GRACE, **uvicorn_options)
    server = _Server(config, lifecycle, engine, shutdown_timeout)

    def request_exit() -> None:
        server.should_exit = True

    lifecycle.request_exit = request_exit
    server.run(sockets=[sock])
    if not server.started:
        return 1
    if server.force_exit:
        return lifecycle.exit_status or 1
    return lifecycle.exit_status


class _Server(uvicorn.Server):
    """uvicorn's server with this module's shutdown: drain, then end what is left, and no re-raised signal
    (uvicorn re-raises the captured signal after serving, which would make the exit status -SIGTERM)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.lifecycle, self.engine, self.shutdown_timeout = lifecycle, engine, shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True   # a second signal: stop waiting for live requests
        self.should_exit = True
        self.lifecycle.draining = True   # now, not at uvicorn's next tick: no request is admitted after the signal

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.draining = True
        live = self.engine.num_open_groups
        if live:
            logger.info("shutting down: %d request(s) running get up to %g s to finish", live, self.shutdown_timeout)
        ender = asyncio.ensure_future(self._end_requests_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_requests_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        ended = self.engine.fail_open_groups(lambda: ServerShuttingDownError(
            f"the server is shutting down and the request did not finish within {seconds:g} s"))
        if ended:
            logger.warning("shutdown timeout of %g s reached: ended %d request(s) with an error", seconds, ended)
