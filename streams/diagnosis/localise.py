"""Localisation: which worker stands out from its peers, before (and whatever) the cause.

Synchronous peers are a baseline for anything: each worker's *own* work in a step (the step minus its waits at
collectives: the waiting is the victims' share) against the median of its peer group's others in the same step.
Over the window's steps, a worker whose own work is persistently above its peers' by more than the job's own noise
stands out, named or not by any cause rule; the function it stands out in is the one whose work is most above its
peers' summed over the window.

- The shift: the median over the window's steps of ``own / others' median - 1``.
- The job's noise: how much a worker's ratio to its peers moves from step to step (1.4826 x the MAD over steps
  around its own median, the median over the job's workers).  Step to step, not across peers: in a group of two
  each worker is the other's only peer, and a persistent shift of one is exactly what the spread across peers
  would hide.  Never below ``rel_floor``.
- It stands out when its shift is ``localise_z`` standard errors or more (a median of n steps: 1.2533 noise /
  sqrt(n)), and more than chance gives the largest of the job's workers (:func:`threshold`: of 1,024 workers
  one passes 4.3 standard errors by chance one window in a hundred), its shift at least ``localise_min_shift``
  (5%: a worker within a few percent of its peers is no straggler worth naming, however steady the job), its excess at least ``min_excess_share`` of the
  step, it is above its peers in ``persistence`` of the steps, and it waits less than they do (the straggler
  waits least: the others wait for it; where nobody waits, as in traces of independent runs put side by side,
  nobody holds anybody up and nobody stands out).

The victims of a straggler have *lower* own work than their peers (they wait instead), so they never stand out.

A worker whose own work does not stand out as a whole can still stand out in one function (a slower optimizer step,
one of two culprits, a DataLoader a few percent of the step: the job's own-work noise hides it, the function's own
spread does not): per (worker, function) the median over the worker's steps of its work in it above its group's
median, against that function's spread across the group's workers in the same steps (1.4826 x MAD, the median over
steps, never below ``rel_floor`` of the function's median work), named under the same bars: ``localise_z`` standard
errors and more than chance gives the largest of every (worker, function) tested, at least ``localise_min_shift`` of
its peers' own work and ``min_excess_share`` of the step, above in ``persistence`` of the steps, waiting less than
its peers.  In a group of two the spread across the pair is half their difference, the shift itself: there the
worker's excess is over its only peer (twice that over the pair's median), and the function's noise is how much
that excess moves from step to step (1.4826 x its MAD over the worker's steps, never below ``rel_floor`` of the
function's work), as the own-work test's is.
Vectorised: one sort per statistic, no loop over workers or functions.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..policy import DiagnosisPolicy
from .stats import group_median, others_median
from .step import WAITING_KINDS, StepResult


@dataclass(frozen=True)
class Localised:
    """A worker that stands out from its peers in the window."""

    worker: int
    host: str
    device: str
    group: str
    function: str  # its function most above its peers' over the window ("" if none)
    kind: str
    shift: float  # median over steps of own / others' median - 1
    noise: float  # the job's noise (relative, step to step)
    z: float  # shift / its standard error (1.2533 noise / sqrt(steps))
    above: float  # share of its steps in which its own work was above its peers'
    holds: float  # share of its steps in which its own work was its group's highest
    steps: list[int]  # the steps in which it was above its peers
    n_steps: int  # the steps it reported
    peers: int  # workers in its peer group
    own_us: float  # medians over steps
    peer_own_us: float
    wait_us: float
    peer_wait_us: float
    work_us: float  # in the function
    peer_work_us: float
    excess_share: float  # median over steps of (own - peers') / step time
    basis: str = "own"  # what stood out: "own" (its own work), "occurrence" (its own work in the steps a periodic
    # function ran in), "function" (its work in ``function`` alone) or "split" (its small group splits the same
    # way in ``function`` in most steps, this worker on the slow side: several are slow, the median is one of them)
    bar: float = math.nan  # the standard errors it needed (NaN: the Standing's own-work bar)
    slow: list[int] = field(default_factory=list)  # "split": the slow side (this worker among them)
    fast: list[int] = field(default_factory=list)  # ... and the fast side, their baseline (they wait for the slow)


@dataclass(frozen=True)
class Standing:
    """What the localisation saw: who stood out, and the largest shift of any worker against the job's noise (the
    evidence of a job-wide finding that no worker stands out)."""

    localised: list[Localised]
    top_worker: int
    top_shift: float
    top_z: float
    noise: float
    workers: np.ndarray | None = None  # every worker seen, sorted
    z: np.ndarray | None = None  # ... its shift in standard errors (NaN: no peer)
    bar: float = math.nan  # the standard errors a worker needed to stand out (:func:`threshold`)
    se_us: np.ndarray | None = None  # per worker: the standard error of its shift, in µs of its peers' own work
    waits_more: np.ndarray | None = None  # per worker: its median wait above its peers' (a victim's sign)

    def waits_more_of(self, worker: int) -> bool:
        """Whether the worker waited more than its peers (median over steps): the others kept it waiting."""
        if self.workers is None or self.waits_more is None or self.workers.size == 0:
            return False
        i = int(np.searchsorted(self.workers, worker))
        return bool(i < self.workers.size and self.workers[i] == worker and self.waits_more[i])

    def expected_z(self, worker: int, excess_us: float) -> float:
        """The standard errors by which ``excess_us`` more work per step would shift the worker's own work, were
        nothing of it made up elsewhere in its step (NaN: not seen, or no peer)."""
        if self.workers is None or self.se_us is None or self.workers.size == 0:
            return math.nan
        i = int(np.searchsorted(self.workers, worker))
        ok = i < self.workers.size and self.workers[i] == worker and self.se_us[i] > 0
        return float(excess_us / self.se_us[i]) if ok else math.nan

    def z_of(self, worker: int) -> float:
        """The worker's own-work shift against its peers in standard errors (NaN: not seen, or no peer)."""
        if self.workers is None or self.z is None or self.workers.size == 0:
            return math.nan
        i = int(np.searchsorted(self.workers, worker))
        return float(self.z[i]) if i < self.workers.size and self.workers[i] == worker else math.nan


NOBODY = Standing([], -1, math.nan, math.nan, math.nan)


def threshold(dp: DiagnosisPolicy, workers: int) -> float:
    """The standard errors a worker's shift must reach: ``localise_z``, or more in a bigger job, where the largest of
    many workers' shifts is larger by chance alone: the shift that one of ``workers`` healthy workers passes with
    probability ``localise_alpha`` (Bonferroni: the normal quantile 1 - alpha / workers)."""
    return max(dp.localise_z, -NormalDist().inv_cdf(min(dp.localise_alpha / max(workers, 1), 0.5)))


