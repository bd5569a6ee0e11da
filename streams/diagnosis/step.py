"""Step analysis: compare every worker with its peers in one step.

Pure and vectorised.  For each (peer group, function) cell it takes the median
and MAD of the function's *work* (critical-path time minus time spent waiting
for peers) and flags the (worker, function) rows whose work lies far above
their peers'.  The result is small: the flagged rows with their hardware
characteristics and their peers' medians, plus per-cell aggregates for the
job-wide checks of the window stage.

Waiting: a collective's duration includes the time a worker waited for the
last arrival.  Where the summary carries no locally measured ``wait_us``, the
wait is estimated as the excess over the shortest instance in the peer group:
the last worker to arrive waits least, so its duration is the pure transfer.
That keeps the victims of a slow worker from being blamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ...schemas import functions as ft
from ..policy import DiagnosisPolicy
from .frame import StepFrame
from .stats import group_counts, group_mad, group_median, group_min, group_nanmean, group_or

WAITING_KINDS = ("collective", "p2p")

#: per-row characteristics carried for flagged rows, with their peers' medians
EVIDENCE_COLUMNS = ("calls", "total_us", "mean_us", "p95_us", "bytes") + ft.HARDWARE

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
        ("peers", pa.int32()),
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
    + [(c, pa.float64()) for c in EVIDENCE_COLUMNS]
    + [(f"peer_{c}", pa.float64()) for c in EVIDENCE_COLUMNS]
)

GROUP_SCHEMA = pa.schema(
    [
        ("group", pa.string()),
        ("function", pa.string()),
        ("kind", pa.string()),
        ("resource", pa.string()),
        ("workers", pa.int32()),
        ("work_us", pa.float64()),  # median
        ("work_mad_us", pa.float64()),
        ("share", pa.float64()),  # median critical-path share beta = critical / step time
        ("wait_us", pa.float64()),  # median
        ("total_us", pa.float64()),  # median
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


def analyze_step(frame: StepFrame, policy: DiagnosisPolicy) -> StepResult:
    t = frame.functions
    n_w = frame.n_workers
    if t.num_rows == 0 or n_w == 0:
        return _empty_result(frame)
    rw = frame.row_worker
    fn_codes_arr = t.column("function").combine_chunks().dictionary_encode()
    fcode = fn_codes_arr.indices.to_numpy().astype(np.int64)
    fnames = np.asarray(fn_codes_arr.dictionary.to_pylist(), dtype=object)
    gnames, gcode_w = np.unique(frame.group.astype(str), return_inverse=True)
    gcode_w = gcode_w.astype(np.int64)
    n_f = fnames.size
    cell = gcode_w[rw] * n_f + fcode
    n_cells = gnames.size * n_f

    kind = np.asarray(t.column("kind").to_pylist(), dtype=object)
    critical = frame.column("critical_us").astype(np.float64)
    wait = frame.column("wait_us").astype(np.float64)
    waiting = np.isin(kind, WAITING_KINDS)
    # estimate unmeasured waits: excess over the peer group's shortest instance
    est = np.clip(critical - group_min(np.where(waiting, critical, np.nan), cell, n_cells)[cell], 0.0, None)
    wait = np.where(waiting, np.where(np.isnan(wait), est, np.minimum(wait, critical)), 0.0)
    work = critical - wait

    worker_work = frame.step_time_us - np.bincount(rw, weights=wait, minlength=n_w)
    counts = group_counts(cell, n_cells)
    med = group_median(work, cell, n_cells)
    mad = group_mad(work, cell, n_cells, med)
    step_med = float(np.median(frame.step_time_us))
    scale = np.maximum(1.4826 * mad, policy.rel_floor * np.abs(med))
    scale = np.maximum(scale, 1.0)  # never below a microsecond
    z = (work - med[cell]) / scale[cell]
    excess = work - med[cell]
    flagged = (
        (counts[cell] >= policy.min_peers)
        & (z > policy.z_threshold)
        & (excess > policy.min_excess_share * frame.step_time_us[rw])
    )
    flagged_workers = np.zeros(n_w, dtype=bool)
    flagged_workers[rw[flagged]] = True
    healthy = ~flagged_workers
    work_max = float(worker_work.max())
    healthy_max = float(worker_work[healthy].max()) if healthy.any() else float("nan")

    outliers = _outliers(frame, t, flagged, cell, n_cells, fnames, fcode, kind, med, mad, z, excess, wait, work, worker_work, counts)
    groups = _groups(frame, t, cell, n_cells, n_f, gnames, fnames, kind, counts, med, mad, critical, wait, rw)
    return StepResult(
        job=frame.job,
        window=frame.window,
        step=frame.step,
        workers_seen=n_w,
        step_time_us=float(frame.step_time_us.max()),
        step_time_median_us=step_med,
        work_max_us=work_max,
        healthy_work_max_us=healthy_max,
        outliers=outliers,
        groups=groups,
    )


def _outliers(frame, t, flagged, cell, n_cells, fnames, fcode, kind, med, mad, z, excess, wait, work, worker_work, counts) -> pa.Table:
    idx = np.flatnonzero(flagged)
    if idx.size == 0:
        return OUTLIER_SCHEMA.empty_table()
    rw = frame.row_worker
    w = rw[idx]
    # peers' medians of the evidence columns, only over the cells that hold a flagged row
    in_cells = np.isin(cell, np.unique(cell[idx]))
    sub_cell = cell[in_cells]
    cols: dict[str, object] = {
        "worker": frame.rank[w],
        "host": frame.host[w].astype(str),
        "device": frame.device[w].astype(str),
        "nic": frame.nic[w].astype(str),
        "switch": frame.switch[w].astype(str),
        "group": frame.group[w].astype(str),
        "function": fnames[fcode[idx]].astype(str),
        "kind": kind[idx].astype(str),
        "resource": np.asarray(t.column("resource").to_pylist(), dtype=object)[idx].astype(str),
        "peers": counts[cell[idx]].astype(np.int32),
        "work_us": work[idx],
        "peer_work_us": med[cell[idx]],
        "peer_mad_us": mad[cell[idx]],
        "z": z[idx],
        "excess_us": excess[idx],
        "wait_us": wait[idx],
        "step_time_us": frame.step_time_us[w],
        "worker_work_us": worker_work[w],
        "has_hardware": frame.has_hardware[w],
    }
    ce = frame.column("clock_events").astype(np.uint64)
    cols["clock_events"] = ce[idx]
    # clock-event bits the peers share (set on at least half of them) are not evidence
    cols["peer_clock_events"] = group_or(ce[in_cells], sub_cell, n_cells)[cell[idx]] & _majority_bits(ce[in_cells], sub_cell, n_cells)[cell[idx]]
    for c in EVIDENCE_COLUMNS:
        v = frame.column(c).astype(np.float64)
        cols[c] = v[idx]
        cols[f"peer_{c}"] = group_median(v[in_cells], sub_cell, n_cells)[cell[idx]]
    return pa.Table.from_pydict(cols, schema=OUTLIER_SCHEMA)


def _majority_bits(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Per group, the bits set on at least half of the rows."""
    out = np.zeros(n_groups, dtype=np.uint64)
    n = np.bincount(groups, minlength=n_groups)
    for bit in range(16):  # NVML clock-event reasons use the low bits
        has = ((values >> np.uint64(bit)) & np.uint64(1)).astype(np.int64)
        k = np.bincount(groups, weights=has, minlength=n_groups)
        out |= np.where((n > 0) & (2 * k >= n), np.uint64(1 << bit), np.uint64(0))
    return out


