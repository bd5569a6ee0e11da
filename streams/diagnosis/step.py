"""Step analysis: compare every worker with its peers in one step.

Pure and vectorised.  The step's function tables become (workers x functions)
matrices.  For each (peer group, function) cell it takes the median and MAD of
the function's *work* (critical-path time minus time spent waiting for peers)
and flags the (worker, function) entries whose work lies far above their
peers'.  A function that a worker did not run counts as no work, as long as
some worker of its group ran it: code that runs on one rank only is a deviation
like any other.

Waiting: a collective's duration includes the time a worker waited for the
last arrival.  Where the summary carries no locally measured ``wait_us``, the
wait is estimated as the excess over the shortest instance in the peer group:
the last worker to arrive waits least, so its duration is the pure transfer.
That keeps the victims of a slow worker from being blamed.

Collectives whose time is shared by everyone (a ring runs at the speed of its
slowest link) cannot show a culprit by time, nor by the *mean* throughput of
their links: every member carries the same bytes in the same time.  What shows
the culprit is the shape of its link's samples: the slowest link is saturated
(steady, low sd/mean) while its ring-mates' links burst at their own capacity
and idle (sd/mean 1 and more, or peaks far above).  Ring-mates are found
without knowing the communicators: the links of one collective whose mean
throughputs agree (the members of one ring share its rate).  The what-if
excess is the transfer at the ring-mates' capacity.

The result is small: the flagged entries with their hardware characteristics
and their peers' medians, plus per-(group, function) aggregates for the
window stage's group, job-wide and history checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ...schemas import functions as ft
from ..policy import DiagnosisPolicy
from .frame import StepFrame
from .stats import Layout, group_median, group_or, majority_bits, others_extremes

WAITING_KINDS = ("collective", "p2p")
#: link throughputs checked for collectives (their time is shared by the whole ring, so it cannot show the culprit),
#: and the resource of the collectives that run over that link alone
LINK_METRICS = {"nic_gbps": "nic", "nvlink_gbps": "nvlink"}

#: the shape (spread, peak) of the link metrics' samples: what tells a ring's culprit from its ring-mates
LINK_SHAPE = tuple(f"{m}{x}" for m in LINK_METRICS for x in ("_sd", "_p95"))
#: per-row characteristics carried for flagged rows, with their peers' medians
EVIDENCE_COLUMNS = ("calls", "total_us", "mean_us", "p95_us", "bytes") + ft.HARDWARE + LINK_SHAPE
#: peers' medians of the evidence columns come from at most this many workers per group
EVIDENCE_SAMPLE = 64
#: per-worker characteristics carried with each flagged row, with their peers' medians: the bytes the worker
#: copied to its devices in the step (functions of kind ``memcpy``: the size of its input batch)
WORKER_COLUMNS = ("input_bytes",)

OUTLIER_SCHEMA = pa.schema(
    [
        ("worker", pa.int64()),
        ("host", pa.string()),
        ("device", pa.string()),
        ("nic", pa.string()),
        ("switch", pa.string()),
        ("group", pa.string()),
        ("function", pa.string()),
        ("kind", pa.string()),
        ("resource", pa.string()),
        # what deviated: work (robust z against the group), ratio (work against the slowest other worker of a small
        # group; ``z`` is then the rise over it), hardware (a saturated link); low: work far *below* the peers'
        ("signal", pa.string()),
        ("peers", pa.int32()),  # workers in the peer group (the worker included); hardware: the links compared with
        ("present", pa.int32()),  # ... of which ran the function in this step
        ("work_us", pa.float64()),
        ("peer_work_us", pa.float64()),
        ("peer_mad_us", pa.float64()),
        ("z", pa.float64()),
        ("excess_us", pa.float64()),
        ("wait_us", pa.float64()),
        ("step_time_us", pa.float64()),
        ("worker_work_us", pa.float64()),
        ("has_hardware", pa.bool_()),
        ("clock_events", pa.uint64()),
        ("peer_clock_events", pa.uint64()),
    ]
    + [(c, pa.float64()) for c in EVIDENCE_COLUMNS + WORKER_COLUMNS]
    + [(f"peer_{c}", pa.float64()) for c in EVIDENCE_COLUMNS + WORKER_COLUMNS]
)

#: each worker's own work in the step against its peers' (the localisation's input, :mod:`.localise`): one row per
#: worker and each of its TOP_FUNCTIONS functions (not waiting) most above their peers' median work
TOP_FUNCTIONS = 3
WORKER_SCHEMA = pa.schema(
    [
        ("worker", pa.int64()),
        ("host", pa.string()),
        ("device", pa.string()),
        ("group", pa.string()),
        ("step_time_us", pa.float64()),
        ("own_us", pa.float64()),  # the worker's own work: the step minus its waits at collectives
        ("peer_own_us", pa.float64()),  # the median of its peer group's others' own work (the worker left out)
        ("wait_us", pa.float64()),  # its waits at collectives
        ("peer_wait_us", pa.float64()),  # the others' median
        ("function", pa.string()),  # one of its functions most above its peers ("" when none is)
        ("kind", pa.string()),
        ("work_us", pa.float64()),  # its work in it
        ("peer_work_us", pa.float64()),  # its group's median work in it
    ]
)

GROUP_SCHEMA = pa.schema(
    [
        ("group", pa.string()),
        ("function", pa.string()),
        ("kind", pa.string()),
        ("resource", pa.string()),
        ("workers", pa.int32()),  # workers in the group
        ("present", pa.int32()),  # ... that ran the function
        ("work_us", pa.float64()),  # median over the group's workers (0 for those that did not run it)
        ("work_mad_us", pa.float64()),
        # median and MAD over the group's workers but its highest in the function, groups of 3 or more (NaN
        # elsewhere): a second culprit's baseline once the first is named (two of four lift the median halfway)
        ("work_rest_us", pa.float64()),
        ("work_rest_mad_us", pa.float64()),
        # groups of 3 to split_peers_max workers that all ran the function (empty elsewhere): the workers' ranks from
        # the fastest in it to the slowest, and their work (where several of a small group are slow, its median is
        # one of theirs and no baseline; how the group splits is)
        ("order", pa.list_(pa.int64())),
        ("order_work_us", pa.list_(pa.float64())),
        ("wait_us", pa.float64()),  # median
        ("share", pa.float64()),  # critical-path share beta: (median work + median wait) / median step time
        ("step_time_us", pa.float64()),  # median step time of the group's workers
        ("clock_events", pa.uint64()),  # OR over the cell
    ]
    + [(c, pa.float64()) for c in ft.HARDWARE]  # means over the cell
)


@dataclass
class StepResult:
    job: str
    window: str
    step: int
    workers_seen: int
    step_time_us: float  # the synchronised step: slowest worker
    step_time_median_us: float
    work_max_us: float  # most work (step minus waits) of any worker
    healthy_work_max_us: float  # most work of any worker with no flagged function
    outliers: pa.Table  # OUTLIER_SCHEMA
    groups: pa.Table  # GROUP_SCHEMA
    workers: pa.Table | None = None  # WORKER_SCHEMA (None: a step stage older than the localisation)
    # the TCP connections of the workers whose first step of the window this is (CONNECTION_SCHEMA; None: none came)
    connections: pa.Table | None = None


def _encode(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Dictionary-encode a string column (or take a dictionary column's codes): (codes, names), every name used."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = arr if pa.types.is_dictionary(arr.type) else arr.dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.intp)
    names = np.asarray(enc.dictionary.to_pylist(), dtype=object)
    used = np.bincount(codes, minlength=names.size) > 0
    if not used.all():  # a unified dictionary can hold names of rows dropped since
        codes = (np.cumsum(used) - 1)[codes]
        names = names[used]
    return codes, names


def _dense(n_w: int, n_f: int, rw: np.ndarray, fc: np.ndarray, values: np.ndarray, fill: float) -> np.ndarray:
    m = np.full((n_w, n_f), fill, dtype=np.float64)
    m[rw, fc] = values
    return m


def analyze_step(frame: StepFrame, policy: DiagnosisPolicy) -> StepResult:
    """Every worker against its peers in one step: work by robust z (small groups by ratio), links by the shape of
    their samples; the flagged and low entries with their evidence, and per-(group, function) aggregates."""
    if frame.functions.num_rows == 0 or frame.n_workers == 0:
        return _empty_result(frame)
    grid = _grid(frame)
    work = _work(grid)
    peers = _compare_work(grid, work, policy)
    links = _compare_links(grid, work, peers.flagged, policy)
    st = frame.step_time_us
    excess = np.where(links.flagged, links.excess, peers.excess)
    flagged = peers.flagged | links.flagged
    # far below the peers: not a finding, but a worker that is far above its peers in some steps and far below in
    # others is not persistently slow; its group is split from step to step (mixture-of-experts routing)
    far_below = (peers.z < -policy.z_threshold) & (excess < -policy.min_excess_share * st[:, None])
    low = (grid.present & peers.enough & far_below) | peers.low_ratio

    healthy = ~flagged.any(axis=1)
    outliers = _outliers(grid, work, peers, links, excess, flagged, low, {"input_bytes": _input_bytes(grid)})
    return StepResult(
        job=frame.job,
        window=frame.window,
        step=frame.step,
        workers_seen=frame.n_workers,
        step_time_us=float(st.max()),
        step_time_median_us=float(np.median(st)),
        work_max_us=float(work.worker_work.max()),
        healthy_work_max_us=float(work.worker_work[healthy].max()) if healthy.any() else float("nan"),
        outliers=outliers,
        groups=_groups(grid, work, peers, policy.split_peers_max),
        workers=_workers(grid, work, peers, policy),
    )


@dataclass(frozen=True)
class _Grid:
    """One step's function tables as (workers x functions) matrices, and the workers' peer groups."""

    frame: StepFrame
    rw: np.ndarray  # per row: its worker
    fc: np.ndarray  # per row: its function's column
    fnames: np.ndarray  # per function: name, kind, resource
    kind_f: np.ndarray
    res_f: np.ndarray
    gnames: np.ndarray  # per group: its name
    lay: Layout  # workers by peer group
    present: np.ndarray  # (W, F) the worker ran the function
    n_present: np.ndarray  # (groups, F) workers of the group that ran it
    valid: np.ndarray  # (W, F) the worker's group ran the function: absence means no work
    crit: np.ndarray  # (W, F) critical-path time
    row_of: np.ndarray  # (W, F) the table's row, -1 where the worker did not run the function

    @property
    def n_workers(self) -> int:
        return self.frame.n_workers

    @property
    def n_functions(self) -> int:
        return int(self.fnames.size)

    def dense(self, values: np.ndarray, fill: float) -> np.ndarray:
        """A per-row column as a (W, F) matrix, ``fill`` where the worker did not run the function."""
        return _dense(self.n_workers, self.n_functions, self.rw, self.fc, values, fill)


def _grid(frame: StepFrame) -> _Grid:
    t = frame.functions
    n_w = frame.n_workers
    rw = frame.row_worker.astype(np.intp)
    fc, fnames = _encode(t.column("function"))
    n_f = fnames.size
    first = np.full(n_f, -1, dtype=np.intp)
    first[fc[::-1]] = np.arange(fc.size - 1, -1, -1)
    gnames, gw = np.unique(frame.group.astype(str), return_inverse=True)
    lay = Layout(gw.astype(np.intp), gnames.size)
    present = np.zeros((n_w, n_f), dtype=bool)
    present[rw, fc] = True
    n_present = lay.sum(present)  # (groups, functions)
    row_of = np.full((n_w, n_f), -1, dtype=np.intp)
    row_of[rw, fc] = np.arange(fc.size)
    return _Grid(
        frame=frame,
        rw=rw,
        fc=fc,
        fnames=fnames,
        kind_f=np.asarray(t.column("kind").take(pa.array(first)).to_pylist(), dtype=object),
        res_f=np.asarray(t.column("resource").take(pa.array(first)).to_pylist(), dtype=object),
        gnames=gnames,
        lay=lay,
        present=present,
        n_present=n_present,
        valid=(n_present > 0)[lay.groups],
        crit=_dense(n_w, n_f, rw, fc, frame.column("critical_us"), 0.0),
        row_of=row_of,
    )


@dataclass(frozen=True)
class _Work:
    """Each worker's work: its critical-path time minus its waits at collectives."""

    wait: np.ndarray  # (W, F)
    wait_measured: np.ndarray  # (W, F) the summary measured the wait (else: estimated)
    work: np.ndarray  # (W, F)
    worker_work: np.ndarray  # (W,) the step minus every wait


