"""The report's rows, read from the findings store with SQL (the thin shell around :mod:`.page`).

:func:`gather` takes ``run(sql, params) -> (columns, rows)``, so the same SQL serves ``lockstep report``
(through :func:`lockstep.sinks.http.query`: the file, or the running sink's ``/query``, with a tenant
sandbox when asked) and the sink's live page (its own connection, or a sandbox of it).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable

import msgspec

from ...schemas.records import Finding
from ..store.writes import SLOWDOWN_NEWS_FIRST, SLOWDOWN_NEWS_OF_TRIGGER
from .page import CauseRow, HeatCell, IncidentRow, PageRow, Report, SeriesPoint, TriggerRow, WindowRow

Run = Callable[..., tuple[list[str], list]]

#: points of a job's step-time series the report draws (the latest)
SERIES_POINTS = 3000
#: jobs whose step time the report draws
SERIES_JOBS = 8


def parse_since(value: str) -> dt.datetime:
    """``30m``, ``6h``, ``2d`` ago, or an ISO time; naive UTC (the store's timestamps)."""
    from ...config import ConfigError

    m = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if m:
        secs = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(seconds=secs)
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--since: {value!r} is neither an ISO time nor an age like 30m, 6h, 2d") from None
    return t.astimezone(dt.UTC).replace(tzinfo=None) if t.tzinfo else t


def where(job=None, since=None, cause=None, time_column="created_at") -> tuple[str, list]:
    """The `` WHERE ...`` clause (or "") and its parameters for the --job, --since and --cause selections."""
    conds, params = [], []
    for cond, value in (
        ("job = ?", job),
        ("cause = ?", cause),
        (f"{time_column} >= ?", parse_since(since).isoformat() if since else None),
    ):
        if value:
            conds.append(cond)
            params.append(value)
    return (f" WHERE {' AND '.join(conds)}" if conds else ""), params


def fetch_findings(run: Run, job=None, since=None, cause=None, limit=100, open_only=False) -> list[dict]:
    """Finding records (as JSON objects), costliest first."""
    cond, params = where(job, since, cause)
    sql = f"SELECT record FROM {'open_findings' if open_only else 'findings'}{cond}"
    sql += f" ORDER BY step_time_share DESC, created_at DESC LIMIT {int(limit)}"
    _, rows = run(sql, params)
    return [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in rows]


def fetch_windows(run: Run, job: str | None = None, since: str | None = None, limit: int = 50) -> list[WindowRow]:
    """Profiling windows, newest first, each with how it ended (``complete``, ``timeout``, ``failed`` and why), and
    the triggers whose window has not reported yet (``open``, at the time of their trigger)."""
    cond, params = where(job, since, time_column="closed_at")
    tcond, tparams = where(job, since, time_column="t.created_at")
    tcond = tcond.replace("job = ?", "t.job = ?")
    no_window = "NOT EXISTS (SELECT 1 FROM windows w WHERE w.job = t.job AND w.window_id = t.window_id)"
    tcond = f"{tcond} AND {no_window}" if tcond else f" WHERE {no_window}"
    _, rows = run(
        "SELECT job, window_id, start_step, steps, coverage, findings, closed, CAST(closed_at AS VARCHAR) AS ended_at, "
        f"expected_workers, workers_seen, bytes_per_worker, coalesce(closed_reason, '') FROM windows{cond} "
        "UNION ALL SELECT t.job, t.window_id, t.start_step, t.steps, 0.0, 0, 'open', CAST(t.created_at AS VARCHAR), "
        "t.expected_workers, 0, NULL, 'triggered; the window has not reported yet' "
        f"FROM triggers t{tcond} ORDER BY ended_at DESC LIMIT {int(limit)}",
        params + tparams,
    )
    return [
        WindowRow(
            job=r[0],
            window=r[1],
            start_step=r[2],
            steps=r[3],
            coverage=r[4],
            findings=r[5],
            closed=r[6],
            closed_at=r[7],
            expected_workers=r[8],
            workers_seen=r[9],
            bytes_per_worker=math.nan if r[10] is None else r[10],
            closed_reason=r[11],
        )
        for r in rows
    ]


def _in(values: list) -> tuple[str, list]:
    """``IN (?, ?, ...)`` for a non-empty list (DuckDB binds lists too, but every driver binds scalars)."""
    return "(" + ", ".join("?" for _ in values) + ")", list(values)


def gather(
    run: Run, job: str | None = None, since: str | None = None, open_only: bool = False, limit: int = 50
) -> Report:
    """Everything the report shows, for the selection (as ``lockstep findings``' --job, --since, --open)."""
    findings = [msgspec.convert(r, Finding) for r in fetch_findings(run, job, since, None, limit, open_only)]
    windows = fetch_windows(run, job, since, limit)
    # the gpu_hours_lost_by_cause view's figures, for the selected job only when one is selected
    _, rows = run(
        """
        SELECT cause, count(*), count(*) FILTER (WHERE status = 'open'),
               coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0),
               coalesce(sum(gpu_hours_per_day * epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at) / 86400), 0)
        FROM incidents"""
        + (" WHERE job = ?" if job else "")
        + " GROUP BY cause ORDER BY 5 DESC",
        [job] if job else [],
    )
    causes = [CauseRow(*r) for r in rows]

    keys = sorted({(f.job, f.window) for f in findings} | {(w.job, w.window) for w in windows})
    # the costliest jobs' step times (findings come costliest first), then the other jobs with windows by name
    ranked = list(dict.fromkeys([f.job for f in findings] + sorted({w.job for w in windows})))
    jobs = ranked[:SERIES_JOBS] if not job else [job]
    report = Report(findings=findings, windows=windows, causes=causes)
    if keys:
        pairs = " OR ".join("({t}job = ? AND {t}window_id = ?)" for _ in keys)  # {t}: the table's alias, if any
        flat = [x for k in keys for x in k]
        _, rows = run(  # with the detector's onset of the slowdown that opened the window, where it gave one
            "SELECT t.job, t.window_id, t.kind, t.reason, t.start_step, t.steps, CAST(t.created_at AS VARCHAR), "
            f"(SELECT c.onset_step FROM job_changes c WHERE {SLOWDOWN_NEWS_OF_TRIGGER} ORDER BY {SLOWDOWN_NEWS_FIRST} "
            "LIMIT 1) FROM triggers t WHERE " + pairs.format(t="t."),
            flat,
        )
        report.triggers = {(r[0], r[1]): TriggerRow(*r) for r in rows}
        _, rows = run(
            "SELECT job, window_id, worker, function, worker_rank, function_rank, z, flagged_steps, workers_total, functions_total "
            "FROM window_deviations WHERE " + pairs.format(t="") + " ORDER BY worker_rank, function_rank",
            flat,
        )
        for r in rows:
            report.heatmaps.setdefault((r[0], r[1]), []).append(HeatCell(*r[2:]))
    for j in jobs:
        _, rows = run(
            f"SELECT step, step_time_us, median_us, workers FROM step_series WHERE job = ? ORDER BY step DESC LIMIT {SERIES_POINTS}",
            [j],
        )
        if rows:
            report.series[j] = [SeriesPoint(*r) for r in reversed(rows)]
    if findings:
        clause, ids = _in([f.id for f in findings])
        _, rows = run(f"SELECT id, incident_id FROM findings WHERE id IN {clause}", ids)
        report.incident_of = {r[0]: r[1] for r in rows if r[1]}
    if report.incident_of:
        clause, ids = _in(sorted(set(report.incident_of.values())))
        _, rows = run(
            "SELECT id, status, occurrence, CAST(opened_at AS VARCHAR), CAST(last_seen_at AS VARCHAR), CAST(resolved_at AS VARCHAR), "
            # resolved by hand: "manual:<who>" (the person is in resolved_by)
            "CASE WHEN resolved_reason = 'manual' THEN 'manual:' || resolved_by ELSE resolved_by END, windows, gpu_hours_per_day, "
            "gpu_hours_per_day * epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at) / 86400, "
            "CAST(acked_at AS VARCHAR), acked_by "
            f"FROM incidents WHERE id IN {clause}",
            ids,
        )
        report.incidents = {r[0]: IncidentRow(*r) for r in rows}
        _, rows = run(
            "SELECT incident_id, route, receiver, action, status, attempts, last_status, last_error, CAST(delivered_at AS VARCHAR) "
            f"FROM webhook_deliveries WHERE incident_id IN {clause} ORDER BY event_seq, route",
            ids,
        )
        for r in rows:
            report.pages.setdefault(r[0], []).append(PageRow(*r[1:]))
    return report
