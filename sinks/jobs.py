"""The jobs the findings file has seen, one row each (``lockstep jobs``): SQL over the store's tables.  Pure: it
runs through whatever ``run(sql, params)`` it is given (the file, or the running sink: :func:`.http.query`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: the steps of a job's series whose median is its step time now
RECENT_STEPS = 100

JOBS_SQL = f"""
WITH s AS (
    SELECT job, tenant, step, step_time_us, workers, received_at,
           row_number() OVER (PARTITION BY job ORDER BY step DESC) AS back
    FROM step_series
), series AS (
    SELECT job, any_value(tenant) AS tenant, max(step) AS last_step, arg_max(workers, step) AS workers,
           median(step_time_us) FILTER (WHERE back <= {RECENT_STEPS}) AS step_time_us, max(received_at) AS seen_at
    FROM s GROUP BY job
), f AS (
    SELECT job, any_value(tenant) AS tenant, count(*) AS findings, max(created_at) AS seen_at,
           bool_and(coalesce(record->>'device_kind', '') = 'cpu') AS cpu_only
    FROM findings GROUP BY job
), w AS (
    SELECT job, any_value(tenant) AS tenant, count(*) AS windows, max(closed_at) AS seen_at FROM windows GROUP BY job
), i AS (
    SELECT job, any_value(tenant) AS tenant, count(*) FILTER (WHERE status = 'open') AS open_incidents,
           coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0) AS gpu_hours_per_day,
           coalesce(sum(gpu_hours_lost), 0) AS gpu_hours_lost
    FROM incident_timeline GROUP BY job
), e AS (
    SELECT job, max(step) AS ended_step FROM job_changes WHERE change = 'ended' GROUP BY job
), jobs AS (
    SELECT job, any_value(tenant) AS tenant FROM (
        SELECT job, tenant FROM series UNION ALL SELECT job, tenant FROM f
        UNION ALL SELECT job, tenant FROM w UNION ALL SELECT job, tenant FROM i
    ) GROUP BY job
)
SELECT j.tenant, j.job, series.last_step, series.workers, series.step_time_us,
       coalesce(i.open_incidents, 0) AS open_incidents, coalesce(f.findings, 0) AS findings,
       coalesce(w.windows, 0) AS windows, coalesce(i.gpu_hours_per_day, 0) AS gpu_hours_per_day,
       coalesce(i.gpu_hours_lost, 0) AS gpu_hours_lost,
       CASE WHEN coalesce(f.cpu_only, false) THEN 'CPU' ELSE 'GPU' END AS hours_unit,
       e.ended_step IS NOT NULL AND e.ended_step >= coalesce(series.last_step, 0) AS ended,
       CAST(greatest(series.seen_at, f.seen_at, w.seen_at) AS VARCHAR) AS last_seen
FROM jobs j
LEFT JOIN series USING (job) LEFT JOIN f USING (job) LEFT JOIN w USING (job) LEFT JOIN i USING (job)
LEFT JOIN e USING (job)
WHERE j.job = coalesce(?, j.job)
ORDER BY gpu_hours_per_day DESC, open_incidents DESC, last_seen DESC NULLS LAST, j.job
LIMIT ?
"""


@dataclass(frozen=True)
class JobRow:
    """One job: where it is, how fast, what is wrong and what it costs (GPU-hours per day of its open incidents;
    GPU-hours lost by all of them so far, ``incident_timeline``)."""

    tenant: str
    job: str
    last_step: int | None  # the last step of its step-time series (None: no series stored)
    workers: int | None  # workers that reported that step
    step_time_us: float | None  # median synchronised step time of its last RECENT_STEPS steps
    open_incidents: int
    findings: int
    windows: int
    gpu_hours_per_day: float
    gpu_hours_lost: float
    hours_unit: str  # what its hours are hours of: "CPU" where every finding says its workers have no accelerator
    ended: bool  # the detector saw it end (final heartbeats, or silence after one) at or after its last step
    last_seen: str | None  # latest of its series, findings and windows (UTC)


Run = Callable[..., tuple[list[str], list]]


def fetch_jobs(run: Run, job: str | None = None, limit: int = 200) -> list[JobRow]:
    """The jobs, costliest first (GPU-hours per day of open incidents), then by open incidents and recency."""
    cols, rows = run(JOBS_SQL, [job, limit])
    return [JobRow(**dict(zip(cols, r))) for r in rows]
