"""The DuckDB findings store: versioned migrations, idempotent upserts, offsets in the same transaction.

One process (the sink) holds the file read-write.  Rows and the Kafka offsets
that produced them commit together, so after a crash the sink resumes exactly
where its last transaction ended: nothing lost, nothing twice.  The same
transaction keeps the incidents (:mod:`.incidents`) and appends their events,
which the pager (:mod:`.pager`) turns into pages.

SQL names follow the records, except where SQL reserves the word:
``Finding.window`` is the column ``window_id`` and ``Finding.group`` is ``peer_group``.
The tables and views are listed in README.md ("SQL").
"""

from __future__ import annotations

from ..schemas.errors import LockstepError

import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import msgspec
import pyarrow as pa

from ..schemas.records import DeviationMap, Finding, ProfileTrigger, StepSeries, WindowReport
from .incidents import ClosedWindow, Event, Incident, IncidentPolicy, incident_key, on_clock, on_finding, on_window

log = logging.getLogger(__name__)


class StoreError(LockstepError, RuntimeError):
    """The findings file cannot be opened or a query is not allowed."""


class StoreLocked(StoreError):
    """Another process (the running sink) holds the DuckDB file."""


class QueryBusy(StoreError):
    """As many queries as the sink allows at once are running; ask again in a moment."""


@dataclass(frozen=True)
class QueryLimits:
    """What one query may use.  ``memory_bytes`` and ``threads`` bound each DuckDB instance that runs someone's
    SQL: the sink's own (its writer and at most ``concurrent`` queries share it), each tenant sandbox, and the
    read-only connection of a command that opens the file itself."""

    timeout_s: float = 20.0  # then the query is interrupted (lockstep query waits 30 s for the sink's answer)
    max_rows: int = 100_000  # a larger result is refused: add a LIMIT or aggregate
    memory_bytes: int = 1 << 30  # DuckDB's memory_limit; no spilling to disk (max_temp_directory_size 0)
    threads: int = 2
    concurrent: int = 2  # queries at once through the sink; more are refused (QueryBusy)


QUERY_LIMITS = QueryLimits()


def duckdb_config(limits: QueryLimits = QUERY_LIMITS) -> dict:
    """Settings of every DuckDB instance that runs someone's SQL, locked once it is open: no files but its
    own, no network, no extensions, no Python objects by name, bounded memory and threads."""
    return {
        "enable_external_access": False, "autoload_known_extensions": False, "autoinstall_known_extensions": False,
        "allow_community_extensions": False, "python_enable_replacements": False,
        "memory_limit": f"{limits.memory_bytes}B", "max_temp_directory_size": "0B", "threads": limits.threads,
        "lock_configuration": True,
    }  # fmt: skip


MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "findings, windows and sink offsets",
        """
        CREATE TABLE findings (
            id VARCHAR PRIMARY KEY,
            job VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            steps INTEGER[],
            window_steps INTEGER,
            scope VARCHAR NOT NULL,
            workers INTEGER[],
            hosts VARCHAR[],
            devices VARCHAR[],
            peer_group MAP(VARCHAR, VARCHAR),
            function VARCHAR,
            function_kind VARCHAR,
            cause VARCHAR NOT NULL,
            confidence DOUBLE,
            evidence JSON,
            step_time_share DOUBLE,
            gpu_hours_per_day DOUBLE,
            policy VARCHAR,
            summary VARCHAR,
            created_at TIMESTAMP,
            record JSON,
            first_seen TIMESTAMP,
            updated_at TIMESTAMP
        );
        CREATE TABLE windows (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            start_step BIGINT,
            steps INTEGER,
            steps_seen INTEGER,
            expected_workers INTEGER,
            workers_seen INTEGER,
            coverage DOUBLE,
            bytes_per_worker DOUBLE,
            findings INTEGER,
            actionable BOOLEAN,
            reached_device BOOLEAN,
            closed VARCHAR,
            closed_at TIMESTAMP,
            policy VARCHAR,
            PRIMARY KEY (job, window_id)
        );
        CREATE TABLE sink_offsets (
            topic VARCHAR NOT NULL,
            "partition" INTEGER NOT NULL,
            next_offset BIGINT NOT NULL,
            PRIMARY KEY (topic, "partition")
        );
        """,
    ),
    (
        2,
        "triggers, incidents, webhook deliveries, profiling overhead, views",
        """
        ALTER TABLE findings ADD COLUMN incident_id VARCHAR;
        ALTER TABLE windows ADD COLUMN profiling_overhead DOUBLE;
        ALTER TABLE windows ADD COLUMN incidents_checked BOOLEAN DEFAULT false;
        CREATE TABLE triggers (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            start_step BIGINT,
            steps INTEGER,
            expected_workers INTEGER,
            policy VARCHAR,
            reason VARCHAR,
            hardware_hz DOUBLE,
            record_shapes BOOLEAN,
            with_stack BOOLEAN,
            created_at TIMESTAMP,
            PRIMARY KEY (job, window_id)
        );
        CREATE TABLE incidents (
            id VARCHAR PRIMARY KEY,
            key VARCHAR NOT NULL,
            occurrence INTEGER NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            scope VARCHAR,
            cause VARCHAR,
            function VARCHAR,
            workers INTEGER[],
            hosts VARCHAR[],
            devices VARCHAR[],
            status VARCHAR NOT NULL,
            opened_at TIMESTAMP,
            last_seen_at TIMESTAMP,
            resolved_at TIMESTAMP,
            resolved_by VARCHAR,
            resolved_step BIGINT,
            first_finding VARCHAR,
            last_finding VARCHAR,
            last_step BIGINT,
            windows INTEGER,
            confidence DOUBLE,
            step_time_share DOUBLE,
            gpu_hours_per_day DOUBLE
        );
        CREATE TABLE incident_events (
            seq BIGINT PRIMARY KEY,
            incident_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            action VARCHAR NOT NULL,
            finding_id VARCHAR,
            reason VARCHAR,
            occurred_at TIMESTAMP
        );
        CREATE TABLE webhook_deliveries (
            id VARCHAR PRIMARY KEY,
            event_seq BIGINT NOT NULL,
            route VARCHAR NOT NULL,
            receiver VARCHAR NOT NULL,
            action VARCHAR NOT NULL,
            incident_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            severity VARCHAR,
            status VARCHAR NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_at TIMESTAMP,
            last_status INTEGER,
            last_error VARCHAR,
            created_at TIMESTAMP,
            delivered_at TIMESTAMP,
            payload JSON
        );
        CREATE TABLE pager_cursor (
            name VARCHAR PRIMARY KEY,
            last_seq BIGINT NOT NULL
        );
        CREATE VIEW open_findings AS
            SELECT f.*, i.opened_at, i.windows AS windows_seen, i.occurrence
            FROM incidents i JOIN findings f ON f.id = i.last_finding
            WHERE i.status = 'open';
        CREATE VIEW top_culprits AS
            WITH named AS (
                SELECT tenant, job, incident_id, cause, created_at, hosts,
                       unnest(CASE WHEN len(devices) > 0 THEN devices ELSE [NULL::VARCHAR] END) AS device
                FROM findings WHERE scope <> 'job'
            ), per_incident AS (
                SELECT tenant,
                       CASE WHEN len(hosts) = 1 THEN hosts[1]
                            ELSE list_filter(hosts, lambda h: starts_with(device, h || '/'))[1] END AS host,
                       device, incident_id, any_value(job) AS job, any_value(cause) AS cause,
                       count(*) AS findings, max(created_at) AS last_seen
                FROM named GROUP BY ALL
            )
            SELECT p.tenant, p.host, p.device, count(*) AS incidents,
                   count(*) FILTER (WHERE i.status = 'open') AS open_incidents,
                   sum(p.findings) AS findings,
                   list(DISTINCT p.cause ORDER BY p.cause) AS causes,
                   list(DISTINCT p.job ORDER BY p.job) AS jobs,
                   coalesce(sum(i.gpu_hours_per_day) FILTER (WHERE i.status = 'open'), 0) AS gpu_hours_per_day,
                   max(p.last_seen) AS last_seen
            FROM per_incident p LEFT JOIN incidents i ON i.id = p.incident_id
            GROUP BY p.tenant, p.host, p.device;
        CREATE VIEW gpu_hours_lost_by_cause AS
            SELECT tenant, cause, count(*) AS incidents,
                   count(*) FILTER (WHERE status = 'open') AS open_incidents,
                   coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0) AS gpu_hours_per_day,
                   sum(gpu_hours_per_day * epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at) / 86400) AS gpu_hours_lost
            FROM incidents GROUP BY tenant, cause;
        CREATE VIEW coverage_by_job AS
            SELECT tenant, job, count(*) AS windows,
                   avg(coverage) AS mean_coverage, min(coverage) AS min_coverage,
                   avg(bytes_per_worker) AS mean_bytes_per_worker,
                   avg(profiling_overhead) AS mean_profiling_overhead,
                   avg(reached_device::INTEGER) AS reached_device_share,
                   count(*) FILTER (WHERE closed = 'timeout') AS timed_out,
                   max(closed_at) AS last_closed_at
            FROM windows GROUP BY tenant, job;
        CREATE VIEW actionable_share AS
            SELECT tenant, job, count(*) AS windows,
                   count(*) FILTER (WHERE actionable) AS actionable_windows,
                   avg(actionable::INTEGER) AS actionable_share
            FROM windows GROUP BY tenant, job;
        """,
    ),
    (
        3,
        "triggers.kind: what opened each window (slowdown, hang, manual, baseline)",
        """
        ALTER TABLE triggers ADD COLUMN kind VARCHAR;
        UPDATE triggers SET kind = nullif(regexp_extract(reason, '^(slowdown|hang|manual|baseline)', 1), '');
        """,
    ),
    (
        4,
        "step_series (per-job step times) and window_deviations (per-window heatmaps), for the pictures",
        """
        CREATE TABLE step_series (
            job VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            step BIGINT NOT NULL,
            step_time_us DOUBLE,
            median_us DOUBLE,
            workers INTEGER,
            received_at TIMESTAMP,
            PRIMARY KEY (job, step)
        );
        CREATE TABLE window_deviations (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            worker INTEGER NOT NULL,
            function VARCHAR NOT NULL,
            worker_rank INTEGER,
            function_rank INTEGER,
            z DOUBLE,
            flagged_steps INTEGER,
            workers_total INTEGER,
            functions_total INTEGER,
            PRIMARY KEY (job, window_id, worker, function)
        );
        """,
    ),
]