def _work(grid: _Grid) -> _Work:
    """Waits at collectives: measured, or the excess over the job's shortest instance of the function (a communicator
    can span peer groups, e.g. a model-parallel all-reduce over every pipeline stage, and then a whole peer group
    waits; the last to arrive anywhere waits least)."""
    n_w, n_f = grid.n_workers, grid.n_functions
    waiting = np.isin(grid.kind_f, WAITING_KINDS)
    wait = np.zeros((n_w, n_f))
    wait_measured = np.zeros((n_w, n_f), dtype=bool)
    if waiting.any():
        measured = grid.dense(grid.frame.column("wait_us"), np.nan)[:, waiting]
        cw = np.where(grid.present[:, waiting], grid.crit[:, waiting], np.nan)
        shortest = np.fmin.reduce(cw, axis=0)  # every waiting column has at least one worker that ran it
        est = np.clip(cw - shortest, 0.0, None)
        wait[:, waiting] = np.nan_to_num(np.where(np.isnan(measured), est, np.minimum(measured, cw)))
        wait_measured[:, waiting] = ~np.isnan(measured)
    return _Work(
        wait=wait,
        wait_measured=wait_measured,
        work=grid.crit - wait,
        worker_work=grid.frame.step_time_us - wait.sum(axis=1),
    )


