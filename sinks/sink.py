"""The DuckDB sink: consumes findings, window reports and profiling triggers with confluent-kafka.

Exactly-once into DuckDB on an at-least-once stream: the sink does not trust
Kafka's committed offsets; it stores the next offset of every partition in the
same DuckDB transaction as the rows and seeks there on every assignment.  After
each transaction the pager (when routes are configured) plans the pages of the
incident events that transaction appended.

Readers while the sink runs: DuckDB lets no second process open a file that a
writer holds, so the sink serves read-only SQL itself on a loopback HTTP port
and writes that address, with a bearer token, beside the database
(``<db>.sink.json``, readable by the file's owner only).  ``lockstep query`` and
``lockstep findings`` open the file read-only when it is free and ask the sink
otherwise (:func:`query`).  With a tenant, both run the SQL in a sandbox that
holds that tenant's rows only (:func:`~.store.tenant_sandbox`).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, KafkaException, TopicPartition

from ..metrics import Metrics
from ..schemas.records import CAUSES, Finding, ProfileTrigger, RecordError, WindowReport, dead_letter, decode, encode
from .store import Batch, FindingsStore, QueryBusy, StoreError, StoreLocked, jsonable, open_read_only, run_query

log = logging.getLogger("lockstep.sink")


def sidecar(db: Path | str) -> Path:
    return Path(f"{db}.sink.json")


class Sink:
    def __init__(self, store: FindingsStore, consumer_config: dict, topics: list[str], deadletter_topic: str,
                 publisher, metrics: Metrics | None = None, batch_size: int = 500, control_topic: str | None = None,
                 pager=None, expire_every_s: float = 30.0):  # fmt: skip
        self.store = store
        self.topics = topics
        self.deadletter_topic = deadletter_topic
        self.control_topic = control_topic  # carries other control records too: those are skipped, not dead letters
        self.publisher = publisher
        self.metrics = metrics or Metrics()
        self.batch_size = batch_size
        self.pager = pager
        self.expire_every_s = expire_every_s
        self.consumer = Consumer(consumer_config)
        self._stop = threading.Event()
        self.assigned = False

    def _on_assign(self, consumer: Consumer, partitions) -> None:
        stored = self.store.offsets()
        for p in partitions:
            p.offset = stored.get((p.topic, p.partition), OFFSET_BEGINNING)
        consumer.assign(partitions)
        self.assigned = True
        log.info("assigned %s", [(p.topic, p.partition, p.offset) for p in partitions])

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.consumer.subscribe(self.topics, on_assign=self._on_assign)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                msgs = self.consumer.consume(self.batch_size, timeout=0.5)
                if msgs:
                    self.write(msgs)
                if time.monotonic() >= next_tick:  # also plans what a crash or a failed fan-out left
                    self._after(self.store.expire(), always=True)
                    next_tick = time.monotonic() + self.expire_every_s
        finally:
            self.consumer.close()

    def _after(self, events, always: bool = False) -> None:
        for ev in events:
            self.metrics.inc("incident_events_total", action=ev.action, help="incident changes, by action (trigger, update, resolve)")
        if self.pager and (events or always):
            try:
                self.pager.fan_out()
            except Exception:  # the events stay in DuckDB: the next tick plans them
                log.exception("planning pages failed; retrying within %.0fs", self.expire_every_s)

    def _dead(self, msg, err: RecordError) -> None:
        dl = dead_letter(topic=msg.topic(), partition=msg.partition(), offset=msg.offset(), error=err, stage="sink", payload=msg.value())
        self.publisher.send_raw(self.deadletter_topic, msg.key(), encode(dl))
        self.metrics.inc("dead_letters_total", reason=err.reason, stage="sink", help="records sent to the dead-letter topic, by reason")
        self.metrics.inc("records_out_total", topic=self.deadletter_topic, help="records published, by topic")

    def _isolate(self, accepted, offsets, exc: Exception) -> list:
        """The store refused a batch: write its records one by one (upserts: a crash in between replays them
        harmlessly), dead-letter those it refuses, then move the offsets."""
        log.warning("the store refused a batch of %d record(s) (%s: %s); writing them one by one", len(accepted), type(exc).__name__, exc)
        events = []
        for msg, rec in accepted:
            one = Batch(findings=[rec] if isinstance(rec, Finding) else [], windows=[rec] if isinstance(rec, WindowReport) else [],
                        offsets={}, triggers=[rec] if isinstance(rec, ProfileTrigger) else [])  # fmt: skip
            try:
                events += self.store.write(one)
            except Exception as err:
                log.exception("the store refused %s[%d]@%d; it goes to the dead-letter topic", msg.topic(), msg.partition(), msg.offset())
                self._dead(msg, RecordError("processing_failed", f"the findings store refused it ({type(err).__name__}: {err})"))
        self.publisher.flush()
        return events + self.store.write(Batch(findings=[], windows=[], offsets=offsets))

    def write(self, msgs) -> Batch:
        findings: list[Finding] = []
        windows: list[WindowReport] = []
        triggers: list[ProfileTrigger] = []
        accepted = []  # (message, record)
        offsets: dict[tuple[str, int], int] = {}
        dead = 0
        m = self.metrics
        now = time.time()
        lag_s: dict[str, float] = {}
        for msg in msgs:
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", msg.error().str())
                continue
            m.inc("records_in_total", topic=msg.topic(), help="records consumed, by topic")
            offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            kind, ts_ms = msg.timestamp()
            if kind != TIMESTAMP_NOT_AVAILABLE:
                lag_s[msg.topic()] = max(0.0, now - ts_ms / 1000.0)
            try:
                rec = decode(msg.value(), (Finding, WindowReport, ProfileTrigger))
            except RecordError as err:
                if err.reason == "wrong_record" and msg.topic() == self.control_topic:
                    continue  # another control record (not a trigger): not the sink's business
                self._dead(msg, err)
                dead += 1
                continue
            {Finding: findings, WindowReport: windows, ProfileTrigger: triggers}[type(rec)].append(rec)
            accepted.append((msg, rec))
        if dead:
            self.publisher.flush()  # dead letters are durable before the offsets move past them
        batch = Batch(findings=findings, windows=windows, offsets=offsets, triggers=triggers)
        t0 = time.perf_counter()
        try:
            events = self.store.write(batch)
        except Exception as exc:  # a record the store cannot keep must not stop the sink (it would stop again on restart)
            events = self._isolate(accepted, offsets, exc)
        m.observe("write_seconds", time.perf_counter() - t0, help="one DuckDB transaction (rows, incidents and offsets)")
        for topic, age in lag_s.items():
            m.set("consumer_lag_seconds", age, topic=topic, help="age of the last record consumed, by topic (now - its Kafka timestamp)")
        for (topic, partition), pos in offsets.items():
            try:
                _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
            except KafkaException:
                continue
            if high >= 0:
                m.set("consumer_lag_records", max(0, high - pos), topic=topic, partition=str(partition),
                      help="high watermark - next offset, by partition (a lower bound on brokers that under-report the watermark)")  # fmt: skip
        for f in findings:
            # a label per cause this build knows: a record's free text must not grow the metrics without bound
            m.inc("findings_written_total", cause=f.cause if f.cause in CAUSES else "other", help="finding rows upserted, by cause")
        m.inc("windows_written_total", len(windows), help="window rows upserted")
        m.inc("triggers_written_total", len(triggers), help="profiling trigger rows upserted")
        self._after(events)
        return batch


# ------------------------------------------------------------------ query endpoint


class QueryServer:
    """HTTP: GET /healthz, GET /metrics, POST /query {"sql", "params", "tenant"} -> {"columns", "rows"}.

    /query needs ``Authorization: Bearer <token>``; the token is in the sidecar file, which only the
    database file's owner can read, so the endpoint grants what the file's permissions grant.
    """

    def __init__(self, sink: Sink, db: Path, port: int = 0, host: str = "127.0.0.1"):
        store = sink.store
        metrics = sink.metrics
        token = secrets.token_urlsafe(32)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # route to logging, not stderr
                log.debug(fmt, *args)

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/healthz":
                    ok = sink.assigned
                    self._send(200 if ok else 503, json.dumps({"status": "ok" if ok else "starting"}).encode())
                elif self.path == "/metrics":
                    self._send(200, metrics.render().encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self):  # noqa: N802
                if self.path != "/query":
                    self._send(404, b'{"error": "not found"}')
                    return
                if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
                    self._send(401, json.dumps({"error": f"/query needs the bearer token from {sidecar(db)}"}).encode())
                    return
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                    req = json.loads(self.rfile.read(n) or b"{}")
                    tenant = req.get("tenant")
                    if tenant is not None and not isinstance(tenant, str):
                        raise ValueError("tenant must be a string")
                    cols, rows = store.query(str(req.get("sql", "")), req.get("params"), tenant)
                    body = json.dumps({"columns": cols, "rows": [[jsonable(v) for v in r] for r in rows]}, default=str)
                    self._send(200, body.encode())
                except QueryBusy as exc:
                    self._send(503, json.dumps({"error": str(exc)}).encode())
                except StoreError as exc:
                    self._send(400, json.dumps({"error": str(exc)}).encode())
                except (ValueError, TypeError) as exc:
                    self._send(400, json.dumps({"error": f"bad request: {exc}"}).encode())

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host if host not in ('0.0.0.0', '') else '127.0.0.1'}:{self.httpd.server_address[1]}"
        self.sidecar = sidecar(db)
        self._token = token
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sink-http", daemon=True)

    def start(self) -> QueryServer:
        self._thread.start()
        write_private(self.sidecar, json.dumps({"url": self.url, "pid": os.getpid(), "token": self._token}))
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        try:
            self.sidecar.unlink()
        except FileNotFoundError:
            pass


def write_private(path: Path, text: str) -> None:
    """A new file only its owner can read: what was at ``path`` (a stale file, a link planted there) is removed
    first, and the file is created exclusively, never through a link, mode 0600 whatever its predecessor's."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def query(db: Path | str, sql: str, params: list | None = None, tenant: str | None = None,
          timeout_s: float = 30.0) -> tuple[list[str], list[list]]:  # fmt: skip
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
    side = sidecar(db)
    try:
        announced = json.loads(side.read_text())
        url, token = announced["url"], announced.get("token", "")
    except PermissionError:
        raise StoreLocked(f"{db} is held by a running sink and {side} is not readable by this user") from None
    except (OSError, ValueError, KeyError):
        raise StoreLocked(f"{db} is held by another process and no running sink announced itself in {side}") from None
    req = urllib.request.Request(
        url + "/query",
        data=json.dumps({"sql": sql, "params": params, "tenant": tenant}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            msg = str(exc)
        raise StoreError(msg) from None
    except (urllib.error.URLError, TimeoutError) as exc:
        raise StoreLocked(f"{db} is held by a sink that does not answer at {url} ({exc})") from None
    return body["columns"], body["rows"]


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