def _groups(frame, t, cell, n_cells, n_f, gnames, fnames, kind, counts, med, mad, critical, wait, rw) -> pa.Table:
    present = np.flatnonzero(counts > 0)
    # a representative row per cell gives its kind and resource
    first = np.full(n_cells, -1, dtype=np.int64)
    first[cell[::-1]] = np.arange(cell.size - 1, -1, -1)
    rep = first[present]
    share = critical / frame.step_time_us[rw]
    cols: dict[str, object] = {
        "group": gnames[present // n_f].astype(str),
        "function": fnames[present % n_f].astype(str),
        "kind": kind[rep].astype(str),
        "resource": np.asarray(t.column("resource").to_pylist(), dtype=object)[rep].astype(str),
        "workers": counts[present].astype(np.int32),
        "work_us": med[present],
        "work_mad_us": mad[present],
        "share": group_median(share, cell, n_cells)[present],
        "wait_us": group_median(wait, cell, n_cells)[present],
        "total_us": group_median(frame.column("total_us").astype(np.float64), cell, n_cells)[present],
        "clock_events": group_or(frame.column("clock_events").astype(np.uint64), cell, n_cells)[present],
    }
    for c in ft.HARDWARE:
        cols[c] = group_nanmean(frame.column(c), cell, n_cells)[present]
    return pa.Table.from_pydict(cols, schema=GROUP_SCHEMA)


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