@dataclass(frozen=True)
class _WorkComparison:
    """Each (worker, function)'s work against its peer group's."""

    med: np.ndarray  # (groups, F) the group's median work
    mad: np.ndarray  # (groups, F)
    rest: np.ndarray  # (groups, F) the median work of the group's workers but its highest
    rest_mad: np.ndarray  # (groups, F)
    z: np.ndarray  # (W, F) robust z; ratio rows: the rise over the slowest other worker
    excess: np.ndarray  # (W, F) work over the peers' (ratio rows: over the slowest other worker)
    enough: np.ndarray  # (W, 1) the worker's group has enough peers for a z
    flagged: np.ndarray  # (W, F) far above the peers, by z or by ratio
    ratio: np.ndarray  # (W, F) flagged by ratio
    low_ratio: np.ndarray  # (W, F) far below the fastest other worker of a small group
    other: np.ndarray  # (W, F) the slowest other worker of a small group (NaN elsewhere)


def _compare_work(grid: _Grid, w: _Work, policy: DiagnosisPolicy) -> _WorkComparison:
    lay, gw, work, valid = grid.lay, grid.lay.groups, w.work, grid.valid
    st, n_g = grid.frame.step_time_us, lay.counts
    n_w, n_f = grid.n_workers, grid.n_functions
    med, rest, rest_mad = lay.median_rest(np.where(valid, work, np.nan))
    mad = lay.mad(np.where(valid, work, np.nan), med)
    scale = np.maximum(np.maximum(1.4826 * mad, policy.rel_floor * np.abs(med)), 1.0)  # never below a microsecond
    z = (work - med[gw]) / scale[gw]
    excess = work - med[gw]
    enough = (n_g >= policy.min_peers)[gw][:, None]
    flag_work = valid & enough & (z > policy.z_threshold) & (excess > policy.min_excess_share * st[:, None])
    # groups of 2 to ratio_peers_max workers: a z-score needs more (of two workers, each lies half the gap from the
    # median, which is the MAD: z never passes 0.67; of three or four, the others must agree closely), so compare
    # with the slowest of the others by ratio (and far below the fastest of them is low)
    flag_ratio = low_ratio = np.zeros((n_w, n_f), dtype=bool)
    other = np.full((n_w, n_f), np.nan)
    if ((n_g >= 2) & (n_g <= policy.ratio_peers_max)).any():
        other, fastest = others_extremes(gw, grid.gnames.size, np.where(valid, work, np.nan), policy.ratio_peers_max)
        rise = 1.0 + policy.ratio_rise
        min_excess = policy.min_excess_share * st[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            flag_ratio = valid & ~flag_work & (work > rise * other) & (work - other > min_excess)
            low_ratio = grid.present & (work * rise < fastest) & (fastest - work > min_excess)
            # ratio rows: the rise over the slowest other worker, relative to at least a microsecond (like the robust
            # z's scale): a function that no other worker ran (their work is 0) rises by its own work in µs, never
            # by infinity, and a near-zero peer cannot blow it past any bound
            z = np.where(flag_ratio, (work - other) / np.maximum(other, 1.0), z)
        excess = np.where(flag_ratio, work - other, excess)
        flag_work |= flag_ratio
    return _WorkComparison(med, mad, rest, rest_mad, z, excess, enough, flag_work, flag_ratio, low_ratio, other)


@dataclass(frozen=True)
class _LinkComparison:
    """Collectives' links against their ring-mates'."""

    flagged: np.ndarray  # (W, F) the worker's link held the collective back
    excess: np.ndarray  # (W, F) what-if: the transfer at the ring-mates' rate
    ring: np.ndarray  # (W, F) ring-mates compared with (the worker included), for flagged entries
    #: metric -> (its columns, column -> the ring-mates' values): the peers of a flagged link are its ring-mates
    ref: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]


