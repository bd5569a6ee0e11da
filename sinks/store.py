"""The DuckDB findings store: versioned migrations, idempotent upserts, offsets in the same transaction.

One process (the sink) holds the file read-write.  Rows and the Kafka offsets
that produced them commit together, so after a crash the sink resumes exactly
where its last transaction ended: nothing lost, nothing twice.

SQL names follow the records, except where SQL reserves the word:
``Finding.window`` is the column ``window_id`` and ``Finding.group`` is ``peer_group``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import msgspec
import pyarrow as pa

from ..schemas.records import Finding, WindowReport

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The findings file cannot be opened or a query is not allowed."""


class StoreLocked(StoreError):
    """Another process (the running sink) holds the DuckDB file."""


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
]

_FINDING_COLS = [
    "id", "job", "tenant", "window_id", "steps", "window_steps", "scope", "workers", "hosts", "devices",
    "peer_group", "function", "function_kind", "cause", "confidence", "evidence", "step_time_share",
    "gpu_hours_per_day", "policy", "summary", "created_at", "record", "first_seen", "updated_at",
]  # fmt: skip
_FINDING_SCHEMA = pa.schema(
    [
        ("id", pa.string()), ("job", pa.string()), ("tenant", pa.string()), ("window_id", pa.string()),
        ("steps", pa.list_(pa.int32())), ("window_steps", pa.int32()), ("scope", pa.string()),
        ("workers", pa.list_(pa.int32())), ("hosts", pa.list_(pa.string())), ("devices", pa.list_(pa.string())),
        ("peer_group", pa.map_(pa.string(), pa.string())), ("function", pa.string()), ("function_kind", pa.string()),
        ("cause", pa.string()), ("confidence", pa.float64()), ("evidence", pa.string()), ("step_time_share", pa.float64()),
        ("gpu_hours_per_day", pa.float64()), ("policy", pa.string()), ("summary", pa.string()),
        ("created_at", pa.timestamp("us")), ("record", pa.string()), ("first_seen", pa.timestamp("us")),
        ("updated_at", pa.timestamp("us")),
    ]
)  # fmt: skip
_WINDOW_COLS = [
    "job", "window_id", "tenant", "start_step", "steps", "steps_seen", "expected_workers", "workers_seen",
    "coverage", "bytes_per_worker", "findings", "actionable", "reached_device", "closed", "closed_at", "policy",
]  # fmt: skip


def _ts(epoch: float) -> pa.TimestampScalar:
    return int(epoch * 1e6)


def findings_table(findings: list[Finding], now: float) -> pa.Table:
    """Findings as an Arrow table in the column order of the ``findings`` table."""
    enc = msgspec.json.Encoder()
    rows = {c: [] for c in _FINDING_COLS}
    for f in findings:
        rows["id"].append(f.id)
        rows["job"].append(f.job)
        rows["tenant"].append(f.tenant)
        rows["window_id"].append(f.window)
        rows["steps"].append(f.steps)
        rows["window_steps"].append(f.window_steps)
        rows["scope"].append(f.scope)
        rows["workers"].append(f.workers)
        rows["hosts"].append(f.hosts)
        rows["devices"].append(f.devices)
        rows["peer_group"].append(list(f.group.items()) if f.group else None)
        rows["function"].append(f.function)
        rows["function_kind"].append(f.function_kind)
        rows["cause"].append(f.cause)
        rows["confidence"].append(f.confidence)
        rows["evidence"].append(enc.encode(f.evidence).decode())
        rows["step_time_share"].append(f.impact.step_time_share)
        rows["gpu_hours_per_day"].append(f.impact.gpu_hours_per_day)
        rows["policy"].append(f.policy)
        rows["summary"].append(f.summary)
        rows["created_at"].append(_ts(f.created_at))
        rows["record"].append(enc.encode(f).decode())
        rows["first_seen"].append(_ts(now))
        rows["updated_at"].append(_ts(now))
    return pa.Table.from_pydict(rows, schema=_FINDING_SCHEMA)