def epoch_us(epoch: float | None) -> int | None:
    return None if epoch is None else int(epoch * 1e6)


_FINDING_SCHEMA = pa.schema(
    [
        ("id", pa.string()), ("job", pa.string()), ("tenant", pa.string()), ("window_id", pa.string()),
        ("steps", pa.list_(pa.int32())), ("window_steps", pa.int32()), ("scope", pa.string()),
        ("workers", pa.list_(pa.int32())), ("hosts", pa.list_(pa.string())), ("devices", pa.list_(pa.string())),
        ("peer_group", pa.map_(pa.string(), pa.string())), ("function", pa.string()), ("function_kind", pa.string()),
        ("cause", pa.string()), ("confidence", pa.float64()), ("evidence", pa.string()), ("step_time_share", pa.float64()),
        ("gpu_hours_per_day", pa.float64()), ("policy", pa.string()), ("summary", pa.string()),
        ("created_at", pa.timestamp("us")), ("record", pa.string()), ("first_seen", pa.timestamp("us")),
        ("updated_at", pa.timestamp("us")), ("incident_id", pa.string()),
    ]
)  # fmt: skip
_WINDOW_SCHEMA = pa.schema(
    [
        ("job", pa.string()), ("window_id", pa.string()), ("tenant", pa.string()), ("start_step", pa.int64()),
        ("steps", pa.int32()), ("steps_seen", pa.int32()), ("expected_workers", pa.int32()), ("workers_seen", pa.int32()),
        ("coverage", pa.float64()), ("bytes_per_worker", pa.float64()), ("findings", pa.int32()), ("actionable", pa.bool_()),
        ("reached_device", pa.bool_()), ("closed", pa.string()), ("closed_at", pa.timestamp("us")), ("policy", pa.string()),
        ("profiling_overhead", pa.float64()),
    ]
)  # fmt: skip
_TRIGGER_SCHEMA = pa.schema(
    [
        ("job", pa.string()), ("window_id", pa.string()), ("tenant", pa.string()), ("start_step", pa.int64()),
        ("steps", pa.int32()), ("expected_workers", pa.int32()), ("policy", pa.string()), ("reason", pa.string()),
        ("hardware_hz", pa.float64()), ("record_shapes", pa.bool_()), ("with_stack", pa.bool_()), ("created_at", pa.timestamp("us")),
        ("kind", pa.string()),
    ]
)  # fmt: skip
_INCIDENT_SCHEMA = pa.schema(
    [
        ("id", pa.string()), ("key", pa.string()), ("occurrence", pa.int32()), ("tenant", pa.string()), ("job", pa.string()),
        ("scope", pa.string()), ("cause", pa.string()), ("function", pa.string()), ("workers", pa.list_(pa.int32())),
        ("hosts", pa.list_(pa.string())), ("devices", pa.list_(pa.string())), ("status", pa.string()),
        ("opened_at", pa.timestamp("us")), ("last_seen_at", pa.timestamp("us")), ("resolved_at", pa.timestamp("us")),
        ("resolved_by", pa.string()), ("resolved_step", pa.int64()), ("first_finding", pa.string()), ("last_finding", pa.string()),
        ("last_step", pa.int64()), ("windows", pa.int32()), ("confidence", pa.float64()), ("step_time_share", pa.float64()),
        ("gpu_hours_per_day", pa.float64()),
    ]
)  # fmt: skip
_EVENT_SCHEMA = pa.schema(
    [
        ("seq", pa.int64()), ("incident_id", pa.string()), ("tenant", pa.string()), ("job", pa.string()),
        ("action", pa.string()), ("finding_id", pa.string()), ("reason", pa.string()), ("occurred_at", pa.timestamp("us")),
    ]
)  # fmt: skip
_INCIDENT_TIMES = ("opened_at", "last_seen_at", "resolved_at")
#: the incidents columns as Incident fields (timestamps as epoch seconds)
_INCIDENT_SELECT = ", ".join(f"epoch({c}) AS {c}" if c in _INCIDENT_TIMES else c for c in _INCIDENT_SCHEMA.names)


_SERIES_SCHEMA = pa.schema(
    [
        ("job", pa.string()), ("tenant", pa.string()), ("step", pa.int64()), ("step_time_us", pa.float64()),
        ("median_us", pa.float64()), ("workers", pa.int32()), ("received_at", pa.timestamp("us")),
    ]
)  # fmt: skip
_DEVIATION_SCHEMA = pa.schema(
    [
        ("job", pa.string()), ("window_id", pa.string()), ("tenant", pa.string()), ("worker", pa.int32()), ("function", pa.string()),
        ("worker_rank", pa.int32()), ("function_rank", pa.int32()), ("z", pa.float64()), ("flagged_steps", pa.int32()),
        ("workers_total", pa.int32()), ("functions_total", pa.int32()),
    ]
)  # fmt: skip


