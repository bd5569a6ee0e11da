"""The host-side summariser: op events + hardware samples -> one function table per worker and step.

Pure and vectorised (numpy / pyarrow), for every (worker, step) of the input at once.

**Critical path.**  Within a worker's step every instant counts for at most one
function: GPU kernels > memory copies > communication > sync waits > CPU /
Python, and among events of the same class the one that started last (the
innermost of nested regions).  A sync wait (kind ``sync``: the host blocked in a
synchronize or a blocking copy) outranks the CPU work around it, so the region
that called it is never charged for the wait; device work of the step that runs
meanwhile outranks the wait, so what is left to it is time the device spent on
something else (work an earlier step launched) or idle.  ``critical_us`` is the time so credited; ``critical_us / step time``
is the function's share beta.  Instants where nothing ran are idle.  Events are
clipped to their step's bounds for this.

**Waits.**  Waiting inside a collective cannot be told from transfer on one
host (it depends on when the others arrive), so ``wait_us`` stays NaN here; the
step stage estimates it across peers (the last to arrive waits least).

**Hardware.**  A sample taken at ``t`` describes the sampling period before it,
``(t - period, t]``; a function's hardware columns are the means of the samples
whose period overlaps one of its executions (each sample counted once per
function), with their standard deviation (``<metric>_sd``, n - 1; NaN below two samples)
and 95th percentile (``<metric>_p95``): the shape, not only the level, of the resource
while the function ran.  Only for metrics of the resource it depends on (SM clock for GPU
work, PCIe for host/device copies, NIC or NVLink for collectives, host CPU,
memory and disk for everything).  ``clock_events`` is the OR of the sampled bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas import functions as ft
from ...schemas.errors import LockstepError
from ...schemas.events import (
    COLLECTIVE_INSTANCE_SCHEMA,
    MAX_DURATION_US,
    MAX_STEP,
    MAX_TIME_US,
    MAX_WORKER,
    OP_EVENT_REQUIRED,
    SAMPLE_REQUIRED,
)
from ...schemas.records import FUNCTION_KINDS

#: critical-path classes, higher wins
GPU, COPY, COMM, SYNC, CPU = 4, 3, 2, 1, 0
#: sample metric -> resources whose functions it describes (None: every function)
METRIC_RESOURCES: dict[str, tuple[str, ...] | None] = {
    "sm_clock_mhz": ("gpu",),
    "sm_active": ("gpu",),
    "gpu_power_w": ("gpu",),
    "gpu_temp_c": ("gpu",),
    "clock_events": ("gpu",),
    "pcie_gbps": ("pcie",),
    "nvlink_gbps": ("nvlink",),
    "nic_gbps": ("nic",),
    "cpu_self": None,
    "cpu_other": None,
    "mem_used_frac": None,
    "disk_read_mbps": ("cpu", "storage"),
}
CLOCK_EVENT_BITS = 16


class SummaryError(LockstepError, ValueError):
    """The op-event or sample table breaks its contract; the message says which column and how."""


@dataclass
class StepSummary:
    worker: int
    step: int
    step_time_us: float
    functions: pa.Table  # conformed to lockstep.schemas.functions.SCHEMA
    #: its numbered collective instances (COLLECTIVE_INSTANCE_SCHEMA), None when its events carry no numbers
    collectives: pa.Table | None = None


def summarise(
    events: pa.Table,
    samples: pa.Table | None = None,
    step_bounds: dict[int, tuple[float, float]] | None = None,
    *,
    min_share: float = 0.0,
) -> list[StepSummary]:
    """One :class:`StepSummary` per (worker, step) in ``events``, sorted by worker then step.

    ``step_bounds`` (step -> (start_us, end_us), one worker's clock): the step
    spans; without them (or for a step they lack) a step spans its events.
    ``min_share``: leave out functions whose critical-path time and total time
    are both below this share of the step (the agent's size budget).
    """
    ev = _events(events)
    n = ev["start"].size
    if n == 0:
        return []
    span = int(ev["step"].max()) + 1
    keys, ws = np.unique(ev["worker"] * span + ev["step"], return_inverse=True)
    pairs = np.stack([keys // span, keys % span], axis=1)  # (worker, step) of each worker-step, sorted
    n_ws = pairs.shape[0]
    end = ev["start"] + ev["dur"]
    lo = np.full(n_ws, np.inf)
    hi = np.full(n_ws, -np.inf)
    np.minimum.at(lo, ws, ev["start"])
    np.maximum.at(hi, ws, end)
    if step_bounds:
        b = np.array([step_bounds.get(int(s), (np.nan, np.nan)) for s in pairs[:, 1]], dtype=np.float64).reshape(-1, 2)
        has = np.isfinite(b).all(axis=1) & (b[:, 1] > b[:, 0])
        lo, hi = np.where(has, b[:, 0], lo), np.where(has, b[:, 1], hi)
    step_time = np.maximum(hi - lo, 0.0)

    crit = _critical(ev, ws, lo, hi)
    fnames, fc = ev["fnames"], ev["fcode"]
    n_f = fnames.size
    cell = ws * n_f + fc
    cells, ci = np.unique(cell, return_inverse=True)
    n_c = cells.size
    c_ws, c_f = cells // n_f, cells % n_f
    calls = np.bincount(ci, minlength=n_c)
    total = np.bincount(ci, weights=ev["dur"], minlength=n_c)
    critical = np.bincount(ci, weights=crit, minlength=n_c)
    first = np.full(n_c, np.inf)
    np.minimum.at(first, ci, ev["start"] - lo[ws])
    longest = np.zeros(n_c)
    np.maximum.at(longest, ci, ev["dur"])
    p50, p95 = _quantiles(ev["dur"], ci, calls, (0.5, 0.95))
    has_bytes = ~np.isnan(ev["bytes"])
    nbytes = np.where(
        np.bincount(ci[has_bytes], minlength=n_c) > 0,
        np.bincount(ci[has_bytes], weights=ev["bytes"][has_bytes], minlength=n_c),
        np.nan,
    )
    kind_c = ev["kind"][_first_index(ci, n_c)]
    res_c = ev["resource"][_first_index(ci, n_c)]

    cols: dict[str, object] = {
        "function": fnames[c_f],
        "kind": kind_c,
        "resource": res_c,
        "calls": calls.astype(np.int32),
        "total_us": total,
        "critical_us": critical,
        "wait_us": np.full(n_c, np.nan),
        "first_start_us": np.maximum(first, 0.0),
        "mean_us": total / np.maximum(calls, 1),
        "p50_us": p50,
        "p95_us": p95,
        "max_us": longest,
        "bytes": nbytes,
    }
    cols.update(_hardware(ev, ws, ci, n_c, res_c, samples, pairs[:, 0]))

    keep = np.ones(n_c, dtype=bool)
    if min_share > 0:
        st = np.maximum(step_time[c_ws], 1e-9)
        keep = (critical / st >= min_share) | (total / st >= min_share)
    idx = np.flatnonzero(keep)
    table = ft.make_table({k: np.asarray(v)[idx] for k, v in cols.items()})
    group = c_ws[idx]  # cells are sorted by (worker-step, function): each worker-step is one slice
    bounds = np.searchsorted(group, np.arange(n_ws + 1))
    inst, inst_bounds = _instances(events, ws, n_ws)
    return [
        StepSummary(
            worker=int(pairs[g, 0]),
            step=int(pairs[g, 1]),
            step_time_us=float(step_time[g]),
            functions=table.slice(bounds[g], bounds[g + 1] - bounds[g]),
            collectives=None if inst is None else inst.slice(inst_bounds[g], inst_bounds[g + 1] - inst_bounds[g]),
        )
        for g in range(n_ws)
        if bounds[g + 1] > bounds[g] and step_time[g] > 0
    ]


def _instances(events: pa.Table, ws: np.ndarray, n_ws: int) -> tuple[pa.Table | None, np.ndarray]:
    """The numbered collective instances (COLLECTIVE_INSTANCE_SCHEMA) sorted by worker-step, and where each
    worker-step's begin; (None, ...) when the events carry no ``collective_seq`` column or no number in it."""
    if "collective_seq" not in events.column_names:
        return None, np.zeros(n_ws + 1, dtype=np.int64)
    seq = _column(events, "collective_seq", pa.int64(), "op-event")
    has = np.asarray(seq.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if not has.any():
        return None, np.zeros(n_ws + 1, dtype=np.int64)
    number = seq.fill_null(-1).to_numpy(zero_copy_only=False)
    has &= number >= 0
    rows = np.flatnonzero(has)
    rows = rows[np.argsort(ws[rows], kind="stable")]
    pg = (
        _column(events, "process_group", pa.string(), "op-event")
        if "process_group" in events.column_names
        else pa.nulls(events.num_rows, pa.string())
    )
    take = pa.array(rows, pa.int64())
    inst = pa.Table.from_arrays(
        [
            _column(events, "function", pa.string(), "op-event").take(take),
            pg.take(take),
            pa.array(number[rows], pa.int64()),
            _column(events, "duration_us", pa.float64(), "op-event").take(take),
        ],
        schema=COLLECTIVE_INSTANCE_SCHEMA,
    )
    return inst, np.searchsorted(ws[rows], np.arange(n_ws + 1))


# --------------------------------------------------------------------------- input


def _column(t: pa.Table, name: str, typ: pa.DataType, what: str) -> pa.Array:
    col = t.column(name)
    try:
        col = col.cast(typ) if col.type != typ else col
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise SummaryError(
            f"{what} column {name!r}: cannot read {col.type} as {typ} ({str(exc).splitlines()[0]})"
        ) from None
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _events(t: pa.Table) -> dict[str, np.ndarray]:
    missing = [c for c in OP_EVENT_REQUIRED if c not in t.column_names]
    if missing:
        raise SummaryError(f"op-event table lacks column(s) {', '.join(missing)}; needs {', '.join(OP_EVENT_REQUIRED)}")
    for c in OP_EVENT_REQUIRED:
        if t.column(c).null_count:
            raise SummaryError(f"op-event column {c!r} has empty values")
    out: dict[str, np.ndarray] = {
        "worker": _column(t, "worker", pa.int64(), "op-event").to_numpy(),
        "step": _column(t, "step", pa.int64(), "op-event").to_numpy(),
        "start": _column(t, "start_us", pa.float64(), "op-event").to_numpy(),
        "dur": _column(t, "duration_us", pa.float64(), "op-event").to_numpy(),
    }
    if not (np.all(np.isfinite(out["start"])) and np.all(np.isfinite(out["dur"]))) or np.any(out["dur"] < 0):
        raise SummaryError("op-event start_us and duration_us must be finite, duration_us >= 0")
    if np.any(out["dur"] > MAX_DURATION_US) or np.any(np.abs(out["start"]) > MAX_TIME_US):
        raise SummaryError(
            f"op-event duration_us {out['dur'].max():g} or start_us beyond what a profiler measures (at most {MAX_DURATION_US:g} and {MAX_TIME_US:g})"
        )
    if np.any(out["worker"] < 0) or np.any(out["step"] < 0):
        raise SummaryError("op-event worker and step must be >= 0")
    if np.any(out["worker"] > MAX_WORKER) or np.any(out["step"] > MAX_STEP):
        raise SummaryError(
            f"op-event worker {out['worker'].max()} or step {out['step'].max()} out of range (worker 0..{MAX_WORKER}, step 0..{MAX_STEP})"
        )
    # functions numbered in name order: a step's table lists them so, however the events were batched or ordered
    fenc = _column(t, "function", pa.string(), "op-event").dictionary_encode()
    names = np.asarray(fenc.dictionary.to_pylist(), dtype=object)
    order = np.argsort(names.astype(str), kind="stable")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    out["fcode"] = rank[fenc.indices.to_numpy()]
    out["fnames"] = names[order]
    kind = _column(t, "kind", pa.string(), "op-event")
    bad = set(pc.unique(kind).to_pylist()) - set(FUNCTION_KINDS)
    if bad:
        raise SummaryError(f"op-event kind(s) {sorted(map(str, bad))} unknown; allowed: {', '.join(FUNCTION_KINDS)}")
    out["kind"] = np.asarray(kind.to_pylist(), dtype=object)
    if "resource" in t.column_names:
        res = _column(t, "resource", pa.string(), "op-event")
        bad = set(pc.unique(res).drop_null().to_pylist()) - set(ft.RESOURCES)
        if bad:
            raise SummaryError(
                f"op-event resource(s) {sorted(map(str, bad))} unknown; allowed: {', '.join(ft.RESOURCES)}"
            )
        res_np = np.asarray(res.to_pylist(), dtype=object)
    else:
        res_np = np.full(out["kind"].size, None, dtype=object)
    unset = np.equal(res_np, None)  # type: ignore[call-overload]  # numpy's stubs: an object array against None
    if unset.any():
        kinds, inv = np.unique(out["kind"][unset].astype(str), return_inverse=True)
        res_np[unset] = np.array([ft.default_resource(k) for k in kinds], dtype=object)[inv]
    out["resource"] = res_np
    out["bytes"] = (
        _column(t, "bytes", pa.float64(), "op-event").to_numpy(zero_copy_only=False)
        if "bytes" in t.column_names
        else np.full(out["start"].size, np.nan)
    )
    out["bytes"] = np.asarray(out["bytes"], dtype=np.float64)
    return out


def _first_index(groups: np.ndarray, n: int) -> np.ndarray:
    first = np.full(n, -1, dtype=np.int64)
    first[groups[::-1]] = np.arange(groups.size - 1, -1, -1)
    return first


# --------------------------------------------------------------------------- critical path


def _priority(kind: np.ndarray, resource: np.ndarray) -> np.ndarray:
    p = np.where(resource == "gpu", GPU, CPU)
    p = np.where(np.isin(kind, ("collective", "p2p")), COMM, p)
    p = np.where(kind == "sync", SYNC, p)
    return np.where(kind == "memcpy", COPY, p)


def _critical(ev: dict[str, np.ndarray], ws: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Critical-path time of each event: each instant to the highest class, then the latest start.

    All worker-steps at once: each is shifted onto its own stretch of one time
    line, the elementary intervals between event boundaries get the winning
    event by a range-max over a segment tree built level by level with numpy.
    """
    n = ev["start"].size
    span = hi - lo
    offset = np.concatenate([[0.0], np.cumsum(span + 1.0)[:-1]])
    a = np.clip(ev["start"] - lo[ws], 0.0, span[ws]) + offset[ws]
    b = np.clip(ev["start"] + ev["dur"] - lo[ws], 0.0, span[ws]) + offset[ws]
    # rank: class first, then start, then position; the highest rank covering an instant wins
    order = np.argsort(_priority(ev["kind"], ev["resource"]) * (offset[-1] + span[-1] + 1.0) + a, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    edges = np.unique(np.concatenate([a, b]))
    m = edges.size - 1
    if m <= 0:
        return np.zeros(n)
    l_ = np.searchsorted(edges, a)
    r_ = np.searchsorted(edges, b)
    size = 1 << int(np.ceil(np.log2(max(m, 1))))
    tree = np.full(2 * size, -1, dtype=np.int64)
    l_, r_, rk = l_ + size, r_ + size, rank.copy()
    live = l_ < r_
    l_, r_, rk = l_[live], r_[live], rk[live]
    while l_.size:
        odd = (l_ & 1).astype(bool)
        np.maximum.at(tree, l_[odd], rk[odd])
        l_ = l_ + odd
        odd = (r_ & 1).astype(bool)
        r_ = r_ - odd
        np.maximum.at(tree, r_[odd], rk[odd])
        l_, r_ = l_ >> 1, r_ >> 1
        live = l_ < r_
        l_, r_, rk = l_[live], r_[live], rk[live]
    node = np.arange(m) + size
    best = tree[node]
    node >>= 1
    while node[0] >= 1:
        best = np.maximum(best, tree[node])
        node >>= 1
    won = best >= 0
    return np.bincount(order[best[won]], weights=np.diff(edges)[won], minlength=n)


def _quantiles(values: np.ndarray, groups: np.ndarray, counts: np.ndarray, qs: tuple[float, ...]) -> list[np.ndarray]:
    """Linear-interpolated quantiles per group (numpy's default method)."""
    o = np.argsort(values, kind="stable")
    o = o[np.argsort(groups[o], kind="stable")]
    v = values[o]
    starts = np.cumsum(counts) - counts
    out = []
    for q in qs:
        pos = q * (counts - 1)
        k = np.floor(pos).astype(np.int64)
        frac = pos - k
        k1 = np.minimum(k + 1, counts - 1)
        out.append(v[starts + k] * (1 - frac) + v[starts + k1] * frac)
    return out


# --------------------------------------------------------------------------- hardware


def _samples(t: pa.Table) -> dict[str, np.ndarray]:
    missing = [c for c in SAMPLE_REQUIRED if c not in t.column_names]
    if missing:
        raise SummaryError(f"sample table lacks column(s) {', '.join(missing)}; needs {', '.join(SAMPLE_REQUIRED)}")
    out = {
        "worker": _column(t, "worker", pa.int64(), "sample").to_numpy(zero_copy_only=False),
        "t": np.asarray(_column(t, "t_us", pa.float64(), "sample").to_numpy(zero_copy_only=False), dtype=np.float64),
        "metric": np.asarray(_column(t, "metric", pa.string(), "sample").to_pylist(), dtype=object),
        "value": np.asarray(
            _column(t, "value", pa.float64(), "sample").to_numpy(zero_copy_only=False), dtype=np.float64
        ),
    }
    ok = np.isfinite(out["t"]) & np.isfinite(out["value"])
    return {k: v[ok] for k, v in out.items()}


def _hardware(
    ev: dict[str, np.ndarray],
    ws: np.ndarray,
    ci: np.ndarray,
    n_c: int,
    res_c: np.ndarray,
    samples: pa.Table | None,
    ws_worker: np.ndarray,
) -> dict[str, np.ndarray]:
    cols: dict[str, np.ndarray] = {c: np.full(n_c, np.nan) for c in ft.HARDWARE}
    cols["clock_events"] = np.zeros(n_c, dtype=np.uint64)
    cols["samples"] = np.zeros(n_c, dtype=np.int32)
    if samples is None or samples.num_rows == 0:
        return cols
    sm = _samples(samples)
    worker = ws_worker[ws]  # each event's worker
    workers = np.unique(np.concatenate([worker, sm["worker"]]))
    wi_ev = np.searchsorted(workers, worker)
    wi_sm = np.searchsorted(workers, sm["worker"])
    # per-worker relative times on one line, so that one searchsorted serves every worker
    t0 = np.full(workers.size, np.inf)
    np.minimum.at(t0, wi_ev, ev["start"])
    np.minimum.at(t0, wi_sm, sm["t"])
    s_rel = ev["start"] - t0[wi_ev]
    e_rel = s_rel + ev["dur"]
    t_rel = sm["t"] - t0[wi_sm]
    stretch = float(max(e_rel.max(initial=0.0), t_rel.max(initial=0.0))) * 2.0 + 1.0
    # each sample counted once per function: events of a function in time order, ranges clipped to what came before
    order = np.argsort(ci * stretch + s_rel, kind="stable")
    counted = np.zeros(n_c)
    for metric, resources in METRIC_RESOURCES.items():
        pick = sm["metric"] == metric
        if not pick.any():
            continue
        applies = np.ones(n_c, dtype=bool) if resources is None else np.isin(res_c, resources)
        ev_ok = applies[ci]
        w, t, v = wi_sm[pick], t_rel[pick], sm["value"][pick]
        key = w * stretch + t
        so = np.argsort(key, kind="stable")
        w, t, v, key = w[so], t[so], v[so], key[so]
        period = _periods(w, t, workers.size)
        q_lo = wi_ev * stretch + s_rel
        q_hi = wi_ev * stretch + e_rel + period[wi_ev]
        lo = np.searchsorted(key, q_lo, side="right")
        hi = np.searchsorted(key, q_hi, side="left")
        lo, hi = lo[order], np.maximum(hi[order], lo[order])
        c_sorted = ci[order]
        # clip each range to start after the previous range of the same function (running max per function)
        seg_off = c_sorted.astype(np.float64) * (key.size + 1)
        prev = np.concatenate([[-1.0], np.maximum.accumulate(hi + seg_off)[:-1]]) - seg_off
        lo = np.maximum(lo, prev.astype(np.int64))
        cnt = np.where(ev_ok[order], np.maximum(hi - lo, 0), 0)
        lo = np.minimum(lo, hi)
        n = np.bincount(c_sorted, weights=cnt, minlength=n_c)
        counted = np.maximum(counted, n)
        if metric == "clock_events":
            bits = v.astype(np.uint64)
            for bit in range(CLOCK_EVENT_BITS):
                on = np.concatenate([[0], np.cumsum((bits >> np.uint64(bit)) & np.uint64(1))])
                hit = (on[hi] - on[lo] > 0) & (cnt > 0)
                np.bitwise_or.at(cols["clock_events"], c_sorted[hit], np.uint64(1 << bit))
            continue
        cols[metric], cols[f"{metric}_sd"], cols[f"{metric}_p95"] = _moments(v, lo, hi, cnt, c_sorted, n, n_c)
    cols["samples"] = counted.astype(np.int32)
    return cols


def _moments(
    v: np.ndarray, lo: np.ndarray, hi: np.ndarray, cnt: np.ndarray, cell: np.ndarray, n: np.ndarray, n_c: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, standard deviation (n - 1) and 95th percentile per cell of the samples ``v[lo:hi]`` of its ranges.

    The ranges of one cell are disjoint (each sample counted once per function).  Sums come from
    cumulative sums of the values centred on their mean (so that the squares do not lose the
    spread to the level); the percentile sorts the cells' samples, expanded from their ranges, once.
    """
    ref = float(v.mean()) if v.size else 0.0
    d = v - ref
    c1 = np.concatenate([[0.0], np.cumsum(d)])
    c2 = np.concatenate([[0.0], np.cumsum(d * d)])
    live = cnt > 0
    s1 = np.bincount(cell, weights=np.where(live, c1[hi] - c1[lo], 0.0), minlength=n_c)
    s2 = np.bincount(cell, weights=np.where(live, c2[hi] - c2[lo], 0.0), minlength=n_c)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, ref + s1 / np.maximum(n, 1), np.nan)
        var = (s2 - s1 * s1 / np.maximum(n, 1)) / np.maximum(n - 1, 1)
        sd = np.where(n > 1, np.sqrt(np.clip(var, 0.0, None)), np.nan)
    p95 = np.full(n_c, np.nan)
    total = int(cnt.sum())
    if total:
        # every range expanded to its sample indices, grouped by cell
        first = np.cumsum(cnt) - cnt
        idx = np.arange(total) - np.repeat(first - lo, cnt)
        groups = np.repeat(cell, cnt)
        has = n > 0
        dense = np.cumsum(has) - 1  # cells with samples, numbered 0..k-1 in cell order
        (q,) = _quantiles(v[idx], dense[groups], n[has].astype(np.int64), (0.95,))
        p95[has] = q
    return mean, sd, p95


def _periods(w: np.ndarray, t: np.ndarray, n_workers: int) -> np.ndarray:
    """Mean spacing of each worker's samples of one metric; 0 where a worker has fewer than two."""
    n = np.bincount(w, minlength=n_workers)
    first = np.full(n_workers, np.inf)
    last = np.full(n_workers, -np.inf)
    np.minimum.at(first, w, t)
    np.maximum.at(last, w, t)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 1, (last - first) / np.maximum(n - 1, 1), 0.0)
