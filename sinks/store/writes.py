"""Writing the findings file: records as Arrow rows, upserts by key, transactions; what one sink transaction writes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import duckdb
import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.records import DeviationMap, Finding, JobChange, ProfileTrigger, StepSeries, WindowReport


def epoch_us(epoch: float | None) -> int | None:
    return None if epoch is None else int(epoch * 1e6)


_FINDING_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("job", pa.string()),
        ("tenant", pa.string()),
        ("window_id", pa.string()),
        ("steps", pa.list_(pa.int32())),
        ("window_steps", pa.int32()),
        ("scope", pa.string()),
        ("workers", pa.list_(pa.int32())),
        ("hosts", pa.list_(pa.string())),
        ("devices", pa.list_(pa.string())),
        ("peer_group", pa.map_(pa.string(), pa.string())),
        ("function", pa.string()),
        ("function_kind", pa.string()),
        ("cause", pa.string()),
        ("confidence", pa.float64()),
        ("evidence", pa.string()),
        ("step_time_share", pa.float64()),
        ("gpu_hours_per_day", pa.float64()),
        ("policy", pa.string()),
        ("summary", pa.string()),
        ("created_at", pa.timestamp("us")),
        ("record", pa.string()),
        ("first_seen", pa.timestamp("us")),
        ("updated_at", pa.timestamp("us")),
        ("incident_id", pa.string()),
    ]
)
_WINDOW_SCHEMA = pa.schema(
    [
        ("job", pa.string()),
        ("window_id", pa.string()),
        ("tenant", pa.string()),
        ("start_step", pa.int64()),
        ("steps", pa.int32()),
        ("steps_seen", pa.int32()),
        ("expected_workers", pa.int32()),
        ("workers_seen", pa.int32()),
        ("coverage", pa.float64()),
        ("bytes_per_worker", pa.float64()),
        ("findings", pa.int32()),
        ("actionable", pa.bool_()),
        ("reached_device", pa.bool_()),
        ("closed", pa.string()),
        ("closed_at", pa.timestamp("us")),
        ("policy", pa.string()),
        ("profiling_overhead", pa.float64()),
        ("closed_reason", pa.string()),
    ]
)
_TRIGGER_SCHEMA = pa.schema(
    [
        ("job", pa.string()),
        ("window_id", pa.string()),
        ("tenant", pa.string()),
        ("start_step", pa.int64()),
        ("steps", pa.int32()),
        ("expected_workers", pa.int32()),
        ("policy", pa.string()),
        ("reason", pa.string()),
        ("hardware_hz", pa.float64()),
        ("record_shapes", pa.bool_()),
        ("with_stack", pa.bool_()),
        ("created_at", pa.timestamp("us")),
        ("kind", pa.string()),
    ]
)
INCIDENT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("key", pa.string()),
        ("occurrence", pa.int32()),
        ("tenant", pa.string()),
        ("job", pa.string()),
        ("scope", pa.string()),
        ("cause", pa.string()),
        ("function", pa.string()),
        ("workers", pa.list_(pa.int32())),
        ("hosts", pa.list_(pa.string())),
        ("devices", pa.list_(pa.string())),
        ("status", pa.string()),
        ("opened_at", pa.timestamp("us")),
        ("last_seen_at", pa.timestamp("us")),
        ("resolved_at", pa.timestamp("us")),
        ("resolved_by", pa.string()),
        ("resolved_step", pa.int64()),
        ("first_finding", pa.string()),
        ("last_finding", pa.string()),
        ("last_step", pa.int64()),
        ("windows", pa.int32()),
        ("confidence", pa.float64()),
        ("step_time_share", pa.float64()),
        ("gpu_hours_per_day", pa.float64()),
        ("first_window", pa.string()),
        ("first_step", pa.int64()),
        ("first_trigger_at", pa.timestamp("us")),
        ("resolved_reason", pa.string()),
        ("after_s", pa.float64()),
        ("acked_at", pa.timestamp("us")),
        ("acked_by", pa.string()),
    ]
)
EVENT_SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("incident_id", pa.string()),
        ("tenant", pa.string()),
        ("job", pa.string()),
        ("action", pa.string()),
        ("finding_id", pa.string()),
        ("reason", pa.string()),
        ("occurred_at", pa.timestamp("us")),
    ]
)
INCIDENT_TIMES = ("opened_at", "last_seen_at", "resolved_at", "first_trigger_at", "acked_at")


#: the incidents columns as Incident fields (timestamps as epoch seconds)
def incident_select(columns: list[str]) -> str:
    """The SELECT list of these incidents columns as Incident fields (timestamps as epoch seconds)."""
    return ", ".join(f"epoch({c}) AS {c}" if c in INCIDENT_TIMES else c for c in columns)


INCIDENT_SELECT = incident_select(INCIDENT_SCHEMA.names)


_SERIES_SCHEMA = pa.schema(
    [
        ("job", pa.string()),
        ("tenant", pa.string()),
        ("step", pa.int64()),
        ("step_time_us", pa.float64()),
        ("median_us", pa.float64()),
        ("workers", pa.int32()),
        ("received_at", pa.timestamp("us")),
    ]
)
_DEVIATION_SCHEMA = pa.schema(
    [
        ("job", pa.string()),
        ("window_id", pa.string()),
        ("tenant", pa.string()),
        ("worker", pa.int32()),
        ("function", pa.string()),
        ("worker_rank", pa.int32()),
        ("function_rank", pa.int32()),
        ("z", pa.float64()),
        ("flagged_steps", pa.int32()),
        ("workers_total", pa.int32()),
        ("functions_total", pa.int32()),
    ]
)


_CHANGE_SCHEMA = pa.schema(
    [
        ("job", pa.string()),
        ("tenant", pa.string()),
        ("change", pa.string()),
        ("step", pa.int64()),
        ("window_id", pa.string()),
        ("onset_step", pa.int64()),
        ("onset_at", pa.timestamp("us")),
        ("before_s", pa.float64()),
        ("during_s", pa.float64()),
        ("after_s", pa.float64()),
        ("steps", pa.int32()),
        ("job_end", pa.string()),
        ("reason", pa.string()),
        ("changed_at", pa.timestamp("us")),
    ]
)


#: the ``job_changes`` row ``c`` that is the detector's ``slowdown`` news of the window ``t`` (a row of ``triggers``): its
#: own, else (a window asked again after every worker refused the one before, which the detector does not announce
#: twice) the job's latest slowdown news up to the trigger with no recovery or end of the job between them: the
#: detector keeps a slowdown's onset until it recovers or the job ends.  Order by :data:`SLOWDOWN_NEWS_FIRST`.
SLOWDOWN_NEWS_OF_TRIGGER = """c.job = t.job AND c.change = 'slowdown' AND (c.window_id = t.window_id OR (
    t.kind = 'slowdown' AND c.changed_at <= t.created_at AND NOT EXISTS (
        SELECT 1 FROM job_changes r WHERE r.job = t.job AND r.change IN ('recovered', 'ended')
          AND r.changed_at > c.changed_at AND r.changed_at <= t.created_at)))"""
#: the window's own news first, then the latest
SLOWDOWN_NEWS_FIRST = "(c.window_id = t.window_id) DESC, c.changed_at DESC, c.step DESC"


def changes_table(changes: list[JobChange]) -> pa.Table:
    """The detector's ``JobChange`` records, one row each (key: job, change, step, window)."""
    rows = [
        {c: getattr(ch, c, None) for c in _CHANGE_SCHEMA.names}
        | {
            "window_id": ch.window,
            "onset_at": epoch_us(ch.onset_at) if ch.onset_at else None,
            "job_end": ch.end,
            "changed_at": epoch_us(ch.at),
        }
        for ch in changes
    ]
    return pa.Table.from_pylist(rows, schema=_CHANGE_SCHEMA)


