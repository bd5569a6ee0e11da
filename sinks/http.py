"""The sink's HTTP side: the query server beside the sink, and the clients that reach it.

:class:`QueryServer` serves read-only SQL, the live page and the writes an operator asks for on a loopback port,
and announces its address and a bearer token in a sidecar file beside the database (:func:`sidecar`, readable by
the file's owner only).  :func:`query` runs SQL on the findings file directly when it is free and through the
running sink otherwise; :func:`ask` posts to one of the sink's endpoints; :func:`wait_for` polls a condition.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from ..metrics import CONTENT_TYPE, Metrics
from ..web import HttpServer, Limits, error, json_response
from .paging.incidents import Event, Incident, IncidentStateError
from .store import FindingsStore, QueryBusy, StoreError, StoreLocked, jsonable, open_read_only, run_query
from .store.findings import Pruned, UnknownIncident

#: the query server's connection limits unless told otherwise
HTTP_LIMITS = Limits()


def sidecar(db: Path | str) -> Path:
    """The file beside ``db`` in which the running sink announces its address and token."""
    return Path(f"{db}.sink.json")


class SinkStopping(StoreError):
    """The sink stopped before it ran what it was asked."""


class Served(Protocol):
    """What the query server needs of the sink it serves (:class:`lockstep.sinks.sink.Sink`; this module imports no
    Kafka client, so that the clients below load none)."""

    store: FindingsStore
    metrics: Metrics
    assigned: bool

    def submit(self, fn: Callable[[], Any]) -> Future: ...
    def acknowledge(self, incident_id: str, by: str, tenant: str | None = None) -> tuple[Incident, list[Event]]: ...
    def resolve(self, incident_id: str, by: str, tenant: str | None = None) -> tuple[Incident, list[Event]]: ...
    def prune(self, older_than_s: float) -> Pruned: ...


class QueryServer:
    """HTTP (aiohttp, :class:`lockstep.web.HttpServer`): ``GET /healthz``, ``GET /metrics``,
    ``POST /query`` ``{"sql", "params", "tenant"}`` -> ``{"columns", "rows"}``, and ``GET /``, the live page.

    ``/query`` needs ``Authorization: Bearer <token>``; the token is in the sidecar file, which only the
    database file's owner can read, so the endpoint grants what the file's permissions grant.  The page
    takes the same token, also as ``?token=`` once (it answers with a cookie and a redirect to the URL
    without it, so that the token leaves the address bar and the history), and the same tenant rule:
    ``?tenant=T`` shows that tenant's rows only.
    """

    def __init__(
        self,
        sink: Served,
        db: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        limits: Limits = HTTP_LIMITS,
        refresh_s: float = 10.0,
    ):
        self.store = sink.store
        self.sink = sink
        self.db = Path(db)
        self.refresh_s = refresh_s
        self._token = secrets.token_urlsafe(32)
        self.http = HttpServer(host, port, sink.metrics, limits, name="sink-http")
        self.http.get("/healthz", self._healthz)
        self.http.get("/metrics", self._metrics)
        self.http.post("/query", self._query)
        self.http.post("/incidents/ack", self._incident_ack)
        self.http.post("/incidents/resolve", self._incident_resolve)
        self.http.post("/prune", self._prune)
        self.http.get("/", self._page)
        self.sidecar = sidecar(db)
        self.url = ""

    # ------------------------------------------------------------------ handlers

    async def _healthz(self, request: web.Request) -> web.Response:
        ok = self.sink.assigned
        return json_response({"status": "ok" if ok else "starting"}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.sink.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    def _bearer(self, request: web.Request) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {self._token}".encode())

    async def _query(self, request: web.Request) -> web.Response:
        if not self._bearer(request):
            return error(401, f"/query needs the bearer token from {self.sidecar}")
        req = await self.http.read_json(request)
        sql, params, tenant = req.get("sql", ""), req.get("params"), req.get("tenant")
        if (
            not isinstance(sql, str)
            or not (params is None or isinstance(params, list))
            or not (tenant is None or isinstance(tenant, str))
        ):
            return error(400, "bad request: sql must be a string, params a list, tenant a string")
        try:
            cols, rows = await self.http.blocking(self._run_query, sql, params, tenant)
        except QueryBusy as exc:
            return error(503, str(exc), headers={"Retry-After": "1"})
        except StoreError as exc:
            return error(400, str(exc))
        return json_response({"columns": cols, "rows": rows})

    async def _on_sink(self, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Run ``fn`` on the sink's thread (:meth:`Sink.submit`) and wait for it without holding a worker thread."""
        return await asyncio.wait_for(asyncio.wrap_future(self.sink.submit(fn)), timeout_s)

    async def _incident_ack(self, request: web.Request) -> web.Response:
        return await self._incident(request, "acknowledge")

    async def _incident_resolve(self, request: web.Request) -> web.Response:
        return await self._incident(request, "resolve")

    async def _incident(self, request: web.Request, action: str) -> web.Response:
        """``POST /incidents/ack|resolve`` ``{"id", "by", "tenant"}`` -> ``{"incident", "changed"}``."""
        if not self._bearer(request):
            return error(401, f"{request.path} needs the bearer token from {self.sidecar}")
        req = await self.http.read_json(request)
        iid, by, tenant = req.get("id"), req.get("by"), req.get("tenant")
        if not (isinstance(iid, str) and iid and isinstance(by, str) and by.strip() and len(by) <= 200) or not (
            tenant is None or isinstance(tenant, str)
        ):
            return error(400, "bad request: id and by must be non-empty strings (by: at most 200), tenant a string")
        change = self.sink.acknowledge if action == "acknowledge" else self.sink.resolve
        try:
            inc, events = await self._on_sink(lambda: change(iid, by.strip(), tenant))
        except UnknownIncident as exc:
            return error(404, str(exc))
        except IncidentStateError as exc:
            return error(409, str(exc))
        except (SinkStopping, TimeoutError) as exc:
            return error(
                503,
                str(exc) or "the sink did not run the request in time (it may still: see lockstep query)",
                headers={"Retry-After": "1"},
            )
        return json_response({"incident": dataclasses.asdict(inc), "changed": bool(events)})

    async def _prune(self, request: web.Request) -> web.Response:
        """``POST /prune`` ``{"older_than_s"}`` -> ``{"pruned": {table: rows}, "older_than_s"}``."""
        if not self._bearer(request):
            return error(401, f"/prune needs the bearer token from {self.sidecar}")
        req = await self.http.read_json(request)
        age = req.get("older_than_s")
        if isinstance(age, bool) or not isinstance(age, int | float) or not age > 0:
            return error(400, "bad request: older_than_s must be a positive number of seconds")
        try:
            pruned = await self._on_sink(lambda: self.sink.prune(float(age)), timeout_s=600.0)
        except (SinkStopping, TimeoutError) as exc:
            return error(
                503,
                str(exc) or "the sink did not run the request in time (it may still: see lockstep query)",
                headers={"Retry-After": "1"},
            )
        except StoreError as exc:
            return error(400, str(exc))
        return json_response({"pruned": dataclasses.asdict(pruned), "older_than_s": float(age)})

    def _run_query(self, sql: str, params: list | None, tenant: str | None) -> tuple[list[str], list[list]]:
        try:
            cols, rows = self.store.query(sql, params, tenant)  # the store's checks and limits
        except (TypeError, ValueError, OverflowError) as exc:  # parameters DuckDB cannot bind
            raise StoreError(f"bad request: {exc}") from None
        return cols, [[jsonable(v) for v in r] for r in rows]

    async def _page(self, request: web.Request) -> web.Response:
        token = request.query.get("token")
        if token is not None:
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                return web.Response(status=401, text="wrong token", content_type="text/plain")
            rest = {k: v for k, v in request.query.items() if k != "token"}
            resp = web.Response(status=303, headers={"Location": str(request.rel_url.with_query(rest))})
            resp.set_cookie(COOKIE, self._token, httponly=True, samesite="Strict", path="/")
            return resp
        if not (
            self._bearer(request) or hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self._token.encode())
        ):
            return web.Response(status=401, content_type="text/html", text=login_page(str(self.sidecar)))
        tenant = request.query.get("tenant") or None
        job = request.query.get("job") or None
        page = await self.http.blocking(self._render, tenant, job)
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})

    def _render(self, tenant: str | None, job: str | None) -> str:
        from .report.data import gather
        from .report.page import render

        data = gather(
            lambda sql, params=None: self.store.query(sql, params, tenant), job=job
        )  # the same checks and limits as /query
        scope = ", ".join(x for x in (f"job {job}" if job else "", f"tenant {tenant}" if tenant else "") if x)
        return render(data, title=f"Lockstep live: {self.db.name}", scope=scope, refresh_s=self.refresh_s)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> QueryServer:
        self.http.start()
        self.url = self.http.url
        write_private(self.sidecar, json.dumps({"url": self.url, "pid": os.getpid(), "token": self._token}))
        return self

    def live_url(self) -> str:
        return f"{self.url}/?token={self._token}"

    def stop(self) -> None:
        self.http.stop()
        try:
            self.sidecar.unlink()
        except FileNotFoundError:
            pass


