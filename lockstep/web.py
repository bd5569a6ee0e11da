"""The HTTP endpoints of the long-running processes: aiohttp on an event loop in a thread of its own.

The processor (``/healthz``, ``/metrics``) and the sink (those, ``/query`` and the live page ``/``)
serve through :class:`HttpServer`, which bounds what a client can hold:

- at most ``max_connections`` open connections for any request, and ``health_reserve`` more that are answered only
  on ``/healthz`` and ``/metrics`` (anything else ``503``), so that idle or slow clients holding every connection do
  not make the process look unhealthy; one more than both is answered ``503`` and closed;
- a connection that sends no complete request within ``idle_timeout_s`` is closed (aiohttp's
  keep-alive timer runs from the connection's start, so a client that never sends, or sends its
  headers a byte at a time, is dropped);
- a request body of at most ``max_body`` bytes (``413`` beyond), read within ``body_timeout_s``
  (``408``);
- blocking work (DuckDB) runs on ``workers`` threads with at most ``max_waiting`` requests queued
  behind them; more are answered ``503`` with ``Retry-After``;
- anything malformed is a ``400`` with a one-line JSON error (a body that is not a JSON object, a
  negative ``Content-Length``, a broken request line); a bug is a ``500`` whose body says only
  that, the traceback goes to the log.

Handlers are coroutines; they call :meth:`HttpServer.blocking` for anything that blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from .metrics import Metrics
from .schemas.errors import LockstepError

log = logging.getLogger("lockstep.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Busy(LockstepError):
    """More blocking requests than the server takes at once."""


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64
    health_reserve: int = 16  # connections beyond max_connections that serve only HEALTH_PATHS
    idle_timeout_s: float = 15.0
    body_timeout_s: float = 10.0
    max_body: int = 1 << 20
    workers: int = 4
    max_waiting: int = 8


#: the paths a connection of the health reserve is answered on
HEALTH_PATHS = frozenset({"/healthz", "/metrics"})


def json_response(body: object, status: int = 200, **kwargs) -> web.Response:
    return web.Response(text=json.dumps(body, default=str), status=status, content_type="application/json", **kwargs)


def error(status: int, message: str, **kwargs) -> web.Response:
    return json_response({"error": message}, status=status, **kwargs)


class HttpServer:
    """``server = HttpServer(host, port, metrics); server.get("/healthz", handler); server.start()``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: Metrics | None = None,
        limits: Limits = Limits(),
        name: str = "http",
    ):
        self.host = host
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.name = name
        self.app = web.Application(client_max_size=limits.max_body, middlewares=[self._guard])
        self._requested_port = port
        self.port: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix=f"{name}-work")
        self._pending = 0
        self._reserve: set[asyncio.BaseTransport] = set()  # open connections beyond max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    # ------------------------------------------------------------------ routes and helpers

    def get(self, path: str, handler: Handler) -> None:
        self.app.router.add_get(path, handler, allow_head=False)

    def post(self, path: str, handler: Handler) -> None:
        self.app.router.add_post(path, handler)

    async def blocking(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the worker threads; :class:`Busy` (503) when too many already wait."""
        if self._pending >= self.limits.workers + self.limits.max_waiting:
            raise Busy()
        self._pending += 1  # only the event loop's thread touches it
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._pending -= 1

    async def read_json(self, request: web.Request) -> dict:
        """The request body as a JSON object; 400 for anything else, 408 when it does not arrive in time."""
        try:
            body = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except TimeoutError:
            raise web.HTTPRequestTimeout(text="the request body did not arrive in time") from None
        try:
            value = json.loads(body or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise web.HTTPBadRequest(text=f"the body is not JSON ({exc})") from None
        if not isinstance(value, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
                type(value), "null"
            )
            raise web.HTTPBadRequest(text=f"the body must be a JSON object, got {kind}")
        return value

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ the guard around every handler

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.transport in self._reserve and request.path not in HEALTH_PATHS:
                self.metrics.inc("http_refused_total", reason="connections")
                raise Busy()
            resp = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            keep = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
            resp = error(
                exc.status,
                exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason,
                headers=keep,
            )
        except Busy:
            self.metrics.inc("http_refused_total", reason="busy")
            resp = error(503, "busy: too many requests at once; retry shortly", headers={"Retry-After": "1"})
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            resp = error(500, "internal error (see the server's log)")
        route = request.match_info.route.resource
        self.metrics.inc(
            "http_requests_total", path=route.canonical if route is not None else "other", code=str(resp.status)
        )
        return resp

    # ------------------------------------------------------------------ life cycle

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._failed is not None:
            raise OSError(f"cannot serve HTTP on {self.host}:{self._requested_port}: {self._failed}")
        return self

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:
            self._failed = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        if self._runner is not None:
            loop.run_until_complete(self._runner.cleanup())
        loop.close()

    async def _setup(self) -> None:
        lim = self.limits
        runner = self._runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, keepalive_timeout=lim.idle_timeout_s
        )
        await runner.setup()
        server = runner.server
        if server is None:  # setup() made it
            raise RuntimeError("aiohttp's AppRunner.setup() made no server")
        connection_made = server.connection_made

        def bounded(handler, transport) -> None:
            connection_made(handler, transport)
            n = len(server.connections)
            if n > lim.max_connections:
                self._reserve = {t for t in self._reserve if not t.is_closing()}
            if lim.max_connections < n <= lim.max_connections + lim.health_reserve:
                self._reserve.add(transport)  # answered on HEALTH_PATHS only (_guard)
            elif n > lim.max_connections:
                self.metrics.inc("http_refused_total", reason="connections")
                body = b'{"error": "too many connections"}'
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                transport.close()

        server.connection_made = bounded  # type: ignore[method-assign]
        site = web.TCPSite(runner, self.host, self._requested_port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