def series_table(series: list[StepSeries], now: float) -> pa.Table:
    """Step-time points, one row per job and step (a step sent twice: the last one wins)."""
    rows = {
        (s.job, step): (s.tenant, t, m, n)
        for s in series
        for step, t, m, n in zip(s.steps, s.step_time_us, s.median_us, s.workers)
    }
    return pa.Table.from_pydict(
        {
            "job": [k[0] for k in rows],
            "tenant": [v[0] for v in rows.values()],
            "step": [k[1] for k in rows],
            "step_time_us": [v[1] for v in rows.values()],
            "median_us": [v[2] for v in rows.values()],
            "workers": [v[3] for v in rows.values()],
            "received_at": [epoch_us(now)] * len(rows),
        },
        schema=_SERIES_SCHEMA,
    )


def deviations_table(maps: list[DeviationMap]) -> pa.Table:
    """Heatmap cells, one row per (job, window, worker, function) of each map; never-flagged cells have no z."""
    rows = [
        {
            "job": d.job,
            "window_id": d.window,
            "tenant": d.tenant,
            "worker": w,
            "function": f,
            "worker_rank": i,
            "function_rank": j,
            "z": d.z[i][j],
            "flagged_steps": d.flagged[i][j],
            "workers_total": d.workers_total,
            "functions_total": d.functions_total,
        }
        for d in maps
        for i, w in enumerate(d.workers)
        for j, f in enumerate(d.functions)
    ]
    return pa.Table.from_pylist(rows, schema=_DEVIATION_SCHEMA)