def windows_table(reports: list[WindowReport]) -> pa.Table:
    rows = {c: [] for c in _WINDOW_COLS}
    for r in reports:
        for c in _WINDOW_COLS:
            if c == "window_id":
                rows[c].append(r.window)
            elif c == "closed_at":
                rows[c].append(_ts(r.closed_at))
            else:
                rows[c].append(getattr(r, c))
    t = pa.Table.from_pydict(rows)
    return t.set_column(t.schema.get_field_index("closed_at"), "closed_at", t.column("closed_at").cast(pa.int64()).cast(pa.timestamp("us")))


@dataclass
class Batch:
    """What one sink transaction writes."""

    findings: list[Finding]
    windows: list[WindowReport]
    offsets: dict[tuple[str, int], int]  # (topic, partition) -> next offset to read


class FindingsStore:
    """The read-write owner of the DuckDB file (the sink)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self.con = duckdb.connect(str(self.path))
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreLocked(f"{self.path} is held by another process (is a sink already running?)") from None
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        self.migrate()

    def migrate(self) -> int:
        con = self.con
        con.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)")
        done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            con.execute("BEGIN TRANSACTION")
            try:
                con.execute(sql)
                con.execute("INSERT INTO schema_migrations VALUES (?, ?, now())", [version, description])
                con.execute("COMMIT")
                log.info("migrated %s to version %d: %s", self.path, version, description)
            except Exception:
                con.execute("ROLLBACK")
                raise
        return max((v for v, _, _ in MIGRATIONS), default=0)

    def offsets(self) -> dict[tuple[str, int], int]:
        return {(t, p): o for t, p, o in self.con.execute('SELECT topic, "partition", next_offset FROM sink_offsets').fetchall()}

    def write(self, batch: Batch, now: float | None = None) -> None:
        """Upsert findings and windows and record offsets, in one transaction."""
        now = time.time() if now is None else now
        con = self.con
        # the same id twice in one statement is an error for ON CONFLICT: the last one wins
        findings = list({f.id: f for f in batch.findings}.values())
        windows = list({(w.job, w.window): w for w in batch.windows}.values())
        con.execute("BEGIN TRANSACTION")
        try:
            if findings:
                ftab = findings_table(findings, now)  # noqa: F841 - scanned by DuckDB below
                updates = ", ".join(f"{c} = excluded.{c}" for c in _FINDING_COLS if c not in ("id", "first_seen"))
                con.execute(f"INSERT INTO findings SELECT * FROM ftab ON CONFLICT (id) DO UPDATE SET {updates}")
            if windows:
                wtab = windows_table(windows)  # noqa: F841
                cols = ", ".join(_WINDOW_COLS)
                updates = ", ".join(f"{c} = excluded.{c}" for c in _WINDOW_COLS if c not in ("job", "window_id"))
                con.execute(f"INSERT INTO windows ({cols}) SELECT {cols} FROM wtab ON CONFLICT (job, window_id) DO UPDATE SET {updates}")
            if batch.offsets:
                otab = pa.table(  # noqa: F841
                    {
                        "topic": [t for t, _ in batch.offsets],
                        "partition": pa.array([p for _, p in batch.offsets], pa.int32()),
                        "next_offset": list(batch.offsets.values()),
                    }
                )
                con.execute('INSERT INTO sink_offsets SELECT * FROM otab ON CONFLICT (topic, "partition") DO UPDATE SET next_offset = excluded.next_offset')
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.con.close()


# ------------------------------------------------------------------ read-only access

READ_ONLY_TYPES = ("SELECT", "EXPLAIN")


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise StoreError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None
    if not statements:
        raise StoreError("no SQL statement given")
    for s in statements:
        kind = str(s.type).split(".")[-1]
        if kind not in READ_ONLY_TYPES:
            raise StoreError(f"only read-only queries are allowed (SELECT, EXPLAIN); got {kind}")


def run_query(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> tuple[list[str], list[tuple]]:
    check_read_only(con, sql)
    try:
        cur = con.execute(sql, params or [])
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    except duckdb.Error as exc:
        raise StoreError(str(exc).splitlines()[0]) from None


def open_read_only(path: Path | str) -> duckdb.DuckDBPyConnection:
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path} does not exist (run the demo or a sink first)")
    try:
        return duckdb.connect(str(path), read_only=True)
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
