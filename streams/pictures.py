"""What the processor publishes for the pictures (pure: records in, records out; no Kafka).

- :class:`SeriesBuilder`: each job's step time per step from what the detector reads (the slowest
  worker's, the workers' median, how many reported), emitted as compact ``StepSeries`` records once a
  step is complete: a later step has been seen ``lag_steps`` ahead, or the step is ``max_age_s`` old.
  It takes heartbeats (one worker each) or the shards' partials of a step (the first of each shard;
  the median is then the median of the shards' medians, weighted by their workers: exact for one
  shard, close for many).  A record for a step already emitted is late and only counted.
- :func:`deviation_map`: a window's worst workers x functions by robust z against their peers, from
  the step results the window stage already holds (their flagged rows), as a ``DeviationMap``.  Small peer
  groups (2 to ``ratio_peers_max`` workers) are compared by ratio, not by z: their cells are put on the same
  scale of significance as the excess over the slowest other worker in units of the job's step-to-step noise
  (:func:`ratio_significance`), never as a bare rise, which a one-step spike over a near-zero peer makes huge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc

from ..schemas.records import (
    MAX_MAP_FUNCTIONS,
    MAX_MAP_WORKERS,
    MAX_SERIES_POINTS,
    DeviationMap,
    StepHeartbeat,
    StepPartial,
    StepSeries,
)
from .diagnosis.localise import localise
from .policy import DiagnosisPolicy

if TYPE_CHECKING:
    from .diagnosis.step import StepResult


@dataclass
class _Job:
    tenant: str = ""
    open: dict[int, list[tuple[float, float, int]]] = field(
        default_factory=dict
    )  # step -> (slowest s, median s, workers) of what reported it
    shards: dict[int, set[tuple[int, int]]] = field(default_factory=dict)  # step -> the shards counted (partials)
    opened: dict[int, float] = field(default_factory=dict)  # step -> when its first heartbeat came
    done: list[tuple[int, float, float, int]] = field(
        default_factory=list
    )  # (step, max us, median us, workers), to emit
    emitted_upto: int = -1  # steps at or below were emitted (or dropped as too late)
    highest: int = -1


class SeriesBuilder:
    def __init__(self, lag_steps: int = 2, max_age_s: float = 10.0, flush_s: float = 1.0, max_open_steps: int = 64):
        self.lag_steps = lag_steps
        self.max_age_s = max_age_s
        self.flush_s = flush_s
        self.max_open_steps = max_open_steps
        self.jobs: dict[str, _Job] = {}
        self._active: dict[str, None] = {}  # jobs with open steps or points to emit (what ``due`` visits), in order
        self.late = 0
        self._last_flush = -math.inf

    def add(self, hb: StepHeartbeat, now: float) -> None:
        self._add(hb.job, hb.tenant, hb.step, (hb.step_time_s, hb.step_time_s, 1), now)

    def add_partial(self, p: StepPartial, now: float) -> None:
        """A shard's workers of a step (the first partial of each shard counts: a replay sends it again)."""
        j, key = self.jobs.get(p.job), (p.shard, p.partition)
        if not p.workers or (j is not None and key in j.shards.get(p.step, ())):
            return
        if self._add(p.job, p.tenant, p.step, (p.slowest_s, p.median_s, p.workers), now):
            self.jobs[p.job].shards.setdefault(p.step, set()).add(key)

    def _add(self, job: str, tenant: str, step: int, point: tuple[float, float, int], now: float) -> bool:
        j = self.jobs.get(job)
        if j is None:
            j = self.jobs[job] = _Job(tenant=tenant)
        if step <= j.emitted_upto:
            self.late += 1
            return False
        points = j.open.get(step)
        if points is None:
            if len(j.open) >= self.max_open_steps:  # a job far behind or reporting scattered steps: close its oldest
                self._close(j, min(j.open))
            points = j.open[step] = []
            j.opened[step] = now
        points.append(point)
        j.highest = max(j.highest, step)
        self._active[job] = None
        return True

    def _close(self, j: _Job, step: int) -> None:
        pts = np.asarray(j.open.pop(step), dtype=np.float64)
        j.opened.pop(step, None)
        j.shards.pop(step, None)
        slowest, medians, workers = pts[:, 0] * 1e6, pts[:, 1] * 1e6, pts[:, 2]
        j.done.append(
            (step, round(float(slowest.max()), 1), round(_weighted_median(medians, workers), 1), int(workers.sum()))
        )  # 0.1 µs is plenty
        j.emitted_upto = max(j.emitted_upto, step)

    def due(self, now: float, force: bool = False) -> list[StepSeries]:
        """Close complete steps; every ``flush_s`` (or when ``force``) return one record per job with new points."""
        active = [(job, j) for job in self._active if (j := self.jobs.get(job)) is not None]
        for _, j in active:
            for step in sorted(j.open):
                if step <= j.highest - self.lag_steps or now - j.opened[step] >= self.max_age_s or force:
                    self._close(j, step)
        if not force and now - self._last_flush < self.flush_s:
            return []
        self._last_flush = now
        out = []
        for job, j in active:
            if not j.open:
                del self._active[job]  # nothing left after this flush
            while j.done:
                chunk, j.done = j.done[:MAX_SERIES_POINTS], j.done[MAX_SERIES_POINTS:]
                chunk.sort()
                out.append(
                    StepSeries(
                        job=job,
                        tenant=j.tenant,
                        steps=[c[0] for c in chunk],
                        step_time_us=[c[1] for c in chunk],
                        median_us=[c[2] for c in chunk],
                        workers=[c[3] for c in chunk],
                        sent_at=now,
                    )
                )
        return out

    def drop(self, jobs: Iterable[str]) -> None:
        """Jobs whose partition went to another processor, or that the detector forgot (idle)."""
        for job in jobs:
            self.jobs.pop(job, None)
            self._active.pop(job, None)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The median of ``values`` each counted ``weights`` times (np.median's when every weight is 1)."""
    order = np.argsort(values, kind="stable")
    v, c = values[order], np.cumsum(weights[order])
    half = c[-1] / 2.0
    lo = int(np.searchsorted(c, half, side="left"))  # the value holding the lower middle ...
    hi = int(np.searchsorted(c, half, side="right")) if c[-1] % 2 == 0 else lo  # ... and, for an even count, the upper
    return float((v[lo] + v[min(hi, v.size - 1)]) / 2.0)


def ratio_significance(results: list[StepResult], noise: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step result, ``(z, ratio)`` of its flagged rows: ``z`` the robust z, except for rows flagged by ratio
    (``ratio`` True: a small peer group), whose z is their excess over the slowest other worker (µs) in units of
    the job's step-to-step noise of a worker's own work (:func:`lockstep.streams.diagnosis.localise.localise`'s
    ``noise``, relative) times the worker's peers' own work in that step (the step's time where the step stage
    sent no worker rows).

    So a 30 ms rise in a 100 ms step of a job whose workers vary by 2% step to step reads +15 where its bare ratio
    read +0.3; a 3 ms spike over a 1 µs peer, whose ratio reads +3000, reads +1.5."""
    out = []
    for r in results:
        t = r.outliers
        z = pc.fill_null(t.column("z"), math.nan).to_numpy(zero_copy_only=False).astype(np.float64)
        ratio = np.asarray(t.column("signal").to_pylist(), dtype=object) == "ratio"
        if ratio.any() and math.isfinite(noise) and noise > 0:
            worker = t.column("worker").to_numpy(zero_copy_only=False)
            base = pc.fill_null(t.column("step_time_us"), math.nan).to_numpy(zero_copy_only=False).astype(np.float64)
            wt = getattr(r, "workers", None)
            if wt is not None and wt.num_rows:
                ws, first = np.unique(wt.column("worker").to_numpy(zero_copy_only=False), return_index=True)
                peer_own = wt.column("peer_own_us").to_numpy(zero_copy_only=False).astype(np.float64)[first]
                i = np.minimum(np.searchsorted(ws, worker), ws.size - 1)
                found = (ws[i] == worker) & (peer_own[i] > 0)
                base = np.where(found, peer_own[i], base)
            excess = pc.fill_null(t.column("excess_us"), math.nan).to_numpy(zero_copy_only=False).astype(np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                z = np.where(ratio, excess / (noise * base), z)
        out.append((z, ratio))
    return out


def deviation_map(
    job: str,
    window: str,
    tenant: str,
    start_step: int,
    steps: int,
    results: Iterable[StepResult],
    now: float,
    max_workers: int = 32,
    max_functions: int = 16,
    policy: DiagnosisPolicy | None = None,
) -> DeviationMap:
    """The worst ``max_workers`` x ``max_functions`` cells of a window by robust z against the peers.

    ``results`` are the window's step results (``StepResult``: ``outliers`` holds the flagged rows of a
    step with their ``z``).  A cell's value is the median of its z over the steps it was flagged in.
    Workers are ranked by the sum over their cells of |z| (capped at 20) times the steps flagged, so that a
    deviation that persisted outranks one step's spike; functions likewise among the chosen workers.

    Small peer groups are flagged by ratio, not by z: their cells read in standard errors, as the localisation's
    per-worker z does: the median over the steps flagged of :func:`ratio_significance` (the excess in units of the
    job's step-to-step noise, by ``policy``'s localisation, the default policy when None) over its standard error,
    1.2533 / sqrt(steps flagged).  A rise held in every step of the window outranks one step's spike."""
    max_workers, max_functions = min(max_workers, MAX_MAP_WORKERS), min(max_functions, MAX_MAP_FUNCTIONS)
    results = list(results)
    dp = policy or DiagnosisPolicy()
    noise = math.nan
    if any(r.outliers.num_rows and "ratio" in r.outliers.column("signal").to_pylist() for r in results):
        noise = (
            localise(results, dp).noise if all(getattr(r, "workers", None) is not None for r in results) else math.nan
        )
        noise = noise if math.isfinite(noise) else dp.rel_floor  # no worker rows to measure it on: the policy's floor
    ws, fs, zs, rs = [], [], [], []
    for r, (z, ratio) in zip(results, ratio_significance(results, noise)):
        t = r.outliers
        if t.num_rows:
            ws.append(t.column("worker").to_numpy(zero_copy_only=False))
            fs.append(np.asarray(t.column("function").to_pylist(), dtype=object))
            zs.append(z)
            rs.append(ratio)
    empty = DeviationMap(
        job=job,
        window=window,
        tenant=tenant,
        start_step=start_step,
        steps=steps,
        workers=[],
        functions=[],
        z=[],
        flagged=[],
        created_at=now,
    )
    if not ws:
        return empty
    w, f, z = np.concatenate(ws), np.concatenate(fs).astype(str), np.concatenate(zs).astype(np.float64)
    by_ratio = np.concatenate(rs).astype(bool)
    keep = np.isfinite(z)
    w, f, z, by_ratio = w[keep], f[keep], z[keep], by_ratio[keep]
    if not w.size:
        return empty
    wu, wi = np.unique(w, return_inverse=True)
    fu, fi = np.unique(f, return_inverse=True)
    cell = wi * fu.size + fi
    order = np.lexsort((z, cell))  # by cell, then z: each cell's values sorted, for its median
    cell_s, z_s = cell[order], z[order]
    starts = np.flatnonzero(np.r_[True, cell_s[1:] != cell_s[:-1]])
    counts = np.diff(np.r_[starts, cell_s.size])
    med = (z_s[starts + (counts - 1) // 2] + z_s[starts + counts // 2]) / 2
    cells = cell_s[starts]
    # cells flagged by ratio: the median excess in noise units over its standard error (1.2533 / sqrt(steps))
    ratio_cell = np.bincount(cell[by_ratio], minlength=wu.size * fu.size)[cells] > 0
    med = np.where(ratio_cell, med * np.sqrt(counts) / 1.2533, med)
    grid = np.full((wu.size, fu.size), np.nan)
    n = np.zeros((wu.size, fu.size), dtype=np.int64)
    grid[cells // fu.size, cells % fu.size] = med
    n[cells // fu.size, cells % fu.size] = counts
    score = np.where(np.isnan(grid), 0.0, np.minimum(np.abs(grid), 20.0)) * n
    top_w = np.argsort(-score.sum(axis=1), kind="stable")[:max_workers]
    top_f = np.argsort(-score[top_w].sum(axis=0), kind="stable")[:max_functions]
    sub, subn = grid[np.ix_(top_w, top_f)], n[np.ix_(top_w, top_f)]
    return DeviationMap(
        job=job,
        window=window,
        tenant=tenant,
        start_step=start_step,
        steps=steps,
        workers=[int(x) for x in wu[top_w]],
        functions=[str(x) for x in fu[top_f]],
        z=[[None if math.isnan(x) else round(float(x), 2) for x in row] for row in sub],
        flagged=[[int(x) for x in row] for row in subn],
        workers_total=int(wu.size),
        functions_total=int(fu.size),
        created_at=now,
    )