def findings_table(findings: list[Finding], now: float, incident_ids: dict[str, str] | None = None) -> pa.Table:
    """Findings as an Arrow table with the columns of the ``findings`` table."""
    enc = msgspec.json.Encoder()
    ids = incident_ids or {}
    rows = [
        {
            "id": f.id,
            "job": f.job,
            "tenant": f.tenant,
            "window_id": f.window,
            "steps": f.steps,
            "window_steps": f.window_steps,
            "scope": f.scope,
            "workers": f.workers,
            "hosts": f.hosts,
            "devices": f.devices,
            "peer_group": list(f.group.items()) if f.group else None,
            "function": f.function,
            "function_kind": f.function_kind,
            "cause": f.cause,
            "confidence": f.confidence,
            "evidence": enc.encode(f.evidence).decode(),
            "step_time_share": f.impact.step_time_share,
            "gpu_hours_per_day": f.impact.gpu_hours_per_day,
            "policy": f.policy,
            "summary": f.summary,
            "created_at": epoch_us(f.created_at),
            "record": enc.encode(f).decode(),
            "first_seen": epoch_us(now),
            "updated_at": epoch_us(now),
            "incident_id": ids.get(f.id),
        }
        for f in findings
    ]
    return pa.Table.from_pylist(rows, schema=_FINDING_SCHEMA)


def windows_table(reports: list[WindowReport]) -> pa.Table:
    rows = [
        {c: getattr(r, c, None) for c in _WINDOW_SCHEMA.names}
        | {"window_id": r.window, "closed_at": epoch_us(r.closed_at)}
        for r in reports
    ]
    return pa.Table.from_pylist(rows, schema=_WINDOW_SCHEMA)


def triggers_table(triggers: list[ProfileTrigger]) -> pa.Table:
    rows = [
        {
            "job": t.job,
            "window_id": t.window,
            "tenant": t.tenant,
            "start_step": t.start_step,
            "steps": t.steps,
            "expected_workers": t.expected_workers,
            "policy": t.policy_ref,
            "reason": t.reason,
            "hardware_hz": t.sampling.hardware_hz,
            "record_shapes": t.sampling.record_shapes,
            "with_stack": t.sampling.with_stack,
            "created_at": epoch_us(t.created_at),
            "kind": t.kind,
        }
        for t in triggers
    ]
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


#: the longest text a text column of the store keeps; longer text (a forged record's) is cut at write.  JSON columns
#: (a record as it came, bounded by the record's own size limit) are kept whole: cut, they would not parse
MAX_TEXT_CHARS = 64 << 10


def bounded_text(rows: pa.Table, keep: frozenset[str] = frozenset()) -> pa.Table:
    """``rows`` with every text value cut to :data:`MAX_TEXT_CHARS` characters (one vectorised pass per text column),
    except in the columns ``keep``."""
    for i, f in enumerate(rows.schema):
        if f.name not in keep and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)):
            col = rows.column(i)
            longest = pc.max(pc.utf8_length(col)).as_py()
            if longest is not None and longest > MAX_TEXT_CHARS:
                rows = rows.set_column(i, f, pc.utf8_slice_codeunits(col, 0, MAX_TEXT_CHARS))
    return rows


#: table -> its JSON columns (the migrations give every store the same tables: asked once per process, not per write)
_JSON_COLUMNS: dict[str, frozenset[str]] = {}


def _json_columns(con: duckdb.DuckDBPyConnection, table: str) -> frozenset[str]:
    cols = _JSON_COLUMNS.get(table)
    if cols is None:
        cols = _JSON_COLUMNS[table] = frozenset(
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND data_type = 'JSON'", [table]
            ).fetchall()
        )
    return cols


def upsert(
    con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table, key: tuple[str, ...], keep: tuple[str, ...] = ()
) -> None:
    """INSERT the Arrow rows (text cut to :data:`MAX_TEXT_CHARS`); on a key conflict update every column except ``key``
    and ``keep``."""
    rows = bounded_text(rows, _json_columns(con, table))
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
    changes: list[JobChange] = field(default_factory=list)

    @classmethod
    def of(cls, records: list, offsets: dict[tuple[str, int], int]) -> Batch:
        """Decoded records, each into its list by type."""
        b = cls(findings=[], windows=[], offsets=offsets)
        lists: dict[type, list[Any]] = {
            Finding: b.findings,
            WindowReport: b.windows,
            ProfileTrigger: b.triggers,
            StepSeries: b.series,
            DeviationMap: b.maps,
            JobChange: b.changes,
        }
        for rec in records:
            lists[type(rec)].append(rec)
        return b
