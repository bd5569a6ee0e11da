"""The pager: incident events in DuckDB -> deliveries -> PagerDuty, Slack, webhooks.  Runs inside the sink.

Why inside the sink: DuckDB has one writer, and the sink is it.  The sink's
transaction that stores findings also appends incident events (an outbox), so
an event exists exactly when its finding does.  Then, in order:

1. **fan-out** (the sink's thread, one transaction): every event after the
   pager's cursor becomes at most one delivery per route (``webhook_deliveries``,
   status ``pending``) and the cursor moves past it.  A crash before the commit
   redoes it; after it, nothing is planned twice.
2. **delivery** (one thread per route): due deliveries are sent in event order
   (an incident's resolve never overtakes its trigger); 2xx marks them
   ``delivered``, 429/5xx/timeouts schedule a retry with exponential backoff and
   jitter, other answers mark them ``failed``.  Attempts, status codes and errors
   are logged in the same row.

A crash between a receiver's 2xx and the row's update sends that one delivery
again after the restart, with the same ``webhook-id`` and PagerDuty
``dedup_key``, which receivers deduplicate (Slack cannot).
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import msgspec
import pyarrow as pa

from ...metrics import Metrics
from ..store import FindingsStore, epoch_us, one, transaction, upsert
from .pages import Page, backoff_s, payload, plan, retryable, sign, wire_body
from .routes import Paging, Route, RoutesError

log = logging.getLogger("lockstep.pager")

CURSOR = "pager"


@dataclass(frozen=True)
class Response:
    status: int | None  # None: no answer (timeout, connection refused, ...)
    retry_after_s: float | None = None
    error: str = ""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirected POST would lose its body: report the 3xx instead
        return None


#: the most of a receiver's answer the pager reads (its status decides; the body is only drained)
RESPONSE_MAX_BYTES = 64 << 10


class UrllibTransport:
    """HTTP POST with the standard library; never raises for an HTTP answer or a network failure."""

    def __init__(self):
        self._opener = urllib.request.build_opener(_NoRedirect())

    def post(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Response:
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(req, timeout=timeout_s) as resp:
                resp.read(RESPONSE_MAX_BYTES)  # what a receiver says beyond its status is not read: 3 GB took 2.9 GB
                return Response(resp.status)
        except urllib.error.HTTPError as exc:
            return Response(exc.code, _retry_after(exc.headers.get("Retry-After")), f"HTTP {exc.code} {exc.reason}")
        except (urllib.error.URLError, OSError) as exc:  # timeouts are OSErrors too
            return Response(None, None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # an HTTP date
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


_DELIVERY_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("event_seq", pa.int64()),
        ("route", pa.string()),
        ("receiver", pa.string()),
        ("action", pa.string()),
        ("incident_id", pa.string()),
        ("tenant", pa.string()),
        ("job", pa.string()),
        ("severity", pa.string()),
        ("status", pa.string()),
        ("attempts", pa.int32()),
        ("next_attempt_at", pa.timestamp("us")),
        ("created_at", pa.timestamp("us")),
        ("payload", pa.string()),
    ]
)

#: pending deliveries of a route that nothing earlier of the same incident holds back
_SENDABLE = """
FROM webhook_deliveries d
WHERE d.route = ? AND d.status = 'pending'
  AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e
                  WHERE e.route = d.route AND e.incident_id = d.incident_id AND e.status = 'pending' AND e.event_seq < d.event_seq)
"""
_DUE = f"SELECT d.id, d.payload, d.attempts {_SENDABLE} AND epoch(d.next_attempt_at) <= ? ORDER BY d.event_seq"
_NEXT = f"SELECT min(epoch(d.next_attempt_at)) {_SENDABLE}"


def delivery_id(event_seq: int, route: str) -> str:
    """Deterministic per (event, route): the ``webhook-id``, the same on every retry."""
    return "msg_" + hashlib.sha256(f"{event_seq}\x1f{route}".encode()).hexdigest()[:24]


def request(route: Route, delivery: str, stored: dict, now: float) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one delivery; a generic webhook's carry its Standard Webhooks signature."""
    body = wire_body(route, stored)
    headers = {"Content-Type": "application/json", "User-Agent": "lockstep-pager"}
    if route.receiver == "webhook":
        if route.secret is None:
            raise RoutesError(f"route {route.name!r}: a webhook route signs its requests; set its secret_env")
        ts = int(now)
        headers |= {
            "webhook-id": delivery,
            "webhook-timestamp": str(ts),
            "webhook-signature": sign(route.secret, delivery, ts, body),
        }
    return body, headers