def _compare_links(grid: _Grid, w: _Work, flag_work: np.ndarray, policy: DiagnosisPolicy) -> _LinkComparison:
    """A collective's links (NVLink inside a host, the NIC across hosts: a hierarchical all-reduce reports both)
    compared with their ring-mates' (links of the same function at the same mean rate, anywhere in the job: a ring
    crosses peer groups, and a degraded switch can take a whole pipeline stage down with it)."""
    frame, n_w, n_f = grid.frame, grid.n_workers, grid.n_functions
    signal_hw = np.zeros((n_w, n_f), dtype=bool)
    hw_excess = np.zeros((n_w, n_f))
    n_seen = np.zeros((n_w, n_f), dtype=np.int64)
    link_ref: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    cols = np.flatnonzero(np.isin(grid.kind_f, WAITING_KINDS))
    metrics = [
        m for m in LINK_METRICS if cols.size and not np.isnan(frame.column(f"{m}_sd")).all()
    ]  # shapes measured at all
    if not metrics:
        return _LinkComparison(signal_hw, hw_excess, n_seen, link_ref)
    # (workers x collectives) matrices of the rows of collectives only
    at = np.full(n_f, -1, dtype=np.intp)
    at[cols] = np.arange(cols.size)
    rows = np.flatnonzero(at[grid.fc] >= 0)

    def dense(c: str, fill: float) -> np.ndarray:
        return _dense(n_w, cols.size, grid.rw[rows], at[grid.fc[rows]], frame.column(c)[rows], fill)

    sampled = dense("samples", 0.0) >= policy.link_min_samples
    st = frame.step_time_us
    work, crit = w.work[:, cols], grid.crit[:, cols]
    for metric in metrics:
        mean, sd, peak = dense(metric, np.nan), dense(f"{metric}_sd", np.nan), dense(f"{metric}_p95", np.nan)
        ring, ref = _rings(
            mean, sd, peak, sampled, policy.throughput_drop, policy.link_burst_cv, policy.ring_rate_spread
        )
        if ring is None:
            continue
        link_ref[metric] = (cols, {metric: ref["mean"], f"{metric}_sd": ref["sd"], f"{metric}_p95": ref["peak"]})
        with np.errstate(invalid="ignore", divide="ignore"):
            cv = sd / mean
            # saturated while its ring-mates burst: their spread high, or their peaks far above its own
            bursting = (ref["cv"] >= policy.link_burst_cv) | (peak < (1.0 - policy.throughput_drop) * ref["peak"])
            drop = (ring >= 2) & bursting & (cv < policy.link_steady_ratio * ref["cv"])
            # the link's capacity against its ring-mates': theirs is their peak when their bursts fill more than 5% of
            # the samples, else what an on/off link of that mean and spread reaches, mean x (1 + (sd/mean)^2)
            r = np.fmin(peak / ref["peak"], (1.0 + cv**2) / (1.0 + ref["cv"] ** 2))
        hw = drop & grid.present[:, cols] & ~flag_work[:, cols]
        if not hw.any():
            continue
        # the transfer at the slow rate: the work when the wait was measured; else the work is the job's fastest
        # instance (the usual rate, unless the slow rate is everywhere), so the work at the slow rate, but never
        # longer than the shortest time a worker behind a slow link spent in the function
        r = np.clip(np.nan_to_num(r, nan=1.0), 1e-3, 1.0)
        slowest_ring = np.fmin.reduce(np.where(hw, crit, np.inf), axis=0)
        slow = np.minimum(np.where(w.wait_measured[:, cols], work, work / r), slowest_ring)
        hw &= slow > policy.hardware_min_share * st[:, None]  # the slow transfer holds a real share of the step
        # a collective that only partly runs over the link (a hierarchical all-reduce's NVLink phase) counts when no
        # collective of the worker that runs over it alone shows the drop: its what-if is only a bound
        own = grid.res_f[cols] == LINK_METRICS[metric]
        hw[:, ~own] &= ~hw[:, own].any(axis=1, keepdims=True)
        signal_hw[:, cols] |= hw
        n_seen[:, cols] = np.where(hw, ring, n_seen[:, cols])
        hw_excess[:, cols] = np.maximum(hw_excess[:, cols], np.where(hw, slow * (1.0 - r), 0.0))
    return _LinkComparison(signal_hw, hw_excess, n_seen, link_ref)


