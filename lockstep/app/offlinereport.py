"""``lockstep diagnose ... --report FILE.html``: the offline window as the live page draws a window (pure but for
the file written).

The same pictures as the sink's live page (:mod:`lockstep.sinks.report.page`): the step time per step (the slowest
rank's, the median rank's, and every rank's own line for up to :data:`RANK_LINES` ranks), the worker x function
deviation map of the window (:func:`lockstep.streams.pictures.deviation_map`, from the same step results the
diagnosis read), and each finding with its evidence, in one self-contained HTML file.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np

from ..schemas.errors import LockstepError
from ..sinks.report.page import HeatCell, Report, SeriesPoint, WindowRow, render
from ..streams.pictures import deviation_map

#: ranks drawn as lines of their own (beyond, only the slowest and the median: a thousand lines are a blur)
RANK_LINES = 64


class ReportError(LockstepError, OSError):
    """The report file could not be written."""


def offline_report(inputs, diagnosis, results: list, job: str, now: float) -> Report:
    """The page's rows for an offline window: ``inputs`` (:class:`lockstep.app.offline.Inputs`), ``diagnosis``
    (its :func:`~lockstep.app.offline.diagnose`), ``results`` (the step results it read)."""
    w = diagnosis.report
    closed_at = dt.datetime.fromtimestamp(w.closed_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    window = WindowRow(
        job=w.job,
        window=w.window,
        start_step=w.start_step,
        steps=w.steps,
        coverage=w.coverage,
        findings=w.findings,
        closed=w.closed,
        closed_at=closed_at,
        expected_workers=w.expected_workers,
        workers_seen=w.workers_seen,
        bytes_per_worker=w.bytes_per_worker,
        closed_reason=w.closed_reason,
    )
    steps = np.asarray([s.step for s in inputs.summaries], dtype=np.int64)
    times = np.asarray([s.step_time_us for s in inputs.summaries], dtype=np.float64)
    workers = np.asarray([s.worker for s in inputs.summaries], dtype=np.int64)
    order = np.lexsort((times, steps))
    steps, times, workers = steps[order], times[order], workers[order]
    firsts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    series = []
    for a, b in zip(firsts, np.r_[firsts[1:], steps.size]):
        t = times[a:b]
        series.append(SeriesPoint(int(steps[a]), float(t[-1]), float(np.median(t)), int(b - a)))
    ranks: dict[int, list[tuple[int, float]]] = {}
    if len(np.unique(workers)) <= RANK_LINES:
        for s, t, r in zip(steps.tolist(), times.tolist(), workers.tolist()):
            ranks.setdefault(r, []).append((s, t))
    m = deviation_map(job, w.window, "", w.start_step, w.steps, results, now)
    cells = [
        HeatCell(wk, fn, i, j, m.z[i][j], m.flagged[i][j], m.workers_total, m.functions_total)
        for i, wk in enumerate(m.workers)
        for j, fn in enumerate(m.functions)
    ]
    return Report(
        findings=sorted(diagnosis.findings, key=lambda f: -f.impact.step_time_share),
        windows=[window],
        causes=[],
        series={job: series},
        heatmaps={(job, w.window): cells} if cells else {},
        rank_series={job: ranks} if ranks else {},
    )


def write_report(path: Path, report: Report, files: int) -> None:
    """The page, written to ``path`` (one file: inline SVG and CSS, nothing fetched)."""
    page = render(
        report,
        title=f"Lockstep diagnose: {', '.join(report.series) or 'offline'}",
        scope=f"offline, {files} file{'s' if files != 1 else ''}",
        summary=False,
    )
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"--report: cannot write {path}: {exc.strerror}") from None