def finding_for_test_page(now: float) -> dict:
    """The Finding a test page carries: plainly a test, on no real job or device."""
    from ...schemas.records import Finding, Impact

    f = Finding(
        id=f"lockstep-test-{int(now)}",
        job="lockstep-test",
        window="test",
        steps=[],
        scope="job",
        workers=[],
        hosts=[],
        devices=[],
        function="test",
        function_kind="other",
        cause="test",
        confidence=1.0,
        evidence=[],
        impact=Impact(step_time_share=0.0, gpu_hours_per_day=0.0),
        policy="test",
        created_at=now,
        summary="Test page from `lockstep test-page`: this route reaches its receiver. Nothing is wrong.",
    )
    return msgspec.to_builtins(f)


def send_test(route: Route, paging: Paging, action: str, incident: str, now: float, transport=None) -> Response:
    """Send one test page (``trigger``, or ``resolve`` of the same ``incident``) through ``route`` now, bypassing
    the route's filters and the delivery log: what an operator runs after writing a routes file."""
    finding = finding_for_test_page(now)
    page = Page(action, incident, 1, finding, route.severity_of(finding), "test", now)
    body, headers = request(route, f"msg_test_{action}_{int(now)}", payload(route, page), now)
    return (transport or UrllibTransport()).post(route.url, body, headers, paging.retry.timeout_s)