@dataclass(frozen=True)
class Periods:
    """Per (group, function) of a window (``keys``: ``group \\x1f function``, sorted): the steps it occurs in."""

    keys: np.ndarray
    count: np.ndarray  # the distinct steps it ran in (of its period's, where it has one)
    periodic: np.ndarray  # they form a period: steps first, first + every, ... (count of them)
    first: np.ndarray
    every: np.ndarray


def periods(g: pa.Table, w0: int, w1: int) -> Periods:
    """Which functions of a window's group table (its results' ``groups`` with a ``step`` column; steps ``w0..w1``)
    occur periodically, and in which steps.

    A function occurs periodically where the steps that run it are evenly spaced, at least two apart, from the
    window's start to its end, at least three of them (a period): the steps most of the group ran it in, else those
    anyone did (code of one rank, an evaluation every k-th step).  What a size budget cuts at random is not a period: a
    function table leaves out what is below its budget, so a function every worker runs every step, small enough to be
    cut, seems to occur only in the steps where it was slow (for most of the group in a step where the whole job
    stalled, for one worker where it was descheduled); it occurs in every step (issue 21, seventh pass: before, the
    steps most ran it in counted whether or not they formed a period, and a `zero_grad` slow on one worker in 2 of 10
    steps was persistent "in 2 of its 1 occurrences")."""
    key = np.char.add(np.char.add(_np(g, "group").astype(str), "\x1f"), _np(g, "function").astype(str))
    step = _np(g, "step").astype(np.int64)
    keys, inv = np.unique(key, return_inverse=True)
    most = 2 * _np(g, "present") > _np(g, "workers")
    by_most, by_any = _period(inv[most], step[most], keys.size, w0, w1), _period(inv, step, keys.size, w0, w1)
    use = by_most[1]
    count, periodic, first, every = (np.where(use, m, a) for m, a in zip(by_most, by_any, strict=True))
    return Periods(keys, count, periodic.astype(bool), first, every)