def series_table(series: list[StepSeries], now: float) -> pa.Table:
    """Step-time points, one row per job and step (a step sent twice: the last one wins)."""
    rows = {(s.job, step): (s.tenant, t, m, n) for s in series for step, t, m, n in zip(s.steps, s.step_time_us, s.median_us, s.workers)}
    return pa.Table.from_pydict(
        {"job": [k[0] for k in rows], "tenant": [v[0] for v in rows.values()], "step": [k[1] for k in rows],
         "step_time_us": [v[1] for v in rows.values()], "median_us": [v[2] for v in rows.values()],
         "workers": [v[3] for v in rows.values()], "received_at": [epoch_us(now)] * len(rows)},
        schema=_SERIES_SCHEMA,
    )  # fmt: skip


def deviations_table(maps: list[DeviationMap]) -> pa.Table:
    """Heatmap cells, one row per (job, window, worker, function) of each map; never-flagged cells have no z."""
    rows = [
        {"job": d.job, "window_id": d.window, "tenant": d.tenant, "worker": w, "function": f, "worker_rank": i, "function_rank": j,
         "z": d.z[i][j], "flagged_steps": d.flagged[i][j], "workers_total": d.workers_total, "functions_total": d.functions_total}
        for d in maps for i, w in enumerate(d.workers) for j, f in enumerate(d.functions)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=_DEVIATION_SCHEMA)


def findings_table(findings: list[Finding], now: float, incident_ids: dict[str, str] | None = None) -> pa.Table:
    """Findings as an Arrow table with the columns of the ``findings`` table."""
    enc = msgspec.json.Encoder()
    ids = incident_ids or {}
    rows = [
        {
            "id": f.id, "job": f.job, "tenant": f.tenant, "window_id": f.window, "steps": f.steps, "window_steps": f.window_steps,
            "scope": f.scope, "workers": f.workers, "hosts": f.hosts, "devices": f.devices,
            "peer_group": list(f.group.items()) if f.group else None, "function": f.function, "function_kind": f.function_kind,
            "cause": f.cause, "confidence": f.confidence, "evidence": enc.encode(f.evidence).decode(),
            "step_time_share": f.impact.step_time_share, "gpu_hours_per_day": f.impact.gpu_hours_per_day, "policy": f.policy,
            "summary": f.summary, "created_at": epoch_us(f.created_at), "record": enc.encode(f).decode(), "first_seen": epoch_us(now),
            "updated_at": epoch_us(now), "incident_id": ids.get(f.id),
        }
        for f in findings
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=_FINDING_SCHEMA)


def windows_table(reports: list[WindowReport]) -> pa.Table:
    rows = [{c: getattr(r, c, None) for c in _WINDOW_SCHEMA.names} | {"window_id": r.window, "closed_at": epoch_us(r.closed_at)} for r in reports]
    return pa.Table.from_pylist(rows, schema=_WINDOW_SCHEMA)