def _input_bytes(grid: _Grid) -> np.ndarray:
    """(W,) the bytes each worker copied to its devices in the step (its input batch), NaN when it reported none."""
    copies = grid.kind_f == "memcpy"
    if not copies.any():
        return np.full(grid.n_workers, np.nan)
    b = grid.dense(grid.frame.column("bytes"), np.nan)[:, copies]
    out: np.ndarray = np.where(np.isnan(b).all(axis=1), np.nan, np.nansum(b, axis=1))
    return out


def _rings(
    mean: np.ndarray, sd: np.ndarray, peak: np.ndarray, sampled: np.ndarray, drop: float, burst_cv: float, spread: float
) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """Ring-mates of each (worker, column) link and their typical shape, without knowing the communicators.

    The members of one ring share its rate, so links of one column (function) whose mean throughputs lie within
    ``spread`` (relative) of each other, chained, form one ring (rings at similar rates merge, which changes
    nothing: their links burst alike).  Not much closer: a member's mean is over its own executions, and its
    ring-mates' include waiting for the slow hop (on a real ring the culprit's mean is the highest, by up to
    half again under load).  Returns the size of each link's ring (0 where the link had no usable shape:
    no mean, spread or peak, or too few samples) and per link its ring's upper median of mean, sd, peak and sd/mean
    (``cv``; the upper one: in a ring of two, the other link, not the average of both); NaN for rings where nobody
    bursts (no link's sd/mean reaches ``burst_cv``, no link's peak lies ``drop`` below the ring's highest: the usual
    case, and it skips the sorts).  ``(None, {})`` if nobody bursts anywhere (no link usable, or a healthy job).
    """
    usable = sampled & np.isfinite(mean) & np.isfinite(sd) & np.isfinite(peak) & (mean > 0)
    top = np.max(np.where(usable, peak, -np.inf), axis=0, initial=-np.inf)  # per column
    if not (
        usable & ((sd >= burst_cv * mean) | (peak < (1.0 - drop) * top))
    ).any():  # nobody bursts: a healthy job, or no link
        return None, {}
    w, c = np.nonzero(usable)
    lv = np.log(mean[w, c])
    order = np.argsort(
        c * 1e4 + np.clip(lv, -1e3, 1e3), kind="stable"
    )  # by column, then by mean (one key: |log| < 1e3)
    new = np.ones(w.size, dtype=bool)
    new[1:] = (np.diff(c[order]) != 0) | (np.diff(lv[order]) > np.log1p(spread))
    ring = np.empty(w.size, dtype=np.intp)
    ring[order] = np.cumsum(new) - 1
    n_rings = int(ring.max()) + 1
    size = np.bincount(ring, minlength=n_rings)
    start = np.cumsum(size) - size  # in ``order`` a ring's links are consecutive, by mean
    out_size = np.zeros(mean.shape, dtype=np.int64)
    out_size[w, c] = size[ring]
    cv, pk = sd[w, c] / mean[w, c], peak[w, c]
    judged = np.zeros(n_rings, dtype=bool)
    judged[ring[(cv >= burst_cv) | (pk < (1.0 - drop) * np.maximum.reduceat(pk[order], start)[ring])]] = True
    ref = {name: np.full(mean.shape, np.nan) for name in ("mean", "sd", "peak", "cv")}
    ref["mean"][w, c] = mean[w, c][order][start + size // 2][ring]
    keep = judged[ring]
    if keep.any():
        for name, v in (("sd", sd[w, c]), ("peak", pk), ("cv", cv)):
            ref[name][w[keep], c[keep]] = group_median(v[keep], ring[keep], n_rings, upper=True)[ring[keep]]
    return out_size, ref


def _outliers(
    grid: _Grid,
    wk: _Work,
    peers: _WorkComparison,
    links: _LinkComparison,
    excess: np.ndarray,
    flagged: np.ndarray,
    low: np.ndarray,
    worker_cols: dict[str, np.ndarray],
) -> pa.Table:
    """The flagged and low entries (OUTLIER_SCHEMA): what deviated, against whom, with the evidence."""
    w, f = np.nonzero(flagged | low)
    if w.size == 0:
        return OUTLIER_SCHEMA.empty_table()
    frame, lay, row_of, fnames, kind_f, res_f = grid.frame, grid.lay, grid.row_of, grid.fnames, grid.kind_f, grid.res_f
    signal_hw, n_seen, flag_ratio, other, med, mad = (
        links.flagged,
        links.ring,
        peers.ratio,
        peers.other,
        peers.med,
        peers.mad,
    )
    g = lay.groups[w]
    idx = row_of[w, f]  # flagged and low entries always ran the function (no work cannot be an excess)
    t = frame.functions
    cols: dict[str, object] = {
        "worker": frame.rank[w],
        "host": frame.host[w].astype(str),
        "device": frame.device[w].astype(str),
        "nic": frame.nic[w].astype(str),
        "switch": frame.switch[w].astype(str),
        "group": frame.group[w].astype(str),
        "function": fnames[f].astype(str),
        "kind": kind_f[f].astype(str),
        "resource": res_f[f].astype(str),
        "signal": np.select([signal_hw[w, f], low[w, f], flag_ratio[w, f]], ["hardware", "low", "ratio"], "work"),
        # a link is compared with its ring-mates (links of the function at the same mean rate)
        "peers": np.where(signal_hw[w, f], n_seen[w, f], lay.counts[g]).astype(np.int32),
        "present": grid.n_present[g, f].astype(np.int32),
        "work_us": wk.work[w, f],
        "peer_work_us": np.where(flag_ratio[w, f], other[w, f], med[g, f]),  # ratio rows: the slowest other worker
        "peer_mad_us": np.where(flag_ratio[w, f], np.nan, mad[g, f]),
        "z": peers.z[w, f],
        "excess_us": excess[w, f],
        "wait_us": wk.wait[w, f],
        "step_time_us": frame.step_time_us[w],
        "worker_work_us": wk.worker_work[w],
        "has_hardware": frame.has_hardware[w],
    }
    # peers' medians of the evidence columns, for the flagged functions only, from a sample of each group
    fcols, finv = np.unique(f, return_inverse=True)
    sampled = lay.pos < EVIDENCE_SAMPLE
    rw, fc = np.nonzero(grid.present[:, fcols] & sampled[:, None])
    rows = row_of[rw, fcols[fc]]
    dense = np.full((frame.n_workers, fcols.size), np.nan)
    for c in EVIDENCE_COLUMNS:
        v = t.column(c).to_numpy(zero_copy_only=False)
        cols[c] = v[idx].astype(np.float64)
        dense[rw, fc] = v[rows]
        cols[f"peer_{c}"] = lay.median(dense, sample=EVIDENCE_SAMPLE)[g, finv]
    for lcols, refs in links.ref.values():  # links: the peers are the link's ring-mates
        at = np.full(fnames.size, -1, dtype=np.intp)
        at[lcols] = np.arange(lcols.size)
        j = at[f]
        for c, ref in refs.items():
            mine = np.where(j >= 0, ref[w, np.maximum(j, 0)], np.nan)
            cols[f"peer_{c}"] = np.where(np.isnan(mine), np.asarray(cols[f"peer_{c}"]), mine)
    for c, v in worker_cols.items():
        cols[c] = v[w]
        cols[f"peer_{c}"] = lay.median(v[:, None], sample=EVIDENCE_SAMPLE)[g, 0]
    ce = t.column("clock_events").to_numpy(zero_copy_only=False).astype(np.uint64)
    cols["clock_events"] = ce[idx]
    # clock-event bits the peers share (set on at least half of them) are not evidence
    cell = lay.groups[rw] * fcols.size + fc
    n_cells = lay.n_groups * fcols.size
    flag_cell = g * fcols.size + finv
    cols["peer_clock_events"] = (group_or(ce[rows], cell, n_cells) & majority_bits(ce[rows], cell, n_cells))[flag_cell]
    return pa.Table.from_pydict(cols, schema=OUTLIER_SCHEMA)


def _others_median(grid: _Grid, v: np.ndarray) -> np.ndarray:
    """(W,) the median of ``v`` over the *other* workers of each worker's peer group (NaN: no other).  Groups of 2 to
    4 workers exactly (from the others' extremes and sum); larger groups by the group's median (one worker moves it
    by at most half a rank)."""
    lay = grid.lay
    n = lay.counts[lay.groups]
    out = lay.median(v[:, None])[lay.groups, 0]
    small = (n >= 2) & (n <= 4)
    if small.any():
        hi, lo = others_extremes(lay.groups, lay.n_groups, v[:, None], 4)
        rest = (lay.sum(v[:, None])[lay.groups, 0] - v) - hi[:, 0] - lo[:, 0]  # n=4: the middle of the 3 others
        loo = np.select([n == 2, n == 3], [hi[:, 0], (hi[:, 0] + lo[:, 0]) / 2.0], rest)
        out = np.where(small, loo, out)
    return np.where(n >= 2, out, np.nan)


def _workers(grid: _Grid, wk: _Work, peers: _WorkComparison, policy: DiagnosisPolicy) -> pa.Table:
    """Per worker: its own work (the step minus its waits) and its peers', its waits and theirs, and its
    TOP_FUNCTIONS functions (not waiting) most above their group's median work (WORKER_SCHEMA)."""
    frame = grid.frame
    n_w, n_f = grid.n_workers, grid.n_functions
    wait = wk.wait.sum(axis=1)
    own = np.maximum(wk.worker_work, 0.0)
    over = np.where(
        grid.valid & ~np.isin(grid.kind_f, WAITING_KINDS)[None, :], wk.work - peers.med[grid.lay.groups], -np.inf
    )
    k = min(TOP_FUNCTIONS, n_f)
    top = np.argsort(-over, axis=1, kind="stable")[:, :k]  # (W, k)
    w = np.repeat(np.arange(n_w), k)
    f = top.ravel()
    some = np.isfinite(over[w, f]) & (over[w, f] > 0)
    fi = np.where(some, f, n_f)  # n_f: none ("")

    def text(values: np.ndarray, at: np.ndarray) -> pa.Array:  # a string per row, taken from the few there are
        return pa.array(values.astype(str), pa.string()).take(at)

    cols: dict[str, object] = {
        "worker": frame.rank[w],
        "host": text(frame.host, w),
        "device": text(frame.device, w),
        "group": text(frame.group, w),
        "step_time_us": frame.step_time_us[w],
        "own_us": own[w],
        "peer_own_us": _others_median(grid, own)[w],
        "wait_us": wait[w],
        "peer_wait_us": _others_median(grid, wait)[w],
        "function": text(np.append(grid.fnames.astype(str), ""), fi),
        "kind": text(np.append(grid.kind_f.astype(str), ""), fi),
        "work_us": np.where(some, wk.work[w, f], 0.0),
        "peer_work_us": np.where(some, peers.med[grid.lay.groups[w], f], 0.0),
    }
    return pa.Table.from_pydict(cols, schema=WORKER_SCHEMA)


def _groups(grid: _Grid, wk: _Work, peers: _WorkComparison, most: int) -> pa.Table:
    """Per (group, function) the group ran: its median work, wait, share and hardware, and in groups of 3 to ``most``
    workers their order in it (GROUP_SCHEMA)."""
    frame, lay, gnames, fnames, kind_f, res_f = grid.frame, grid.lay, grid.gnames, grid.fnames, grid.kind_f, grid.res_f
    n_present, med, mad, wait, valid, fc, rw = (
        grid.n_present,
        peers.med,
        peers.mad,
        wk.wait,
        grid.valid,
        grid.fc,
        grid.rw,
    )
    gi, fi = np.nonzero(n_present > 0)
    n_f = fnames.size
    st = frame.step_time_us
    waiting = np.isin(kind_f, WAITING_KINDS)
    wait_med = np.zeros_like(med)
    wait_med[:, waiting] = lay.median(np.where(valid[:, waiting], wait[:, waiting], np.nan))
    st_med = lay.median(st[:, None])[:, 0]
    cell_row = lay.groups[rw] * n_f + fc
    n_cells = lay.n_groups * n_f
    t = frame.functions
    cols: dict[str, object] = {
        "group": gnames[gi].astype(str),
        "function": fnames[fi].astype(str),
        "kind": kind_f[fi].astype(str),
        "resource": res_f[fi].astype(str),
        "workers": lay.counts[gi].astype(np.int32),
        "present": n_present[gi, fi].astype(np.int32),
        "work_us": med[gi, fi],
        "work_mad_us": mad[gi, fi],
        "wait_us": wait_med[gi, fi],
        "share": (med[gi, fi] + wait_med[gi, fi]) / st_med[gi],
        "step_time_us": st_med[gi],
        "clock_events": group_or(t.column("clock_events").to_numpy(zero_copy_only=False), cell_row, n_cells)[
            gi * n_f + fi
        ],
    }
    cols.update(_cell_means(t, cell_row, n_cells, gi * n_f + fi))
    small = lay.counts[gi] < 3  # a second culprit's baseline: the group without its highest worker
    cols["work_rest_us"] = np.where(small, np.nan, peers.rest[gi, fi])
    cols["work_rest_mad_us"] = np.where(small, np.nan, peers.rest_mad[gi, fi])
    cols["order"], cols["order_work_us"] = _order(grid, wk.work, most, gi, fi)
    return pa.Table.from_pydict(cols, schema=GROUP_SCHEMA)


def _order(grid: _Grid, work: np.ndarray, most: int, gi: np.ndarray, fi: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """Per (group ``gi``, function ``fi``), groups of 3 to ``most`` workers that all ran it: the workers' ranks from
    the fastest in it to the slowest, and their work (list arrays; empty lists elsewhere)."""
    lay = grid.lay
    width = min(most, lay.width)
    ok = (lay.counts[gi] >= 3) & (lay.counts[gi] <= most) & (grid.n_present[gi, fi] == lay.counts[gi])
    if width < 3 or not ok.any():
        empty = np.zeros(gi.size + 1, dtype=np.int32)
        return (
            pa.ListArray.from_arrays(empty, pa.array([], pa.int64())),
            pa.ListArray.from_arrays(empty, pa.array([], pa.float64())),
        )
    cube = lay.cube(work, width)[gi[ok], :, fi[ok]]  # (rows, width): NaN past the group's size
    ranks = lay.cube(grid.frame.rank[:, None].astype(np.float64), width)[gi[ok], :, 0]
    o = np.argsort(cube, axis=1, kind="stable")  # NaN sorts last
    cube, ranks = np.take_along_axis(cube, o, axis=1), np.take_along_axis(ranks, o, axis=1)
    lengths = np.zeros(gi.size, dtype=np.int32)
    lengths[ok] = lay.counts[gi[ok]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    at = np.arange(width)[None, :] < lay.counts[gi[ok]][:, None]
    return (
        pa.ListArray.from_arrays(offsets, pa.array(ranks[at].astype(np.int64))),
        pa.ListArray.from_arrays(offsets, pa.array(cube[at])),
    )


def _cell_means(t: pa.Table, cell: np.ndarray, n_cells: int, pick: np.ndarray) -> dict[str, np.ndarray]:
    """Means of the hardware columns per cell, ignoring NaN: one sort, one reduceat for all columns."""
    out = {c: np.full(pick.size, np.nan) for c in ft.HARDWARE}
    arrays = {c: t.column(c).to_numpy(zero_copy_only=False) for c in ft.HARDWARE}
    used = [c for c, v in arrays.items() if not np.isnan(v).all()]
    if not used:
        return out
    order = np.argsort(cell, kind="stable")
    m = np.stack([arrays[c][order] for c in used], axis=1).astype(np.float64)
    ok = ~np.isnan(m)
    counts = np.bincount(cell, minlength=n_cells)
    starts = (np.cumsum(counts) - counts)[pick]
    sums = np.add.reduceat(np.where(ok, m, 0.0), starts, axis=0)
    n = np.add.reduceat(ok, starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(n > 0, sums / np.maximum(n, 1), np.nan)
    for j, c in enumerate(used):
        out[c] = means[:, j]
    return out


def _empty_result(frame: StepFrame) -> StepResult:
    st = frame.step_time_us
    return StepResult(
        job=frame.job,
        window=frame.window,
        step=frame.step,
        workers_seen=frame.n_workers,
        step_time_us=float(st.max()) if st.size else 0.0,
        step_time_median_us=float(np.median(st)) if st.size else 0.0,
        work_max_us=float("nan"),
        healthy_work_max_us=float("nan"),
        outliers=OUTLIER_SCHEMA.empty_table(),
        groups=GROUP_SCHEMA.empty_table(),
    )