def periodic_need(occurrences: np.ndarray) -> np.ndarray:
    """Of a periodic function's occurrences, in how many a deviation must hold: more than half, and at least three
    (of three, each).  Half of three or four occurrences, one or two, is what chance gives a worker that a noisy
    function's duration puts above its peers now and then (a checkpoint whose write varies by 20-50% from one worker
    and step to the next: with half of them, healthy 3- and 4-worker jobs got a worker finding in a sixth to three
    quarters of their windows; issue 21's tenth pass, ``python -m tests.noisy_periodic``)."""
    out: np.ndarray = np.maximum(3, np.asarray(occurrences) // 2 + 1)
    return out


def _period(
    inv: np.ndarray, step: np.ndarray, n_keys: int, w0: int, w1: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per key: the distinct steps it has rows in, and whether they form a period of the window ``w0..w1``: at least
    three (two steps a budget let through at random are as often evenly spaced as not), evenly spaced, at least two
    apart, the first within a period of the start, the last within one of the end; its first step and the gap."""
    count = np.zeros(n_keys, dtype=np.int64)
    periodic = np.zeros(n_keys, dtype=bool)
    first_of, every = np.zeros(n_keys, dtype=np.int64), np.zeros(n_keys, dtype=np.int64)
    if inv.size == 0:
        return count, periodic, first_of, every
    pairs = np.unique(np.stack([inv, step], axis=1), axis=0)  # one row per (key, step), by key then step
    k, st = pairs[:, 0], pairs[:, 1]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    c = np.diff(np.r_[starts, k.size])
    gap = np.diff(st, prepend=st[0])
    gap[starts] = -1  # no gap before a key's first step
    big = np.where(gap < 0, np.iinfo(np.int64).max, gap)
    lo, hi = np.minimum.reduceat(big, starts), np.maximum.reduceat(gap, starts)
    first, last = st[starts], st[np.r_[starts[1:], k.size] - 1]
    count[k[starts]] = c
    periodic[k[starts]] = (c >= 3) & (lo == hi) & (lo >= 2) & (first - w0 < lo) & (w1 - last < lo)
    first_of[k[starts]], every[k[starts]] = first, np.where(c > 1, hi, 0)
    return count, periodic, first_of, every


def _concat(results: list[StepResult], table: str = "workers") -> pa.Table | None:
    """The results' ``workers`` (or ``groups``) tables, each row with its ``step``."""
    tables = [(getattr(r, table), r.step) for r in results]
    parts = [
        t.append_column("step", pa.array(np.full(t.num_rows, step, dtype=np.int64)))
        for t, step in tables
        if t is not None and t.num_rows
    ]
    return pa.concat_tables(parts) if parts else None


def _np(t: pa.Table, name: str) -> np.ndarray:
    out: np.ndarray = t.column(name).to_numpy(zero_copy_only=False)
    return out


@dataclass(frozen=True)
class _Rows:
    """The window's worker table as the localisation reads it: one row per (worker, step, function) in ``t``, and
    ``first``, the first row of each (worker, step), for the worker's own values.  Columns are read from ``t`` once
    (the table has a row per worker, step and reported function: 240,000 for 10,000 workers over 8 steps)."""

    t: pa.Table
    first: np.ndarray
    ws: np.ndarray  # every worker seen, sorted
    wi_all: np.ndarray  # per row of t: its worker's index in ws
    step: np.ndarray  # per row of t
    read: dict[str, np.ndarray] = field(default_factory=dict)
    coded: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def wi(self) -> np.ndarray:  # per (worker, step)
        out: np.ndarray = self.wi_all[self.first]
        return out

    def all(self, name: str) -> np.ndarray:  # per row of t
        if name not in self.read:
            self.read[name] = _np(self.t, name)
        return self.read[name]

    def col(self, name: str) -> np.ndarray:  # per (worker, step)
        out: np.ndarray = self.all(name)[self.first]
        return out

    def codes(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A text column as (per row of t: its value's index in ``names``, ``names`` sorted), as ``np.unique``
        gives them, without converting every row to a Python string."""
        if name not in self.coded:
            enc = pc.dictionary_encode(self.t.column(name).combine_chunks())
            names = np.asarray(enc.dictionary.to_pylist(), dtype=str)
            order = np.argsort(names, kind="stable")
            rank = np.empty(order.size, dtype=np.int64)
            rank[order] = np.arange(order.size)
            self.coded[name] = (rank[enc.indices.to_numpy(zero_copy_only=False)], names[order])
        return self.coded[name]

    def by_step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's steps (sorted), per row of t its step's index in them, and per (worker index, step index)
        whether the worker reported that step."""
        steps = np.unique(self.step)
        si = np.searchsorted(steps, self.step)
        reported = np.zeros((self.ws.size, steps.size), dtype=bool)
        reported[self.wi, si[self.first]] = True
        return steps, si, reported

    def with_function(self) -> np.ndarray:
        """Per row of t: it names a function (not the "" of a worker with none above its peers)."""
        fci, fnames = self.codes("function")
        out: np.ndarray = fci != 0 if fnames.size and fnames[0] == "" else np.ones(fci.size, dtype=bool)
        return out


def _rows(t: pa.Table) -> _Rows:
    worker, step = _np(t, "worker").astype(np.int64), _np(t, "step").astype(np.int64)
    span = int(step.max() - step.min()) + 1
    _, first = np.unique(worker * span + (step - step.min()), return_index=True)
    ws, wi_all = np.unique(worker, return_inverse=True)
    return _Rows(t, first, ws, wi_all, step)


@dataclass(frozen=True)
class _OwnTest:
    """Every worker's own work against its peers' baseline over the window (arrays per worker index)."""

    shift: np.ndarray
    noise: float
    se: np.ndarray
    z: np.ndarray
    above: np.ndarray
    excess: np.ndarray
    wait_med: np.ndarray
    peer_wait_med: np.ndarray
    counted: np.ndarray  # steps with a baseline
    peer: np.ndarray  # per (worker, step) row: the baseline, its peers' median own work
    bar: float
    steps_above: np.ndarray  # per (worker, step) row: above its peers' baseline
    out: np.ndarray  # stands out
    basis: str = "own"  # "own": over the window's steps; "occurrence": over those a periodic function ran in
    at: np.ndarray | None = None  # "occurrence": per row of the worker table, whether its step is one of those


def _own_test(
    rows: _Rows,
    own: np.ndarray,
    peer: np.ndarray,
    peer_wait: np.ndarray,
    dp: DiagnosisPolicy,
    n_results: int,
    noise: float | None = None,
    tested: int = 1,
    need: int = 0,
) -> _OwnTest:
    """The test of every worker's own work against ``peer`` (per (worker, step) row; NaN: that step not tested).
    ``noise``: the job's (by default from these rows); ``tested``: how many such tests chance has (the bar's);
    ``need``: the steps it must be above its peers in (by default ``persistence`` of those it has a baseline in)."""
    wi, n = rows.wi, rows.ws.size
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(peer > 0, own / peer - 1.0, np.nan)
        e = (own - peer) / rows.col("step_time_us")
    shift = group_median(r, wi, n)
    spread = 1.4826 * group_median(np.abs(r - shift[wi]), wi, n)
    if noise is None:
        noise = float(max(np.nanmedian(spread) if np.isfinite(spread).any() else 0.0, dp.rel_floor))
    counted = np.bincount(wi, weights=np.isfinite(r), minlength=n)
    # the shift is a median over the worker's steps: its standard error is ~1.2533 noise / sqrt(steps)
    se = 1.2533 * noise / np.sqrt(np.maximum(counted, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        z = shift / se
    n_above = np.bincount(wi, weights=np.nan_to_num(r) > 0, minlength=n)
    above = n_above / np.maximum(counted, 1)
    excess = group_median(e, wi, n)
    wait_med, peer_wait_med = group_median(rows.col("wait_us"), wi, n), group_median(peer_wait, wi, n)
    bar = threshold(dp, int(np.count_nonzero(np.isfinite(z))) * tested)
    with np.errstate(invalid="ignore"):
        out = (
            (z >= bar)
            & (shift >= dp.localise_min_shift)
            & (excess >= dp.min_excess_share)
            & (above >= dp.persistence)
            & (n_above >= need)
            & (wait_med < peer_wait_med)
            & (counted >= min(dp.min_persistent_steps, n_results))
        )
    return _OwnTest(
        shift, noise, se, z, above, excess, wait_med, peer_wait_med, counted, peer, bar, np.nan_to_num(r) > 0, out
    )


def _peeled(
    rows: _Rows,
    own: np.ndarray,
    gk: np.ndarray,
    first: _OwnTest,
    in_function: np.ndarray,
    dp: DiagnosisPolicy,
    n_results: int,
) -> tuple[np.ndarray, list[_OwnTest]]:
    """Several culprits: once some workers stand out, the others are tested again against baselines (their peers'
    median own work and waits) without them, until no more stands out (a second straggler among few peers lifts
    their median and their noise, and hides; the victims, whose waits it sets, are no baseline for it either).
    ``in_function``: per worker index, whether it stood out in one function (left out of the baselines too, not
    tested again).  Returns per worker index the test that named it (-1: none; -2: it stood out in a function) and
    the tests."""
    tests, named = [first], np.where(first.out, 0, np.where(in_function, -2, -1))
    n_keys = int(gk.max()) + 1
    while (named != -1).any() and len(tests) <= rows.ws.size:
        include = named[rows.wi] == -1
        peer = others_median(own, gk, n_keys, include)
        peer_wait = others_median(rows.col("wait_us"), gk, n_keys, include)
        again = _own_test(rows, own, peer, peer_wait, dp, n_results)
        new = again.out & (named == -1)
        if not new.any():
            break
        named[new] = len(tests)
        tests.append(again)
    return named, tests


def _by_occurrence(
    results: list[StepResult], p: Periods, rows: _Rows, own: np.ndarray, first: _OwnTest, dp: DiagnosisPolicy
) -> list[_OwnTest]:
    """Persistence by occurrence: per function that runs periodically in some of the window's steps (:func:`periods`:
    a checkpoint every third step), the own-work test over the steps it ran in alone (a worker slow at each of a
    checkpoint's occurrences is within the noise over the window's steps: its median over them is of steps without
    one).  Its noise is the larger of the job's and that of those steps: their ratios' standard deviation around each
    worker's mean, pooled over the workers (a checkpoint's write varies more than the rest of the step; of three
    steps a worker's median absolute deviation is one of two gaps and tells little).  It must be above its peers at
    :func:`periodic_need` of them.  The straggler waits least over the window's steps, not those: the others wait
    for it at the next collective, often in the next step."""
    some = np.flatnonzero(p.periodic & (p.count < len(results)))
    gci, gnames = rows.codes("group")
    out = []
    for k in some.tolist():  # the window's few periodic functions
        group = str(p.keys[k]).split("\x1f", 1)[0]
        g_at = int(np.searchsorted(gnames, group))
        in_group = gci == g_at if g_at < gnames.size and gnames[g_at] == group else np.zeros(gci.size, dtype=bool)
        at = in_group & np.isin(rows.step, p.first[k] + p.every[k] * np.arange(p.count[k]))
        peer = np.where(at[rows.first], rows.col("peer_own_us"), np.nan)
        noise = max(first.noise, _pooled_sd(own, peer, rows.wi, rows.ws.size))
        need = int(periodic_need(p.count[k]))
        test = _own_test(rows, own, peer, rows.col("peer_wait_us"), dp, len(results), noise, some.size, need)
        out.append(replace(test, basis="occurrence", at=at))
    return out


def _pooled_sd(own: np.ndarray, peer: np.ndarray, wi: np.ndarray, n: int) -> float:
    """The standard deviation of ``own / peer - 1`` around each worker's mean, pooled over the workers (NaN rows
    left out; 0 where no worker has two)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = own / peer - 1.0
    ok = np.isfinite(r)
    count = np.bincount(wi[ok], minlength=n)
    mean = np.bincount(wi[ok], weights=r[ok], minlength=n) / np.maximum(count, 1)
    ss = float(np.sum((r[ok] - mean[wi[ok]]) ** 2))
    df = int(np.sum(np.maximum(count - 1, 0)))
    return math.sqrt(ss / df) if df else 0.0


def localise(results: list[StepResult], dp: DiagnosisPolicy, window_periods: Periods | None = None) -> Standing:
    """The workers that stand out from their peers over the window's steps (:class:`Standing`).  ``window_periods``:
    :func:`periods` of the results' group tables, where the caller has them (else read from the results)."""
    t = _concat(results)
    if t is None:
        return NOBODY
    rows = _rows(t)
    wi, n = rows.wi, rows.ws.size
    own, peer = rows.col("own_us"), rows.col("peer_own_us")
    first = _own_test(rows, own, peer, rows.col("peer_wait_us"), dp, len(results))
    if np.isnan(first.shift).all():
        return NOBODY
    noise, z, bar, counted = first.noise, first.z, first.bar, first.counted
    wait_med, peer_wait_med = first.wait_med, first.peer_wait_med
    # the group's highest own work in the step: above every other (the others' median is not enough for that, so
    # by the step's own maximum over the worker's group)
    gcode, step = rows.codes("group")[0][rows.first], rows.step[rows.first]
    gk = np.unique(gcode * (int(step.max() - step.min()) + 1) + (step - step.min()), return_inverse=True)[1]
    top = np.full(int(gk.max()) + 1, -np.inf)
    np.maximum.at(top, gk, own)
    holds = np.bincount(wi, weights=own >= top[gk], minlength=n) / np.maximum(counted, 1)
    # per worker: the workers of its peer group (its group in its first step)
    wg = np.zeros(n, dtype=np.int64)
    wg[wi[::-1]] = gcode[::-1]
    n_peers = np.bincount(wg, minlength=int(wg.max()) + 1)[wg]
    shifts, fn_bar = _by_function(results, rows, dp, counted, n_peers)
    by_function = {
        i: fs
        for i, fs in shifts.items()
        if not first.out[i] and wait_med[i] < peer_wait_med[i]  # the straggler waits least
    }
    named, tests = _peeled(rows, own, gk, first, np.isin(np.arange(n), list(by_function)), dp, len(results))
    groups_t = _concat(results, "groups")
    if window_periods is None and groups_t is not None:
        window_periods = periods(groups_t, results[0].step, results[-1].step)
    occurring = [] if window_periods is None else _by_occurrence(results, window_periods, rows, own, first, dp)
    if occurring:  # each worker by the periodic function it stands out most at
        z_at = np.stack([np.where(o.out, o.z, -np.inf) for o in occurring])
        new = np.isfinite(z_at.max(axis=0)) & (named == -1)
        named[new] = len(tests) + np.argmax(z_at, axis=0)[new]
        tests += occurring
    idx = np.flatnonzero(named >= 0)
    k = int(np.argmax(np.where(np.isfinite(z), z, -np.inf)))
    top_z = float(z[k]) if np.isfinite(z[k]) else math.nan
    se_us, waits_more = first.se * group_median(peer, wi, n), wait_med > peer_wait_med
    best = _stands_out_in(rows, idx[[tests[named[i]].at is None for i in idx.tolist()]])
    for i in idx.tolist():
        if (at := tests[named[i]].at) is not None:
            best |= _stands_out_in(rows, np.array([i]), at)

    def label(name: str, i: int) -> str:  # the worker's host, device or group (in its first step)
        codes, names = rows.codes(name)
        return str(names[codes[rows.first][np.argmax(wi == i)]])

    # several of a small group slow in one function (:func:`_split`): one split per (group, function), the most
    # certain, none where a fast worker stands out itself.  A slow one that stands out by its own work is named in
    # that function where its gap over the fast ones is more than its excess in the one it stands out in most
    # (against its group's median, which another slow worker lifts there)
    named_by = np.isin(np.arange(n), [*idx.tolist(), *by_function])
    splits: dict[tuple[str, str], _Split] = {}
    for sp in [] if groups_t is None else _split(groups_t, rows, dp, own, window_periods, len(results)):
        if (sp.group, sp.function) not in splits and not named_by[sp.fast].any():
            splits[(sp.group, sp.function)] = sp
            for i in sp.slow:
                if i in best and not (best[i][0] and best[i][2] - best[i][3] >= sp.work_us - sp.fast_work_us):
                    best[i] = (sp.function, sp.kind, sp.work_us, sp.fast_work_us)
    # a second culprit in the function a first stands out in, against the rest of its group (the highest left out)
    named_in = {i: best[i][0] for i in idx.tolist()} | {i: fs.function for i, fs in by_function.items()}
    targets = {(label("group", i), f) for i, f in named_in.items() if f}
    while targets and groups_t is not None:
        found = {
            i: fs
            for i, fs in _beside(rows, dp, counted, groups_t, targets, named_by, fn_bar).items()
            if wait_med[i] < peer_wait_med[i]  # the straggler waits least
        }
        named_by[list(found)] = True
        by_function |= found
        targets = {(label("group", i), fs.function) for i, fs in found.items()}
    # the splits' slow workers that nothing else named
    split_named: list[tuple[int, _Split]] = []
    for sp in splits.values():
        split_named += [(i, sp) for i in sp.slow if not named_by[i]]
        named_by[sp.slow] = True

    def located(i: int, **what: Any) -> Localised:  # the worker's labels, and what stood out
        return Localised(
            worker=int(rows.ws[i]),
            host=label("host", i),
            device=label("device", i),
            holds=float(holds[i]),
            **{"group": label("group", i), **what},
        )

    localised = []
    for i in idx.tolist():  # the few that stand out (one per culprit), not every worker
        ot, mine = tests[named[i]], wi == i
        localised.append(
            located(
                i,
                function=best[i][0],
                kind=best[i][1],
                shift=float(ot.shift[i]),
                noise=ot.noise,
                z=float(ot.z[i]),
                above=float(ot.above[i]),
                steps=sorted(int(s) for s in step[mine & ot.steps_above]),
                n_steps=int(ot.counted[i]),
                peers=int(np.unique(wi[gcode == gcode[mine][0]]).size),
                own_us=float(np.median(own[mine & np.isfinite(ot.peer)])),
                peer_own_us=float(np.nanmedian(ot.peer[mine])),
                wait_us=float(ot.wait_med[i]),
                peer_wait_us=float(ot.peer_wait_med[i]),
                work_us=best[i][2],
                peer_work_us=best[i][3],
                excess_share=float(ot.excess[i]),
                basis=ot.basis,
            )
        )
    own_idx = set(idx.tolist())
    localised += [
        located(
            i,
            function=fs.function,
            kind=fs.kind,
            shift=fs.shift,
            noise=fs.noise,
            z=fs.z,
            above=fs.above,
            steps=fs.steps,
            n_steps=int(counted[i]),
            peers=int(n_peers[i]),
            own_us=float(np.median(own[wi == i])),
            peer_own_us=float(np.nanmedian(peer[wi == i])),
            wait_us=float(wait_med[i]),
            peer_wait_us=float(peer_wait_med[i]),
            work_us=fs.work_us,
            peer_work_us=fs.peer_work_us,
            excess_share=fs.excess_share,
            basis="function",
            bar=fs.bar,
        )
        for i, fs in by_function.items()
        if i not in own_idx
    ]
    localised += [
        located(
            i,
            group=sp.group,
            function=sp.function,
            kind=sp.kind,
            shift=sp.shift,
            noise=math.nan,
            z=sp.z,
            above=len(sp.steps) / max(sp.n_steps, 1),
            steps=sp.steps,
            n_steps=sp.n_steps,
            peers=len(sp.slow) + len(sp.fast),
            own_us=float(np.median(own[wi == i])),
            peer_own_us=float(np.median(own[np.isin(wi, sp.fast)])),
            wait_us=float(wait_med[i]),
            peer_wait_us=float(np.median(wait_med[sp.fast])),
            work_us=sp.work_us,
            peer_work_us=sp.fast_work_us,
            excess_share=sp.gap_share,
            basis="split",
            bar=sp.bar,
            slow=[int(w) for w in rows.ws[sp.slow]],
            fast=[int(w) for w in rows.ws[sp.fast]],
        )
        for i, sp in split_named
    ]
    return Standing(localised, int(rows.ws[k]), float(first.shift[k]), top_z, noise, rows.ws, z, bar, se_us, waits_more)


def _stands_out_in(
    rows: _Rows, idx: np.ndarray, at: np.ndarray | None = None
) -> dict[int, tuple[str, str, float, float]]:
    """Per worker index in ``idx``: the function it stands out in, the one whose work is most above its group's
    median summed over the window (or the rows ``at`` marks) (its name, kind, and the medians over steps of its work
    and its peers'; "" and NaN where it has none)."""
    wi_all, n = rows.wi_all, rows.ws.size
    if idx.size == 0:
        return {}
    fci, fnames = rows.codes("function")
    nf = fnames.size
    work, peer_work = rows.all("work_us"), rows.all("peer_work_us")
    has = rows.with_function() & np.isin(wi_all, idx) & (True if at is None else at)
    combo = wi_all[has] * nf + fci[has]
    over = np.bincount(combo, weights=(work - peer_work)[has], minlength=n * nf)
    over = np.where(np.bincount(combo, minlength=n * nf) > 0, over, -np.inf).reshape(n, nf)
    best = np.argmax(over, axis=1)  # per worker: its function most above its peers (-inf: none)
    kci, kinds = rows.codes("kind")
    out: dict[int, tuple[str, str, float, float]] = {}
    for i in idx.tolist():
        b = int(best[i])
        if not np.isfinite(over[i, b]):
            out[i] = ("", "", math.nan, math.nan)
            continue
        fr = np.flatnonzero(has & (wi_all == i) & (fci == b))
        out[i] = (str(fnames[b]), str(kinds[kci[fr[0]]]), float(np.median(work[fr])), float(np.median(peer_work[fr])))
    return out


@dataclass(frozen=True)
class _FunctionShift:
    function: str
    kind: str
    shift: float  # median over steps of (work - group median) / its peers' own work
    noise: float  # the function's spread across the group, as a share of the step
    z: float
    bar: float
    above: float
    steps: list[int]
    work_us: float
    peer_work_us: float
    excess_share: float  # median over steps of (work - group median) / step time


def _by_function(
    results: list[StepResult], rows: _Rows, dp: DiagnosisPolicy, counted: np.ndarray, n_peers: np.ndarray
) -> tuple[dict[int, _FunctionShift], float]:
    """Per worker index: its function that stands out most from its group's in the window (:data:`__doc__`), for
    the workers that have one; and the standard errors they needed."""
    keys, spread, tested = _function_noise(results, dp)
    # every (worker, function) that could have stood out was tested: chance gives the largest of them more
    bar = threshold(dp, int(np.count_nonzero(n_peers >= 2)) * max(tested, 1))
    has = rows.with_function() & (n_peers[rows.wi_all] >= 2)
    if not has.any():
        return {}, bar
    # reported: per (worker, step), 0 where the function was not among its rows (not above its group's median)
    steps, si, reported = rows.by_step()
    (fci, fnames), (gci, gnames), (kci, kinds) = rows.codes("function"), rows.codes("group"), rows.codes("kind")
    # one (worker, function) pair per row: integer keys (a string per row costs a second at 10,000 workers)
    combos, ci = np.unique(rows.wi_all[has] * fnames.size + fci[has], return_inverse=True)
    cw, cf = combos // fnames.size, fnames[combos % fnames.size]
    cgi, cki = np.zeros(combos.size, dtype=np.int64), np.zeros(combos.size, dtype=np.int64)
    cgi[ci], cki[ci] = gci[has], kci[has]
    ckey = np.char.add(np.char.add(gnames[cgi], "\x1f"), cf)
    if keys.size:
        at = np.minimum(np.searchsorted(keys, ckey), keys.size - 1)
        noise = np.where(keys[at] == ckey, spread[at], np.nan)
    else:
        noise = np.full(combos.size, np.nan)
    ck = kinds[cki]
    work, peer_work = rows.all("work_us")[has], rows.all("peer_work_us")[has]
    st, peer_own = rows.all("step_time_us")[has], rows.all("peer_own_us")[has]
    # in a pair the group's median is the mean of the two: the worker's excess over its only peer is twice its
    # excess over that median
    pair_row = n_peers[rows.wi_all[has]] == 2
    over = np.where(pair_row, 2.0, 1.0) * (work - peer_work)
    with np.errstate(invalid="ignore", divide="ignore"):
        x_step = np.zeros((combos.size, steps.size))
        x_own = np.zeros((combos.size, steps.size))
        x_work = np.zeros((combos.size, steps.size))
        np.add.at(x_step, (ci, si[has]), over / st)
        np.add.at(x_own, (ci, si[has]), np.where(peer_own > 0, over / peer_own, np.nan))
        np.add.at(x_work, (ci, si[has]), work / st)
    mask = ~reported[cw]
    x_step[mask], x_own[mask], x_work[mask] = np.nan, np.nan, np.nan
    n = np.maximum(counted[cw], 1)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # a worker whose peers' own work is 0 in every step
        excess, shift = _row_nanmedian(x_step), _row_nanmedian(x_own)
        pair = n_peers[cw] == 2
        if pair.any():
            # a pair has no spread across peers to compare with (that of two is half their difference, the shift
            # itself): the excess's own step-to-step spread instead, as the own-work test's noise
            s2s = 1.4826 * _row_nanmedian(np.abs(x_step[pair] - excess[pair, None]))
            noise[pair] = np.fmax(s2s, dp.rel_floor * _row_nanmedian(np.where(x_work[pair] > 0, x_work[pair], np.nan)))
        z = excess / (1.2533 * noise / np.sqrt(n))
    above = np.sum(np.nan_to_num(x_step) > 0, axis=1) / n
    ok = (
        np.isfinite(z)
        & (z >= bar)
        & (shift >= dp.localise_min_shift)
        & (excess >= dp.min_excess_share)
        & (above >= dp.persistence)
        & (counted[cw] >= min(dp.min_persistent_steps, len(results)))
    )
    out: dict[int, _FunctionShift] = {}
    for c in np.flatnonzero(ok)[np.argsort(-z[ok], kind="stable")].tolist():
        i = int(cw[c])
        if i in out:
            continue
        r = np.flatnonzero(has)[ci == c]
        out[i] = _FunctionShift(
            function=str(cf[c]),
            kind=str(ck[c]),
            shift=float(shift[c]),
            noise=float(noise[c]),
            z=float(z[c]),
            bar=bar,
            above=float(above[c]),
            steps=sorted(int(s) for s in steps[np.nan_to_num(x_step[c]) > 0]),
            work_us=float(np.median(rows.all("work_us")[r])),
            peer_work_us=float(np.median(rows.all("peer_work_us")[r])),
            excess_share=float(excess[c]),
        )
    return out, bar


def _beside(
    rows: _Rows,
    dp: DiagnosisPolicy,
    counted: np.ndarray,
    g: pa.Table,
    targets: set[tuple[str, str]],
    done: np.ndarray,
    bar: float,
) -> dict[int, _FunctionShift]:
    """A second culprit beside a first: per (group, function) in ``targets`` (a worker of the group stands out in
    it), the group's other workers (not ``done``) tested in it as :func:`_by_function` does, under its ``bar``, but
    against the rest of the group: the median and spread of its work without its highest worker in each step (the
    group table's ``work_rest_us``; groups of 3 or more).  Two culprits of four lift the group's median halfway to
    theirs and its spread with it, and each hides the other; without the highest, the baseline is a healthy worker's
    whichever of the two is highest in a step.  Per worker index, for those that stand out."""
    steps, si, reported = rows.by_step()
    n, n_s = rows.ws.size, steps.size
    (fci, fnames), (gci, gnames), (kci, kinds) = rows.codes("function"), rows.codes("group"), rows.codes("kind")
    gg, gf, gs = _np(g, "group").astype(str), _np(g, "function").astype(str), _np(g, "step")
    rest, rest_mad, g_st = _np(g, "work_rest_us"), _np(g, "work_rest_mad_us"), np.maximum(_np(g, "step_time_us"), 1.0)
    work, st, peer_own = rows.all("work_us"), rows.all("step_time_us"), rows.all("peer_own_us")
    out: dict[int, _FunctionShift] = {}
    for group, function in sorted(targets):  # one per culprit named: a few
        cell = (gg == group) & (gf == function) & np.isfinite(rest) & np.isin(gs, steps)
        g_at, f_at = np.searchsorted(gnames, group), np.searchsorted(fnames, function)
        if not cell.any() or g_at >= gnames.size or gnames[g_at] != group or f_at >= fnames.size:
            continue
        base = np.full(n_s, np.nan)
        base[np.searchsorted(steps, gs[cell])] = rest[cell]
        noise = max(
            float(np.median(1.4826 * rest_mad[cell] / g_st[cell])),
            dp.rel_floor * float(np.median(rest[cell] / g_st[cell])),
        )
        mine = (gci == g_at) & (fci == f_at) & ~done[rows.wi_all]
        wr, sr = rows.wi_all[mine], si[mine]
        over = work[mine] - base[sr]
        x_step, x_own = np.zeros((n, n_s)), np.zeros((n, n_s))
        x_step[wr, sr], x_own[wr, sr] = over / st[mine], np.where(peer_own[mine] > 0, over / peer_own[mine], np.nan)
        x_step[~reported | np.isnan(base)[None, :]] = np.nan
        x_own[~reported | np.isnan(base)[None, :]] = np.nan
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            excess, shift = _row_nanmedian(x_step), _row_nanmedian(x_own)
            m = np.maximum(np.sum(np.isfinite(x_step), axis=1), 1)
            z = excess / (1.2533 * noise / np.sqrt(m))
        above = np.sum(np.nan_to_num(x_step) > 0, axis=1) / m
        ok = (
            np.isin(np.arange(n), np.unique(wr))
            & np.isfinite(z)
            & (z >= bar)
            & (shift >= dp.localise_min_shift)
            & (excess >= dp.min_excess_share)
            & (above >= dp.persistence)
            & (counted >= min(dp.min_persistent_steps, n_s))
        )
        for i in np.flatnonzero(ok).tolist():
            if i in out and out[i].z >= z[i]:
                continue
            r = np.flatnonzero(mine)[wr == i]
            out[i] = _FunctionShift(
                function=function,
                kind=str(kinds[kci[r[0]]]),
                shift=float(shift[i]),
                noise=noise,
                z=float(z[i]),
                bar=bar,
                above=float(above[i]),
                steps=sorted(int(s) for s in steps[np.nan_to_num(x_step[i]) > 0]),
                work_us=float(np.median(work[r])),
                peer_work_us=float(np.nanmedian(base[si[r]])),
                excess_share=float(excess[i]),
            )
    return out


@dataclass(frozen=True)
class _Split:
    """A small group that splits the same way in one function in most steps: its slow workers and its fast ones."""

    group: str
    function: str
    kind: str
    slow: list[int]  # worker indexes
    fast: list[int]
    steps: list[int]  # the steps in which it split so
    n_steps: int  # the steps the group ran the function in
    z: float  # its count of such steps against chance (the normal quantile of the binomial tail)
    bar: float
    gap_share: float  # the least slow worker's excess: the least over the slow workers of their median over those
    # steps of (work - the fast workers' median) / step
    shift: float  # ... in µs / the fast workers' own work
    work_us: float  # the fast workers' median work (the median over those steps) plus that excess
    fast_work_us: float  # ... the fast workers' median work


def _binomial_tail(k: np.ndarray, n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """P(X >= k) for X ~ Binomial(n, p), elementwise (n up to a window's steps)."""
    top = int(n.max()) if n.size else 0
    j = np.arange(top + 1)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, top + 1)))])
    with np.errstate(divide="ignore"):
        log_pmf = (
            log_fact[n][:, None]
            - log_fact[j][None, :]
            - log_fact[np.clip(n[:, None] - j[None, :], 0, None)]
            + j[None, :] * np.log(p)[:, None]
            + (n[:, None] - j[None, :]) * np.log1p(-p)[:, None]
        )
    take = (j[None, :] >= k[:, None]) & (j[None, :] <= n[:, None])
    out: np.ndarray = np.sum(np.where(take, np.exp(log_pmf), 0.0), axis=1)
    return out


def _split(
    g: pa.Table, rows: _Rows, dp: DiagnosisPolicy, own: np.ndarray, p: Periods | None, n_steps: int
) -> list[_Split]:
    """Several of a small group slow in one function (two of three, two or three of four, two to four of eight):
    each slow worker's group median is another slow worker's work, or halfway to it, and none stands out from it.  What shows instead is how the group splits:
    the same k of its N workers (2 <= k < N) the slowest in the function, in more of the steps than chance makes any
    k of N the slowest (a binomial tail, 1 / C(N, k) a step; under the bar of every such set of every (group,
    function), Bonferroni as :func:`threshold`), in ``persistence`` of them, each of them above the others' median by
    at least ``min_excess_share`` of the step and ``localise_min_shift`` of the others' own work (its median over
    those steps, as :func:`_by_function` measures a worker's excess; not the gap between the sides, the fastest slow
    worker's work - the slowest fast one's, which a fast worker near the slow ones makes small: issue 21's twelfth
    pass), and the slow ones' own work (the step minus their waits) above the others' by at least half that gap
    between the sides: what they lose there they do not make up elsewhere, so the others wait for them (fast
    workers that are slower in another function are no slow majority's victims).  Groups of 3 to
    ``split_peers_max`` workers (the step stage's ``order``), k as :func:`_slow_sides`; a single slow worker is the
    median's to find.  Own work is compared over the steps that run the function where it occurs periodically
    (:func:`periods`: a checkpoint every third step), over the window's steps otherwise: a checkpoint's cost is in
    the steps it runs in, and the median over the window is of steps without one (persistence by occurrence, as
    :func:`_by_occurrence`; issue 21's fourteenth pass).
    ``own``: per (worker, step) of ``rows``, the worker's own work; ``p``: the window's :func:`periods` (None: none
    periodic); ``n_steps``: the window's steps."""
    kind = _np(g, "kind").astype(str)
    order, order_work = g.column("order").combine_chunks(), g.column("order_work_us").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(order), 0).to_numpy(zero_copy_only=False)
    starts = order.offsets.to_numpy()[:-1]
    ranks, works = order.values.to_numpy(zero_copy_only=False), order_work.values.to_numpy(zero_copy_only=False)
    keep = ~np.isin(kind, WAITING_KINDS) & (lengths >= 3) & (lengths <= dp.split_peers_max)
    if not keep.any():
        return []
    gcode = np.unique(_np(g, "group").astype(str), return_inverse=True)
    fcode = np.unique(_np(g, "function").astype(str), return_inverse=True)
    step, st = _np(g, "step"), np.maximum(_np(g, "step_time_us"), 1.0)
    cells, cell_of = np.unique(np.stack([gcode[1], fcode[1]], axis=1)[keep], axis=0, return_inverse=True)
    runs = np.bincount(cell_of.ravel(), minlength=cells.shape[0])  # one row per (group, function) and step
    n_cell = np.zeros(cells.shape[0], dtype=np.int64)
    n_cell[cell_of.ravel()] = lengths[keep]
    tested = int(sum(math.comb(n, k) for n in n_cell.tolist() for k in _slow_sides(n, dp)))
    wi, w_step = rows.wi, rows.step[rows.first]
    own_med = group_median(own, wi, rows.ws.size)  # per worker index, over the window's steps
    periodic = set() if p is None else set(p.keys[p.periodic & (p.count < n_steps)].tolist())
    bar = threshold(dp, tested)
    p_bar = NormalDist().cdf(-bar)
    candidates: list[tuple[float, _Split]] = []
    for n in np.unique(lengths[keep]).tolist():
        sub = np.flatnonzero(keep & (lengths == n))
        at = starts[sub][:, None] + np.arange(n)[None, :]
        r, v = ranks[at], works[at]  # (rows, n): fastest first
        sub_cell = cell_of.ravel()[np.isin(np.flatnonzero(keep), sub)]
        for k in _slow_sides(n, dp):
            by_rank = np.argsort(r[:, n - k :], axis=1)
            slow = np.take_along_axis(r[:, n - k :], by_rank, axis=1)
            fast_med = np.median(v[:, : n - k], axis=1)
            # each slow worker's excess over the fast ones' median (columns: the slow workers, by rank)
            over = np.take_along_axis(v[:, n - k :], by_rank, axis=1) - fast_med[:, None]
            sets, inv, count = np.unique(
                np.concatenate([sub_cell[:, None], slow], axis=1), axis=0, return_inverse=True, return_counts=True
            )
            inv = inv.ravel()
            cell = sets[:, 0]
            tail = _binomial_tail(count, runs[cell], np.full(cell.size, 1.0 / math.comb(n, k)))
            # the least of the slow workers' median excess (as :func:`_by_function` measures a worker's), over the
            # steps the set split so: of the step, and in µs
            share = np.min([group_median(over[:, j] / st[sub], inv, sets.shape[0]) for j in range(k)], axis=0)
            gap_us = np.min([group_median(over[:, j], inv, sets.shape[0]) for j in range(k)], axis=0)
            # what separates the two sides: the fastest slow worker's work - the slowest fast one's
            sep_us = group_median(v[:, n - k] - v[:, n - k - 1], inv, sets.shape[0])
            ok = (tail <= p_bar) & (count >= dp.persistence * runs[cell]) & (share >= dp.min_excess_share)
            for c in np.flatnonzero(ok).tolist():  # the few sets that split their group persistently
                mine = inv == c
                slow_i = np.searchsorted(rows.ws, sets[c, 1:])
                group_i = np.searchsorted(rows.ws, np.unique(r[mine]))
                if (slow_i >= rows.ws.size).any() or (group_i >= rows.ws.size).any():
                    continue  # a rank the worker table does not have
                if not (np.array_equal(rows.ws[slow_i], sets[c, 1:]) and np.isin(rows.ws[group_i], r[mine]).all()):
                    continue
                fast_i = np.setdiff1d(group_i, slow_i)
                gname, fname = str(gcode[0][cells[cell[c], 0]]), str(fcode[0][cells[cell[c], 1]])
                med = own_med
                if f"{gname}\x1f{fname}" in periodic:  # at the function's occurrences
                    at = np.isin(w_step, step[sub][sub_cell == cell[c]])
                    med = group_median(own[at], wi[at], rows.ws.size)
                with np.errstate(invalid="ignore", divide="ignore"):
                    shift = float(gap_us[c] / np.median(med[fast_i]))
                lost = float(np.median(med[slow_i]) - np.median(med[fast_i]))
                if not (shift >= dp.localise_min_shift and lost >= 0.5 * sep_us[c]):
                    continue
                split = _Split(
                    group=gname,
                    function=fname,
                    kind=str(kind[sub][mine][0]),
                    slow=slow_i.tolist(),
                    fast=fast_i.tolist(),
                    steps=sorted(int(s) for s in step[sub][mine]),
                    n_steps=int(runs[cell[c]]),
                    # the upper quantile from the tail itself: 1 - tail is 1.0 in floats once a long window's tail
                    # is below ~1e-16 (two of four the slowest in each of a 24-step window's steps: (1/6)^24, 2e-19)
                    z=-NormalDist().inv_cdf(min(max(float(tail[c]), 1e-300), 0.5)),
                    bar=bar,
                    gap_share=float(share[c]),
                    shift=shift,
                    work_us=float(gap_us[c] + np.median(fast_med[mine])),
                    fast_work_us=float(np.median(fast_med[mine])),
                )
                candidates.append((float(tail[c]), split))
    candidates.sort(key=lambda t: t[0])  # the most certain first
    return [s for _, s in candidates]


def _slow_sides(n: int, dp: DiagnosisPolicy) -> range:
    """How many of a group of ``n`` may be its slow side: 2 to n - 1 in groups of up to ``ratio_peers_max`` (two of
    three slow), 2 to n / 2 in bigger ones (where most are slow, one or two fast workers are more likely fast)."""
    return range(2, n if n <= dp.ratio_peers_max else n // 2 + 1)


def _row_nanmedian(x: np.ndarray) -> np.ndarray:
    """``np.nanmedian(x, axis=1)`` of a 2-D array by one sort (NaN sorts last), without its warnings and its slow
    path for many short rows; NaN for a row with no value."""
    s = np.sort(x, axis=1)
    k = np.sum(~np.isnan(x), axis=1)
    r = np.arange(x.shape[0])
    lo, hi = np.maximum((k - 1) // 2, 0), np.maximum(k // 2, 0)
    out: np.ndarray = np.where(k > 0, (s[r, lo] + s[r, np.minimum(hi, x.shape[1] - 1)]) / 2.0, np.nan)
    return out


def _function_noise(results: list[StepResult], dp: DiagnosisPolicy) -> tuple[np.ndarray, np.ndarray, int]:
    """Per (group, function) of the window, not waiting, in groups of 3 or more (keys ``group \\x1f function``,
    sorted): the spread of its work across the group's workers as a share of the step (1.4826 x MAD / step time,
    the median over steps; at least ``rel_floor`` of its median work; NaN for a function the group's median worker
    does not run); and how many functions (not waiting) the window's groups of 2 or more ran, each of which could
    have stood out."""
    parts = [r.groups for r in results if r.groups is not None and r.groups.num_rows]
    if not parts:
        return np.array([], dtype=str), np.array([]), 0
    g = pa.concat_tables(parts)
    working, workers = ~np.isin(_np(g, "kind").astype(str), WAITING_KINDS), _np(g, "workers")
    tested = int(np.unique(_np(g, "function").astype(str)[working & (workers >= 2)]).size)
    keep = working & (workers >= 3)
    if not keep.any():
        return np.array([], dtype=str), np.array([]), tested
    key = np.char.add(np.char.add(_np(g, "group").astype(str)[keep], "\x1f"), _np(g, "function").astype(str)[keep])
    keys, ki = np.unique(key, return_inverse=True)
    st = np.maximum(_np(g, "step_time_us")[keep], 1.0)
    spread = group_median(1.4826 * _np(g, "work_mad_us")[keep] / st, ki, keys.size)
    floor = dp.rel_floor * group_median(_np(g, "work_us")[keep] / st, ki, keys.size)
    noise = np.fmax(spread, floor)
    # a function its group's median worker does not run (one rank's own code) has no spread to compare with
    noise[~(floor > 0)] = math.nan
    return keys, noise, tested