def triggers_table(triggers: list[ProfileTrigger]) -> pa.Table:
    rows = [
        {
            "job": t.job, "window_id": t.window, "tenant": t.tenant, "start_step": t.start_step, "steps": t.steps,
            "expected_workers": t.expected_workers, "policy": t.policy_ref, "reason": t.reason,
            "hardware_hz": t.sampling.hardware_hz, "record_shapes": t.sampling.record_shapes,
            "with_stack": t.sampling.with_stack, "created_at": epoch_us(t.created_at), "kind": t.kind,
        }
        for t in triggers
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=_TRIGGER_SCHEMA)


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """BEGIN ... COMMIT, or ROLLBACK and re-raise."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, name: str, rows: pa.Table) -> Iterator[str]:
    """``rows`` readable as ``name`` while the block runs (explicitly: Python replacement scans are off)."""
    con.complete()  # a result that execute() left unread would refuse the registration
    con.register(name, rows)
    try:
        yield name
    finally:
        con.unregister(name)


def upsert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table, key: tuple[str, ...], keep: tuple[str, ...] = ()) -> None:
    """INSERT the Arrow rows; on a key conflict update every column except ``key`` and ``keep``."""
    cols = ", ".join(f'"{c}"' for c in rows.column_names)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in rows.column_names if c not in key + keep)
    on_conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
    keys = ", ".join(f'"{c}"' for c in key)
    with registered(con, "_rows", rows):
        con.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM _rows ON CONFLICT ({keys}) {on_conflict}")


@dataclass
class Batch:
    """What one sink transaction writes."""

    findings: list[Finding]
    windows: list[WindowReport]
    offsets: dict[tuple[str, int], int]  # (topic, partition) -> next offset to read
    triggers: list[ProfileTrigger] = field(default_factory=list)
    series: list[StepSeries] = field(default_factory=list)
    maps: list[DeviationMap] = field(default_factory=list)

    @classmethod
    def of(cls, records: list, offsets: dict[tuple[str, int], int]) -> Batch:
        """Decoded records, each into its list by type."""
        b = cls(findings=[], windows=[], offsets=offsets)
        lists = {Finding: b.findings, WindowReport: b.windows, ProfileTrigger: b.triggers, StepSeries: b.series, DeviationMap: b.maps}
        for rec in records:
            lists[type(rec)].append(rec)
        return b


class FindingsStore:
    """The read-write owner of the DuckDB file (the sink)."""

    def __init__(self, path: Path | str, policy: IncidentPolicy | None = None, limits: QueryLimits = QUERY_LIMITS,
                 series_keep_steps: int = 20_000):  # fmt: skip
        self.path = Path(path)
        self.policy = policy or IncidentPolicy()
        self.limits = limits
        self.series_keep_steps = series_keep_steps
        self._slots = threading.BoundedSemaphore(limits.concurrent)
        self._running: set[duckdb.DuckDBPyConnection] = set()
        self._closing = False
        try:
            self.con = duckdb.connect(str(self.path), config=duckdb_config(limits))
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreLocked(f"{self.path} is held by another process (is a sink already running?)") from None
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        self.migrate()

    def migrate(self) -> int:
        con = self.con
        tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()").fetchall()}
        if tables and "schema_migrations" not in tables:  # someone else's DuckDB file: never add our tables to it
            con.close()
            raise StoreError(f"{self.path} is a DuckDB file but not a findings store (it has tables {', '.join(sorted(tables)[:5])}); name another file")
        con.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)")
        done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            with transaction(con):
                con.execute(sql)
                if version == 2:
                    self._backfill_incidents()
                con.execute("INSERT INTO schema_migrations VALUES (?, ?, now())", [version, description])
            log.info("migrated %s to version %d: %s", self.path, version, description)
        return max((v for v, _, _ in MIGRATIONS), default=0)

    def offsets(self) -> dict[tuple[str, int], int]:
        return {(t, p): o for t, p, o in self.con.execute('SELECT topic, "partition", next_offset FROM sink_offsets').fetchall()}

    def write(self, batch: Batch, now: float | None = None) -> list[Event]:
        """Upsert findings, windows and triggers, keep the incidents, record offsets: one transaction.

        Returns the incident events it appended (the pager's input).  Queries share the instance's memory
        bound: when they hold it, the transaction is tried again until the longest query's time is up."""
        deadline = time.monotonic() + self.limits.timeout_s
        while True:
            try:
                return self._write(batch, now)
            except duckdb.OutOfMemoryException:
                if time.monotonic() >= deadline:
                    raise
                log.warning("the findings store is out of memory (queries hold it); writing again in 0.5 s")
                time.sleep(0.5)

    def _write(self, batch: Batch, now: float | None) -> list[Event]:
        now = time.time() if now is None else now
        con = self.con
        # the same key twice in one statement is an error for ON CONFLICT: the last one wins
        findings = list({f.id: f for f in batch.findings}.values())
        windows = list({(w.job, w.window): w for w in batch.windows}.values())
        triggers = list({(t.job, t.window): t for t in batch.triggers}.values())
        with transaction(con):
            known = set()
            if findings:
                ids = [f.id for f in findings]
                known = {r[0] for r in con.execute("SELECT id FROM findings WHERE list_contains(?, id)", [ids]).fetchall()}
            incidents, events, incident_ids = self._on_findings([f for f in findings if f.id not in known])
            if findings:
                upsert(con, "findings", findings_table(findings, now, incident_ids), ("id",), keep=("first_seen", "incident_id"))
            if windows:
                upsert(con, "windows", windows_table(windows), ("job", "window_id"))
            if triggers:
                upsert(con, "triggers", triggers_table(triggers), ("job", "window_id"))
            if batch.series:
                upsert(con, "step_series", series_table(batch.series, now), ("job", "step"))
            if batch.maps:
                maps = list({(d.job, d.window): d for d in batch.maps}.values())
                with registered(con, "_done", pa.table({"job": [d.job for d in maps], "window_id": [d.window for d in maps]})):
                    con.execute("DELETE FROM window_deviations USING _done d WHERE window_deviations.job = d.job AND window_deviations.window_id = d.window_id")
                with registered(con, "_rows", deviations_table(maps)):
                    con.execute("INSERT INTO window_deviations SELECT * FROM _rows")
            if batch.offsets:
                offsets = {"topic": [t for t, _ in batch.offsets], "partition": pa.array([p for _, p in batch.offsets], pa.int32()),
                           "next_offset": list(batch.offsets.values())}  # fmt: skip
                upsert(con, "sink_offsets", pa.table(offsets), ("topic", "partition"))
            events += self._on_windows(incidents)
            self._save(incidents, events)
        return events

    def expire(self, now: float | None = None) -> list[Event]:
        """Resolve open incidents that no window has seen for ``policy.stale_after_s`` (one transaction)."""
        now = time.time() if now is None else now
        con = self.con
        with transaction(con):
            stale = self._incidents("status = 'open' AND epoch(last_seen_at) <= ?", [now - self.policy.stale_after_s])
            changes = on_clock(stale, now, self.policy)
            incidents = {inc.id: inc for inc, _ in changes}
            events = [ev for _, ev in changes]
            self._save(incidents, events)
            # each job's step-time series keeps its last series_keep_steps steps
            con.execute("DELETE FROM step_series s USING (SELECT job, max(step) AS last FROM step_series GROUP BY job) l "
                        "WHERE s.job = l.job AND s.step <= l.last - ?", [self.series_keep_steps])  # fmt: skip
        return events

    # -------------------------------------------------------------- incidents (inside the caller's transaction)

    def _incidents(self, where: str, params: list) -> list[Incident]:
        cur = self.con.execute(f"SELECT {_INCIDENT_SELECT} FROM incidents WHERE {where}", params)
        cols = [d[0] for d in cur.description]
        return [Incident(**dict(zip(cols, r))) for r in cur.fetchall()]

    def _on_findings(self, new: list[Finding]) -> tuple[dict[str, Incident], list[Event], dict[str, str]]:
        """Apply findings never stored before to the latest occurrence of their incident."""
        if not new:
            return {}, [], {}
        new.sort(key=lambda f: (f.created_at, min(f.steps, default=0)))
        keys = sorted({incident_key(f) for f in new})
        latest = {
            inc.key: inc
            for inc in self._incidents("list_contains(?, key) QUALIFY row_number() OVER (PARTITION BY key ORDER BY occurrence DESC) = 1", [keys])
        }
        changed: dict[str, Incident] = {}
        events: list[Event] = []
        incident_ids: dict[str, str] = {}
        for f in new:
            key = incident_key(f)
            inc, ev = on_finding(latest.get(key), f)
            incident_ids[f.id] = inc.id
            if ev is not None:
                latest[key] = changed[inc.id] = inc
                events.append(ev)
        return changed, events, incident_ids

    def _on_windows(self, incidents: dict[str, Incident]) -> list[Event]:
        """Resolve, for every window whose findings are all stored, the open incidents it did not see.

        A window counts once all of its findings are in (``windows.findings``), or once a later window
        of the job is: findings and window reports travel on different topics and may arrive in either order.
        """
        rows = self.con.execute(
            """
            SELECT tenant, job, window_id, start_step, coverage, epoch(closed_at) FROM windows w
            WHERE NOT coalesce(incidents_checked, false) AND (
                (SELECT count(*) FROM findings f WHERE f.job = w.job AND f.window_id = w.window_id) >= w.findings
                OR EXISTS (SELECT 1 FROM windows l WHERE l.job = w.job AND l.start_step > w.start_step))
            ORDER BY start_step
            """
        ).fetchall()
        if not rows:
            return []
        closed = [ClosedWindow(*r) for r in rows]
        jobs = sorted({w.job for w in closed})
        state = {inc.id: inc for inc in self._incidents("status = 'open' AND list_contains(?, job)", [jobs])}
        state.update(incidents)  # this transaction's changes are newer
        events = []
        for w in closed:
            for inc, ev in on_window([i for i in state.values() if i.job == w.job], w, self.policy):
                state[inc.id] = incidents[inc.id] = inc
                events.append(ev)
        done = pa.table({"job": [w.job for w in closed], "window_id": [w.window for w in closed]})
        with registered(self.con, "_done", done):
            self.con.execute("UPDATE windows SET incidents_checked = true FROM _done d WHERE windows.job = d.job AND windows.window_id = d.window_id")
        return events

    def _save(self, incidents: dict[str, Incident], events: list[Event]) -> None:
        con = self.con
        if incidents:
            rows = [dataclasses.asdict(i) | {c: epoch_us(getattr(i, c)) for c in _INCIDENT_TIMES} for i in incidents.values()]
            upsert(con, "incidents", pa.Table.from_pylist(rows, schema=_INCIDENT_SCHEMA), ("id",))
        if events:
            seq = con.execute("SELECT coalesce(max(seq), 0) FROM incident_events").fetchone()[0]
            rows = [dataclasses.asdict(e) | {"seq": seq + i + 1, "occurred_at": epoch_us(e.occurred_at)} for i, e in enumerate(events)]
            upsert(con, "incident_events", pa.Table.from_pylist(rows, schema=_EVENT_SCHEMA), ("seq",))

    def _backfill_incidents(self) -> None:
        """Migration 2: build the incidents of an existing file from its findings and windows, without events.

        All findings first (in time order), then every window (in step order)."""
        dec = msgspec.json.Decoder(Finding)
        records = [dec.decode(r[0]) for r in self.con.execute("SELECT record FROM findings").fetchall()]
        incidents, _, incident_ids = self._on_findings(records)
        self._on_windows(incidents)
        if incident_ids:
            ids = pa.table({"id": list(incident_ids), "incident_id": list(incident_ids.values())})
            with registered(self.con, "_ids", ids):
                self.con.execute("UPDATE findings SET incident_id = i.incident_id FROM _ids i WHERE findings.id = i.id")
        self._save(incidents, [])

    def query(self, sql: str, params: list | None = None, tenant: str | None = None) -> tuple[list[str], list[tuple]]:
        """Someone's read-only SQL, on a connection of its own, within :attr:`limits` (:func:`run_query`).

        Raises QueryBusy when ``limits.concurrent`` queries are running already, StoreError when the SQL is
        not allowed or breaks a limit."""
        if self._closing:
            raise QueryBusy("the sink is stopping")
        if not self._slots.acquire(timeout=1.0):
            raise QueryBusy(f"{self.limits.concurrent} queries are running, the most the sink runs at once; ask again in a moment")
        try:
            cur = self.con.cursor()
            self._running.add(cur)
            try:
                return run_query(cur, sql, params, tenant, self.limits)
            finally:
                self._running.discard(cur)
                cur.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Interrupt the queries that run (a query must not hold up a shutdown), wait for them to end, close."""
        self._closing = True
        for cur in list(self._running):
            cur.interrupt()
        for _ in range(self.limits.concurrent):
            self._slots.acquire(timeout=self.limits.timeout_s)
        self.con.close()


# ------------------------------------------------------------------ read-only access

#: statements someone's SQL may be (DuckDB's parser says which): a query, or EXPLAIN of one
ALLOWED_STATEMENTS = ("SELECT", "EXPLAIN")
_EXPLAIN = re.compile(r"\s*EXPLAIN\s*(?:\([^)]*\)\s*)?(?:ANALY[SZ]E\b)?", re.IGNORECASE)


#: table functions a query may call: generators and the catalog.  Every other one is refused: the file readers
#: (``read_blob``, ``read_csv``, ``glob``, ...) would reach the sink's own database file, which DuckDB lets them
#: read even without external access, and the sink closing a handle of it would drop its lock on the file
#: (POSIX locks belong to the process); ``query()`` runs SQL that cannot be checked here.
TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "json_each", "json_tree", "duckdb_tables", "duckdb_views", "duckdb_columns",
    "duckdb_constraints", "duckdb_indexes", "duckdb_schemas", "duckdb_databases", "duckdb_types", "duckdb_functions",
    "duckdb_keywords", "pragma_table_info",
})  # fmt: skip
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_relations(con: duckdb.DuckDBPyConnection, select: str) -> None:
    """Every relation a SELECT reads (DuckDB's own parse tree) is a table, view or CTE by name, or an allowed
    table function; a quoted name with a dot or a slash would be a file (``FROM 'x.duckdb'``)."""
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?::VARCHAR)", [select]).fetchone()[0])
    except (duckdb.Error, RecursionError, ValueError) as exc:
        raise StoreError(f"the query cannot be checked ({type(exc).__name__}); simplify it") from None
    if tree.get("error"):
        raise StoreError(f"the query cannot be checked: {tree.get('error_message', 'not a plain SELECT')}")
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "TABLE_FUNCTION":
            name = str((node.get("function") or {}).get("function_name", ""))
            if name.lower() not in TABLE_FUNCTIONS:
                raise StoreError(f"table function {name}() is disabled in queries (reading files, running SQL from text); "
                                 f"allowed: {', '.join(sorted(TABLE_FUNCTIONS))}")  # fmt: skip
        elif kind == "BASE_TABLE" and not _IDENTIFIER.fullmatch(str(node.get("table_name", ""))):
            raise StoreError(f"{str(node.get('table_name'))[:80]!r} is not a table name (reading files is disabled in queries)")
        stack.extend(node.values())


def _statements(con: duckdb.DuckDBPyConnection, sql: str) -> list:
    try:
        return con.extract_statements(sql)
    except duckdb.Error as exc:
        raise StoreError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None


def _kind(statement) -> str:
    return str(statement.type).split(".")[-1]


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Allow exactly one statement, a SELECT (``WITH``, ``FROM``-first, ``VALUES``, ``DESCRIBE``, ``SUMMARIZE`` are
    SELECTs to DuckDB) or EXPLAIN of a SELECT, ANALYZE or not: ``EXPLAIN ANALYZE`` runs its statement, so what
    it explains must be a query too.  Everything else is refused (PRAGMA, SET, ATTACH, COPY, INSTALL, LOAD, CALL, ...),
    and so is a SELECT that reads anything but tables, views and :data:`TABLE_FUNCTIONS`."""
    statements = _statements(con, sql)
    if not statements:
        raise StoreError("no SQL statement given")
    if len(statements) > 1:
        raise StoreError(f"one read-only statement at a time, got {len(statements)}")
    kind = _kind(statements[0])
    if kind not in ALLOWED_STATEMENTS:
        raise StoreError(f"only read-only queries are allowed (SELECT, EXPLAIN SELECT); got {kind}")
    select = statements[0].query
    if kind == "EXPLAIN":
        explain = _EXPLAIN.match(select)
        try:
            inner = _statements(con, select[explain.end() :]) if explain else []
        except StoreError:  # what follows EXPLAIN [(options)] [ANALYZE] is no statement on its own
            inner = []
        if len(inner) != 1 or _kind(inner[0]) != "SELECT":
            raise StoreError("EXPLAIN only of a SELECT (EXPLAIN ANALYZE runs the statement it explains)")
        select = inner[0].query
    _check_relations(con, select)


def tenant_sandbox(src: duckdb.DuckDBPyConnection, tenant: str, limits: QueryLimits = QUERY_LIMITS) -> duckdb.DuckDBPyConnection:
    """A new in-memory database holding only ``tenant``'s rows, locked down before any user SQL runs.

    Every table with a ``tenant`` column is copied with its own DDL and only that tenant's rows; tables
    without one (offsets, migrations, the pager's cursor) are left out; the views are recreated from the
    file's own definitions.  The instance has no file or network access, no extensions, no Python
    replacement scans, the memory and threads of ``limits``, and its configuration locked.  Rows of other
    tenants are not in this database, so no SQL run in it (``query()``, ``duckdb_tables()``, subqueries) can reach them.
    """
    box = duckdb.connect(":memory:", config=duckdb_config(limits))
    here = "table_catalog = current_database() AND table_schema = 'main'"
    tenanted = {r[0] for r in src.execute(f"SELECT table_name FROM information_schema.columns WHERE {here} AND column_name = 'tenant'").fetchall()}
    tables = src.execute("SELECT table_name, sql FROM duckdb_tables() WHERE database_name = current_database() AND schema_name = 'main'").fetchall()
    for name, ddl in (t for t in tables if t[0] in tenanted):
        box.execute(ddl)
        with registered(box, "_rows", src.sql(f'SELECT * FROM "{name}" WHERE tenant = $1', params=[tenant]).to_arrow_table()):
            box.execute(f'INSERT INTO "{name}" SELECT * FROM _rows')
    views = src.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND database_name = current_database() AND schema_name = 'main'"
    ).fetchall()
    for name, ddl in views:
        try:
            box.execute(ddl)
        except duckdb.CatalogException:  # it reads a table that tenants do not see
            log.debug("view %s left out of the tenant sandbox", name)
    return box


class _Deadline:
    """Interrupts the connection a query runs on once ``timeout_s`` have passed (DuckDB stops at its next vector)."""

    def __init__(self, timeout_s: float):
        self.fired = False
        self._con: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            self._con = con
            if self.fired:
                con.interrupt()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            if self._con is not None:
                self._con.interrupt()

    def cancel(self) -> None:
        self._timer.cancel()


def run_query(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None, tenant: str | None = None,
              limits: QueryLimits = QUERY_LIMITS) -> tuple[list[str], list[tuple]]:  # fmt: skip
    """Someone's SQL, read-only: one allowed statement (:func:`check_read_only`) in a read-only transaction of
    ``con``; with ``tenant``, inside :func:`tenant_sandbox` (only that tenant's rows exist there).  Interrupted
    after ``limits.timeout_s``; a result of more than ``limits.max_rows`` rows is refused.  Raises StoreError."""
    check_read_only(con, sql)
    deadline = _Deadline(limits.timeout_s)
    box = None
    try:
        deadline.watch(con)
        con.execute("BEGIN TRANSACTION READ ONLY")
        try:
            if tenant is not None:
                box = tenant_sandbox(con, tenant, limits)
                deadline.watch(box)
            cur = box.execute(sql, params or []) if box is not None else con.execute(sql, params or [])
            cols = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchmany(limits.max_rows + 1)
        finally:
            con.execute("ROLLBACK")
    except duckdb.InterruptException:
        if not deadline.fired:
            raise StoreError("the query was interrupted (the sink is stopping)") from None
        raise StoreError(f"the query ran longer than {limits.timeout_s:g} s, the most a query may take") from None
    except duckdb.OutOfMemoryException:
        raise StoreError(f"the query needs more than {limits.memory_bytes >> 20} MiB, the most a query may use") from None
    except duckdb.Error as exc:
        raise StoreError(str(exc).splitlines()[0]) from None
    finally:
        deadline.cancel()
        if box is not None:
            box.close()
    if len(rows) > limits.max_rows:
        raise StoreError(f"the result has more than {limits.max_rows} rows, the most a query may return: add a LIMIT or aggregate")
    return cols, rows


def open_read_only(path: Path | str, limits: QueryLimits = QUERY_LIMITS) -> duckdb.DuckDBPyConnection:
    """The findings file, read-only, locked down (:func:`duckdb_config`): for commands that query it while no sink runs."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path} does not exist (run the demo or a sink first)")
    try:
        return duckdb.connect(str(path), read_only=True, config=duckdb_config(limits))
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise StoreLocked(f"{path} is held by a running sink") from None
        raise StoreError(f"cannot open {path}: {exc}") from None


def jsonable(value):
    """DuckDB values -> JSON-able values (timestamps as ISO strings, JSON columns parsed)."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