class Pager:
    def __init__(
        self,
        store: FindingsStore,
        paging: Paging,
        metrics: Metrics | None = None,
        transport=None,
        clock=time.time,
        rng: random.Random | None = None,
        poll_s: float = 1.0,
    ):
        self.store = store
        self.paging = paging
        self.metrics = metrics or Metrics()
        self.transport = transport or UrllibTransport()
        self.clock = clock
        self.rng = rng or random.Random()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._wake = {r.name: threading.Event() for r in paging.routes}
        self._threads: list[threading.Thread] = []
        # paging starts with the events after it was first enabled on this file: no pages for history
        store.con.execute(
            "INSERT INTO pager_cursor SELECT ?, coalesce(max(seq), 0) FROM incident_events ON CONFLICT DO NOTHING",
            [CURSOR],
        )

    # ------------------------------------------------------------------ fan-out

    def fan_out(self) -> int:
        """Plan the deliveries of every event after the cursor; one transaction.  Returns how many."""
        con = self.store.con.cursor()
        try:
            with transaction(con):
                last = one(
                    con.execute("SELECT last_seq FROM pager_cursor WHERE name = ?", [CURSOR]).fetchone(),
                    "the pager's cursor",
                )[0]
                events = con.execute(
                    """
                    SELECT e.seq, e.incident_id, e.tenant, e.job, e.action, e.reason, epoch(e.occurred_at), f.record, i.occurrence,
                           i.acked_at IS NOT NULL
                    FROM incident_events e JOIN incidents i ON i.id = e.incident_id LEFT JOIN findings f ON f.id = e.finding_id
                    WHERE e.seq > ? ORDER BY e.seq
                    """,
                    [last],
                ).fetchall()
                if not events:
                    return 0
                ids = sorted({e[1] for e in events})
                triggered: dict[str, dict[str, str]] = {}
                for iid, route, status in con.execute(
                    "SELECT incident_id, route, status FROM webhook_deliveries WHERE action = 'trigger' AND list_contains(?, incident_id)",
                    [ids],
                ).fetchall():
                    triggered.setdefault(iid, {})[route] = status
                now = self.clock()
                rows = []
                for seq, iid, tenant, job, action, reason, occurred_at, record, occurrence, acked in events:
                    if record is None:
                        log.warning("incident event %d names a finding that is not stored; no page", seq)
                        continue
                    finding = json.loads(record)
                    for route, what in plan(action, finding, self.paging.routes, triggered.get(iid, {}), acked):
                        severity = route.severity_of(finding)
                        page = Page(what, iid, occurrence, finding, severity, reason, occurred_at)
                        rows.append(
                            {
                                "id": delivery_id(seq, route.name),
                                "event_seq": seq,
                                "route": route.name,
                                "receiver": route.receiver,
                                "action": what,
                                "incident_id": iid,
                                "tenant": tenant,
                                "job": job,
                                "severity": severity,
                                "status": "pending",
                                "attempts": 0,
                                "next_attempt_at": epoch_us(now),
                                "created_at": epoch_us(now),
                                "payload": json.dumps(payload(route, page)),
                            }
                        )
                        if what == "trigger":
                            triggered.setdefault(iid, {})[route.name] = "pending"
                if rows:
                    upsert(
                        con,
                        "webhook_deliveries",
                        pa.Table.from_pylist(rows, schema=_DELIVERY_SCHEMA),
                        ("id",),
                        keep=tuple(_DELIVERY_SCHEMA.names),
                    )
                con.execute("UPDATE pager_cursor SET last_seq = ? WHERE name = ?", [events[-1][0], CURSOR])
        finally:
            con.close()
        if rows:
            log.info("planned %d page(s) for %d incident event(s)", len(rows), len(events))
            self.notify()
        return len(rows)

    # ------------------------------------------------------------------ delivery

    def deliver_due(self, route: Route) -> int:
        """Send every due delivery of the route once (in event order).  Returns how many were attempted."""
        con = self.store.con.cursor()
        try:
            due = con.execute(_DUE, [route.name, self.clock()]).fetchall()
            last_send = 0.0
            for n, (did, stored, attempts) in enumerate(due):
                if self._stop.is_set():
                    return n
                if route.min_interval_s and last_send:
                    self._stop.wait(max(0.0, last_send + route.min_interval_s - time.monotonic()))
                last_send = time.monotonic()
                self._attempt(con, route, did, json.loads(stored), attempts)
            return len(due)
        finally:
            con.close()

    def _attempt(self, con, route: Route, did: str, stored: dict, attempts: int) -> None:
        body, headers = request(route, did, stored, self.clock())
        resp = self.transport.post(route.url, body, headers, self.paging.retry.timeout_s)
        attempts += 1
        now = self.clock()
        if resp.status is not None and 200 <= resp.status < 300:
            result, next_at = "delivered", None
            con.execute(
                "UPDATE webhook_deliveries SET status = 'delivered', attempts = ?, last_status = ?, last_error = NULL, delivered_at = make_timestamp(?::BIGINT) WHERE id = ?",
                [attempts, resp.status, epoch_us(now), did],
            )
        else:
            error = resp.error or f"HTTP {resp.status}"
            if retryable(resp.status) and attempts < self.paging.retry.max_attempts:
                result = "retry"
                next_at = now + backoff_s(attempts, self.paging.retry, self.rng.random(), resp.retry_after_s)
            else:
                result, next_at = "failed", None
            con.execute(
                "UPDATE webhook_deliveries SET status = ?, attempts = ?, last_status = ?, last_error = ?, next_attempt_at = make_timestamp(?::BIGINT) WHERE id = ?",
                ["pending" if result == "retry" else "failed", attempts, resp.status, error, epoch_us(next_at), did],
            )
            log.log(
                logging.WARNING if result == "failed" else logging.INFO,
                "route %s: delivery %s attempt %d: %s (%s)",
                route.name,
                did,
                attempts,
                error,
                "retrying" if result == "retry" else "giving up",
            )
        self.metrics.inc(
            "webhook_deliveries_total",
            route=route.name,
            receiver=route.receiver,
            result=result,
        )

    def next_due_in(self, route: Route) -> float | None:
        """Seconds until the route's next pending delivery is due (0: now), None when nothing is pending."""
        con = self.store.con.cursor()
        try:
            row = one(con.execute(_NEXT, [route.name]).fetchone(), "the next delivery")
        finally:
            con.close()
        return None if row[0] is None else max(0.0, row[0] - self.clock())

    def drain(self, timeout_s: float) -> bool:
        """Deliver in this thread until nothing is pending (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            waits = []
            for route in self.paging.routes:
                self.deliver_due(route)
                wait = self.next_due_in(route)
                if wait is not None:
                    waits.append(wait)
            if not waits:
                return True
            time.sleep(min(min(waits), max(0.0, deadline - time.monotonic()), self.poll_s))
        return False

    # ------------------------------------------------------------------ threads

    def notify(self) -> None:
        for ev in self._wake.values():
            ev.set()

    def start(self) -> Pager:
        for route in self.paging.routes:
            t = threading.Thread(target=self._run, args=(route,), name=f"pager-{route.name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, route: Route) -> None:
        wake = self._wake[route.name]
        while not self._stop.is_set():
            wake.clear()
            try:
                self.deliver_due(route)
                wait = self.next_due_in(route)
            except Exception:  # a delivery bug must not end paging for good
                log.exception("route %s: delivery loop failed; retrying in %.0fs", route.name, self.poll_s)
                wait = self.poll_s
            wake.wait(self.poll_s if wait is None else min(wait, self.poll_s))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.notify()
        for t in self._threads:
            t.join(timeout_s)