COOKIE = "lockstep_token"


def login_page(side: str) -> str:
    import html

    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Lockstep: token needed</title></head><body>'
        "<h1>Lockstep live page</h1><p>This page needs the sink's token. Open the address that "
        f"<code>lockstep report --live-url</code> prints (it reads the token from <code>{html.escape(side)}</code>).</p></body></html>"
    )


def write_private(path: Path, text: str) -> None:
    """A new file only its owner can read: what was at ``path`` (a stale file, a link planted there) is removed
    first, and the file is created exclusively, never through a link, mode 0600 whatever its predecessor's."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def query(
    db: Path | str, sql: str, params: list | None = None, tenant: str | None = None, timeout_s: float = 30.0
) -> tuple[list[str], list[list]]:
    """Run read-only SQL on the findings file: directly when free, through the running sink otherwise.

    With ``tenant``, only that tenant's rows exist for the SQL (see :func:`~.store.tenant_sandbox`)."""
    try:
        con = open_read_only(db)
    except StoreLocked:
        pass
    else:
        try:
            cols, rows = run_query(con, sql, params, tenant)
            return cols, [[jsonable(v) for v in r] for r in rows]
        finally:
            con.close()
    body = ask(db, "/query", {"sql": sql, "params": params, "tenant": tenant}, timeout_s)
    return body["columns"], body["rows"]


class SinkRefused(StoreError):
    """The running sink answered a request with an error (its HTTP status in ``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def ask(db: Path | str, path: str, body: dict, timeout_s: float = 30.0) -> dict:
    """POST ``body`` to the endpoint ``path`` of the sink that holds ``db`` (its address and token from the sidecar).

    Raises StoreLocked when no sink announced itself or it does not answer, SinkRefused with its message otherwise."""
    side = sidecar(db)
    try:
        announced = json.loads(side.read_text())
        url, token = announced["url"], announced.get("token", "")
    except PermissionError:
        raise StoreLocked(f"{db} is held by a running sink and {side} is not readable by this user") from None
    except (OSError, ValueError, KeyError):
        raise StoreLocked(f"{db} is held by another process and no running sink announced itself in {side}") from None
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            msg = str(exc)
        raise SinkRefused(msg, exc.code) from None
    except (urllib.error.URLError, TimeoutError) as exc:
        raise StoreLocked(f"{db} is held by a sink that does not answer at {url} ({exc})") from None


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
