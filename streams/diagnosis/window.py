"""Window diagnosis: from the step results of one window to findings.

- Persistence: a deviation counts only if it holds in enough of the window's
  steps (policy ``persistence`` and ``min_persistent_steps``).
- Topology: deviating workers of one function that share the resource behind
  it (a NIC for inter-node collectives, several hosts behind one switch, a host
  for CPU-bound functions) become one finding naming the shared element; then
  findings of one cause on one host merge (a throttled GPU slows all its
  kernels; two GPUs of one host are reported together).
- Scope ``worker``: some workers differ from their peers (robust peer statistics).
- Scope ``group``: one peer group (a pipeline stage) does more work than the
  other groups; or one group regressed against the job's earlier healthy windows.
- Scope ``job``: every worker alike, so no outlier exists; compared against
  expected ranges (a Python function over 1% of the step where the GPU does
  the compute, communication over 30%) and against the job's own earlier
  healthy windows (:mod:`.history`).
- Impact: what-if - the culprits' excess work removed, the synchronised step
  recomputed as the slowest remaining worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.records import (
    HARDWARE_CAUSES,
    Closed,
    DeviceKind,
    Evidence,
    Finding,
    Impact,
    WindowReport,
    device_kind_of,
    finding_id,
)
from ..policy import DiagnosisPolicy, Policy
from .causes import Attribution, Suspect, classify
from .history import MIN_COVERAGE, JobHistory, fold, window_medians
from .links import LossyLink, SlowLink, lossy_links, slow_links
from .localise import NOBODY, Localised, Periods, Standing, localise, periodic_need, periods
from .stats import group_median
from .step import EVIDENCE_COLUMNS, LINK_METRICS, WAITING_KINDS, WORKER_COLUMNS, StepResult

#: causes that name none: findings of one worker merge only within one resource (a GPU's kernels, a host's CPU work)
UNNAMED_CAUSES = frozenset({"undetermined", "unknown"})


@dataclass
class WindowInfo:
    job: str
    window: str
    start_step: int
    steps: int
    expected_workers: int
    tenant: str = ""
    policy: str = ""  # policy ref of the trigger


@dataclass
class WindowDiagnosis:
    findings: list[Finding]
    report: WindowReport
    history: JobHistory | None = None  # the job's baseline after this window: keep it for the next one


@dataclass
class _Ctx:
    info: WindowInfo
    results: list[StepResult]
    dp: DiagnosisPolicy
    need: int  # steps a deviation must hold in
    now: float
    policy_ref: str
    coverage: float
    groups: pa.Table | None = None  # the steps' per-(group, function) tables, with their step: when a function ran
    standing: Standing = NOBODY  # the localisation: who stands out from their peers, whatever the cause
    periods: Periods | None = None  # which functions ran periodically, in which steps (None: no group table)
    history: JobHistory | None = None  # the job's earlier healthy windows (None: none kept)


def diagnose_window(
    info: WindowInfo,
    results: list[StepResult],
    policy: Policy,
    *,
    now: float,
    closed: Closed = "complete",
    closed_reason: str = "",
    bytes_in: int = 0,
    history: JobHistory | None = None,
    connections: pa.Table | None = None,
) -> WindowDiagnosis:
    """``connections``: the workers' TCP connections over the window (``CONNECTION_SCHEMA``), where their agents
    recorded them: a lossy link is named from them (:mod:`.links`); by default those the step results carry."""
    dp = policy.diagnosis
    results = sorted(results, key=lambda r: r.step)
    if connections is None:
        connections = window_connections(results)
    steps_seen = len(results)
    coverage = _coverage(info, results)
    findings: list[Finding] = []
    groups = _concat([r.groups for r in results], results)
    if steps_seen:
        need = max(min(dp.min_persistent_steps, steps_seen), math.ceil(dp.persistence * steps_seen))
        p = periods(groups, results[0].step, results[-1].step) if groups.num_rows else None
        standing = localise(results, dp, p)
        ctx = _Ctx(info, results, dp, need, now, info.policy or policy.ref, coverage, groups, standing, p, history)
        pairs = _persistent_pairs(ctx)
        findings += _worker_findings(ctx, pairs, history)
        # localisation first: a worker that stands out from its peers is named whether or not a cause rule has it;
        # and in the function it stands out in most, beside a cause rule's finding on another function, where no
        # rule weighed that one (the step stage did not flag it persistently: among few peers a second straggler
        # lifts the baseline it is flagged against)
        named = {w for f in findings if f.scope == "worker" for w in f.workers}
        weighed = _weighed(pairs)
        findings += [
            _localised_finding(ctx, loc)
            for loc in ctx.standing.localised
            if loc.worker not in named or (loc.function and (loc.worker, loc.function) not in weighed)
        ]
        findings = _with_links(ctx, findings, [*lossy_links(connections, dp), *slow_links(connections, dp)])
        findings += _group_findings(ctx, groups)
        explained = {f.function for f in findings}
        findings += [f for f in _job_findings(ctx, groups, history, findings) if f.function not in explained]
    findings.sort(key=lambda f: (-f.impact.step_time_share, f.id))
    kind = workers_device_kind(results)
    for f in findings:  # a host or a NIC is named on any job: the workers' devices say whose hours the cost counts
        f.device_kind = kind
    # a window is the job's normal unless something deviated or regressed (expected ranges describe the job itself)
    healthy = not any(f.scope != "job" or f.cause == "regression" for f in findings)
    if steps_seen >= 2 and healthy and coverage >= MIN_COVERAGE:
        history = fold(history, info.job, info.window, window_medians(groups), dp.history_weight, now)
    report = window_report(
        info, results, policy, now=now, closed=closed, closed_reason=closed_reason, bytes_in=bytes_in, findings=findings
    )
    return WindowDiagnosis(findings=findings, report=report, history=history)


def window_connections(results: list[StepResult]) -> pa.Table | None:
    """The window's connection table from its step results (each worker's on its first step); a connection a
    replayed slice brought twice counts once."""
    parts = [r.connections for r in results if r.connections is not None and r.connections.num_rows]
    if not parts:
        return None
    t = pa.concat_tables(parts)
    key = pc.binary_join_element_wise(
        pc.cast(t.column("worker"), pa.string()), t.column("local"), t.column("peer"), "|"
    )
    _, first = np.unique(np.asarray(key.to_pylist(), dtype=object), return_index=True)
    return t if first.size == t.num_rows else t.take(pa.array(np.sort(first)))


def workers_device_kind(results: list[StepResult]) -> DeviceKind:
    """What the window's workers compute on, from the devices their agents named (every worker's, from the step
    reports' worker tables; the outliers' where a step stage older than those sent none)."""
    devices: set[str] = set()
    for r in results:
        table = r.workers if r.workers is not None and r.workers.num_rows else r.outliers
        if "device" in table.column_names:
            devices.update(str(d) for d in table.column("device").unique().to_pylist() if d)
    return device_kind_of(devices)


def _coverage(info: WindowInfo, results: list[StepResult]) -> float:
    """Worker-steps delivered of those expected: a step nobody delivered counts as 0."""
    return sum(min(r.workers_seen, info.expected_workers) for r in results) / (
        info.expected_workers * max(info.steps, len(results), 1)
    )


def window_report(
    info: WindowInfo,
    results: list[StepResult],
    policy: Policy,
    *,
    now: float,
    closed: Closed,
    closed_reason: str = "",
    bytes_in: int = 0,
    findings: list[Finding] | None = None,
) -> WindowReport:
    """The window's report: what came (steps, workers, bytes), how it closed and why, what it found.  Without
    ``findings`` (a window that failed before its diagnosis), it reports none."""
    findings = findings or []
    seen = max((r.workers_seen for r in results), default=0)
    return WindowReport(
        job=info.job,
        window=info.window,
        start_step=info.start_step,
        steps=info.steps,
        steps_seen=len(results),
        expected_workers=info.expected_workers,
        workers_seen=seen,
        coverage=round(min(1.0, _coverage(info, results)), 4),
        bytes_per_worker=round(bytes_in / seen, 1) if seen else 0.0,
        findings=len(findings),
        actionable=any(f.cause not in ("unknown", "undetermined") for f in findings),
        reached_device=any(f.devices for f in findings),
        closed=closed,
        closed_at=now,
        policy=info.policy or policy.ref,
        tenant=info.tenant,
        closed_reason=closed_reason,
    )


def _concat(tables: list[pa.Table], results: list[StepResult]) -> pa.Table:
    parts = [
        t.append_column("step", pa.array(np.full(t.num_rows, r.step, dtype=np.int64))) for t, r in zip(tables, results)
    ]
    return pa.concat_tables(parts) if parts else pa.table({})


def _np(t: pa.Table, name: str) -> np.ndarray:
    column: np.ndarray = t.column(name).to_numpy(zero_copy_only=False)
    return column


def _keys(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique composite keys: (uniques, inverse, first index)."""
    key = cols[0].astype(str)
    for c in cols[1:]:
        key = np.char.add(np.char.add(key, "\x1f"), c.astype(str))
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return uniq, inv, first


def _steps_per_key(inv: np.ndarray, step: np.ndarray, n: int, where: np.ndarray | None = None) -> np.ndarray:
    """Distinct steps in which each key occurs (only the rows ``where`` says, if given)."""
    if where is not None:
        inv, step = inv[where], step[where]
    if step.size == 0:
        return np.zeros(n, dtype=np.int64)
    span = int(step.max()) + 1
    return np.bincount(np.unique(inv * span + step) // span, minlength=n)


# --------------------------------------------------------------------------- scope: worker


def _worker_findings(ctx: _Ctx, pairs: _Pairs | None, history: JobHistory | None = None) -> list[Finding]:
    """Persistent (worker, function) pairs, clustered by the element they share, attributed, merged by owner."""
    if pairs is None:
        return []
    attributed = [(s, classify(s, ctx.dp), m) for s, m in _suspects(pairs, history)]
    built = [_worker_finding(ctx, pairs, cause, parts) for (cause, _owner), parts in _by_owner(attributed).items()]
    leads = _leads(ctx, [b[0] for b in built])
    return [_refined(ctx, f, periodic, excess_us, lead=f.id in leads) for f, periodic, excess_us in built]


def _weighed(pairs: _Pairs | None) -> set[tuple[int, str]]:
    """The persistent (worker, function) pairs: those the cause rules weighed."""
    if pairs is None:
        return set()
    p = np.flatnonzero(pairs.persistent)
    return set(zip(pairs.label["worker"][p].tolist(), pairs.label["function"][p].astype(str).tolist(), strict=True))


def _leads(ctx: _Ctx, findings: list[Finding]) -> set[str]:
    """Per worker that stands out: the id of its costliest cause-rule finding (by its share of the step), the one
    that explains its shift; the localisation lifts that one only (a second, smaller finding on the same worker, a
    function slower in half the steps beside the one that holds the step, keeps its own confidence)."""
    leads: set[str] = set()
    for loc in ctx.standing.localised:
        mine = [
            f
            for f in findings
            if loc.worker in f.workers
            and f.function_kind not in WAITING_KINDS
            and (loc.basis != "split" or f.function == loc.function)  # slow in that function, not as a whole
        ]
        if mine:
            leads.add(max(mine, key=lambda f: (f.impact.step_time_share, f.confidence)).id)
    return leads


#: outlier columns whose median over a pair's steps describes the pair
_PAIR_NUMERIC = (
    "z",
    "work_us",
    "peer_work_us",
    "peer_mad_us",
    "excess_us",
    "peers",
    "present",
    *EVIDENCE_COLUMNS,
    *WORKER_COLUMNS,
    *(f"peer_{c}" for c in EVIDENCE_COLUMNS + WORKER_COLUMNS),
)
#: outlier columns that are the same in every step of a pair: taken from its first row
_PAIR_LABELS = (
    "worker",
    "host",
    "device",
    "nic",
    "switch",
    "group",
    "function",
    "kind",
    "resource",
    "signal",
    "has_hardware",
)


@dataclass(frozen=True)
class _Pairs:
    """The window's outlier rows (those not far below their peers) and their (worker, function) pairs."""

    out: pa.Table
    worker: np.ndarray  # per row
    fn: np.ndarray  # per row
    step: np.ndarray  # per row
    pair: np.ndarray  # per row: its pair
    n_steps: np.ndarray  # per pair: steps it was flagged in
    occurrences: np.ndarray  # per pair: steps of the window in which the worker's peer group ran the function
    holds: np.ndarray  # per pair: share of its flagged steps in which the worker's work was the step's highest
    persistent: np.ndarray  # per pair: flagged in enough of its occurrences, and not persistently low too
    num: dict[str, np.ndarray]  # per pair: the median of each of _PAIR_NUMERIC over its rows
    label: dict[str, np.ndarray]  # per pair: each of _PAIR_LABELS
    clock_events: np.ndarray  # per pair: any of its rows' clock-event bits
    peer_clock_events: np.ndarray  # per pair: the bits every one of its rows' peers had


def _persistent_pairs(ctx: _Ctx) -> _Pairs | None:
    """The outliers by (worker, function); None when no pair deviated persistently."""
    out = _concat([r.outliers for r in ctx.results], ctx.results)
    if out.num_rows == 0:
        return None
    # a (worker, function) far below its peers in some steps (two, as one noisy step is no deviation either) is not
    # persistently slow: its group is split from step to step (mixture-of-experts routing) and it is on the slow side
    # only some of the time
    low = _np(out, "signal").astype(str) == "low"
    low_pairs = np.array([], dtype=str)
    if low.any():
        keys, inv, _ = _keys(_np(out, "worker")[low], _np(out, "function")[low])
        low_pairs = keys[
            _steps_per_key(inv, _np(out, "step")[low], keys.size) >= min(ctx.dp.min_persistent_steps, ctx.need)
        ]
    out = out.filter(pa.array(~low))
    if out.num_rows == 0:
        return None
    worker, fn, step = _np(out, "worker"), _np(out, "function").astype(str), _np(out, "step")
    pairs, pair, first = _keys(worker, fn)
    n_pairs = pairs.size
    n_steps = _steps_per_key(pair, step, n_pairs)
    occurrences = _occurrences(ctx, _np(out, "group").astype(str)[first], fn[first])
    persistent = (n_steps >= _need(ctx, occurrences)) & ~np.isin(pairs, low_pairs)
    if not persistent.any():
        return None
    # the straggler holds the step: its work (the step minus its waits) is the step's highest, the others wait for it
    steps_r = np.array([r.step for r in ctx.results])
    work_max = np.array([r.work_max_us for r in ctx.results])[np.searchsorted(steps_r, step)]
    holds = np.bincount(pair, weights=_np(out, "worker_work_us") >= work_max, minlength=n_pairs)
    ce_or = np.zeros(n_pairs, dtype=np.uint64)
    np.bitwise_or.at(ce_or, pair, _np(out, "clock_events").astype(np.uint64))
    pce_and = np.full(n_pairs, np.iinfo(np.uint64).max, dtype=np.uint64)
    np.bitwise_and.at(pce_and, pair, _np(out, "peer_clock_events").astype(np.uint64))
    return _Pairs(
        out=out,
        worker=worker,
        fn=fn,
        step=step,
        pair=pair,
        n_steps=n_steps,
        occurrences=occurrences,
        holds=holds / np.maximum(n_steps, 1),
        persistent=persistent,
        num={c: group_median(_np(out, c).astype(np.float64), pair, n_pairs) for c in _PAIR_NUMERIC},
        label={c: _np(out, c)[first] for c in _PAIR_LABELS},
        clock_events=ce_or,
        peer_clock_events=pce_and,
    )


def _occurrences(ctx: _Ctx, group: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """Per (group, function): the steps of the window in which the function occurs (:func:`.localise.periods`: a
    checkpoint that runs every third step occurs in a third of them); the window's steps where it does not occur
    periodically."""
    n, p = len(ctx.results), ctx.periods
    if p is None:
        return np.full(group.size, n, dtype=np.int64)
    per = np.where(p.periodic, p.count, n)
    want = np.char.add(np.char.add(group.astype(str), "\x1f"), fn.astype(str))
    pos = np.clip(np.searchsorted(p.keys, want), 0, p.keys.size - 1)
    out: np.ndarray = np.minimum(np.where(p.keys[pos] == want, per[pos], n), n).astype(np.int64)
    return out


def _need(ctx: _Ctx, occurrences: np.ndarray) -> np.ndarray:
    """Steps a deviation must hold in, by the function's occurrences (persistence by occurrence): a function that
    runs periodically, in fewer of the window's steps, more than half of them and at least three
    (:func:`.localise.periodic_need`); else ``persistence`` of them and at least ``min_persistent_steps`` (one slow
    run of a function is no deviation either); a function that ran in every step needs what the window needs."""
    dp = ctx.dp
    floor = min(dp.min_persistent_steps, len(ctx.results))
    by_share = np.ceil(dp.persistence * occurrences - 1e-9)
    periodic = occurrences < len(ctx.results)
    by_occurrence = np.maximum(floor, np.where(periodic, periodic_need(occurrences), by_share)).astype(np.int64)
    return np.minimum(ctx.need, by_occurrence)


def _suspects(pairs: _Pairs, history: JobHistory | None) -> list[tuple[Suspect, np.ndarray]]:
    """One Suspect per cluster of persistent pairs (few) and the pairs in it: pairs of one function that share the
    element behind it are one (a NIC, or the switch behind several hosts, for communication; the host for CPU-bound
    work; else the worker itself)."""
    col = pairs.label
    p = np.flatnonzero(pairs.persistent)
    fn_p, res, host = col["function"][p].astype(str), col["resource"][p].astype(str), col["host"][p].astype(str)
    nic = col["nic"][p].astype(str)
    worker_elem = np.char.add("worker:", col["worker"][p].astype(str))
    elem = np.where(
        res == "nic", np.where(nic != "", nic, host), np.where(np.isin(res, ("cpu", "storage")), host, worker_elem)
    )
    elem = _switch_elements(fn_p, res, elem, col["switch"][p].astype(str), host)
    _, cl, _ = _keys(fn_p, res, elem)
    n_cl = int(cl.max()) + 1
    cmed = {c: group_median(pairs.num[c][p], cl, n_cl) for c in _PAIR_NUMERIC}
    order = np.argsort(cl, kind="stable")
    bounds = np.searchsorted(cl[order], np.arange(n_cl + 1))
    baseline = history.work_of() if history is not None and history.windows else {}
    out = []
    for k in range(n_cl):
        m = p[order[bounds[k] : bounds[k + 1]]]
        s = Suspect(
            function=str(col["function"][m[0]]),
            kind=str(col["kind"][m[0]]),
            resource=str(col["resource"][m[0]]),
            workers=sorted(int(w) for w in col["worker"][m]),
            hosts=[str(x) for x in col["host"][m]],
            devices=[str(x) for x in col["device"][m]],
            nics=[str(x) for x in col["nic"][m]],
            switches=[str(x) for x in col["switch"][m]],
            peers=int(round(cmed["peers"][k])),  # noqa: RUF046 - round() of a numpy integer is one too
            present=int(round(cmed["present"][k])),  # noqa: RUF046
            z=float(cmed["z"][k]),
            work_us=float(cmed["work_us"][k]),
            peer_work_us=float(cmed["peer_work_us"][k]),
            peer_mad_us=float(cmed["peer_mad_us"][k]),
            excess_us=float(cmed["excess_us"][k]),
            has_hardware=bool(np.all(col["has_hardware"][m])),
            clock_events=int(np.bitwise_or.reduce(pairs.clock_events[m])),
            peer_clock_events=int(np.bitwise_and.reduce(pairs.peer_clock_events[m])),
            values={c: float(cmed[c][k]) for c in EVIDENCE_COLUMNS + WORKER_COLUMNS},
            peer_values={c: float(cmed[f"peer_{c}"][k]) for c in EVIDENCE_COLUMNS + WORKER_COLUMNS},
            signal=next((x for x in ("hardware", "ratio") if np.all(col["signal"][m] == x)), "work"),
            baseline_us=baseline.get((str(col["group"][m[0]]), str(col["function"][m[0]])), math.nan),
            baseline_windows=history.windows if history is not None else 0,
            holds_step=bool(np.median(pairs.holds[m]) > 0.5),
        )
        out.append((s, m))
    return out


_Attributed = tuple[Suspect, Attribution, np.ndarray]  # a suspect, its cause, its pairs


def _by_owner(attributed: list[_Attributed]) -> dict[tuple[str, tuple[Any, ...]], list[_Attributed]]:
    """One finding per cause and host set for causes that live in the host's hardware: a throttled GPU slows every
    kernel, two GPUs of one host go together.  Software causes belong to their ranks: two ranks of one host running
    their own extra code are two problems, never one finding."""
    merged: dict[tuple[str, tuple[Any, ...]], list[_Attributed]] = {}
    for s, att, m in attributed:
        owner: tuple[Any, ...] = tuple(sorted(set(s.hosts))) if att.cause in HARDWARE_CAUSES else tuple(s.workers)
        if att.cause in UNNAMED_CAUSES:  # no cause ties them: a slow kernel and a slow loader are two problems
            owner += (s.resource,)
        merged.setdefault((att.cause, owner), []).append((s, att, m))
    return merged


def _naming_excess(s: Suspect) -> float:
    """The excess by which a finding's functions compete to name it: the work above the peers', but no more than the
    duration above theirs (``total_us``, where measured).  Critical-path time above the peers' with no longer a
    duration is less overlap, not more work: in gloo DDP the peers' backward runs under their all-reduce, which waits
    for the straggler and takes those instants, the straggler's does not; its backward is 4-10x its peers' in
    critical time whatever slowed it (a write with fsync after the step, a reniced process, a shaped link)."""
    longer = s.values.get("total_us", math.nan) - s.peer_values.get("total_us", math.nan)
    return s.excess_us if not math.isfinite(longer) else min(s.excess_us, max(longer, 0.0))


def _worker_finding(ctx: _Ctx, pairs: _Pairs, cause: str, parts: list[_Attributed]) -> tuple[Finding, bool, float]:
    """The finding of one cause and owner: the suspect that costs most speaks for the others (its function, its
    evidence, then the others' work); with whether the function ran in fewer than the window's steps and its excess
    (µs per step), for :func:`_refined`."""
    hosts = sorted({h for p in parts for h in p[0].hosts})
    parts.sort(key=lambda p: -_naming_excess(p[0]) * len(p[2]))
    s, att, _ = parts[0]
    members = np.concatenate([p[2] for p in parts])
    workers = sorted({w for p in parts for w in p[0].workers})
    devices = sorted({d for p in parts for d in p[1].devices})
    functions = list(dict.fromkeys(p[0].function for p in parts))
    history_ev = []
    if s.signal == "ratio" and s.baseline_us > 0:
        history_ev = [
            Evidence(
                feature="baseline_work_us",
                value=round(s.work_us, 1),
                peer_value=round(s.baseline_us, 1),
                deviation=round(s.work_us / s.baseline_us - 1.0, 4),
            )
        ]
    others = [
        Evidence(
            feature=f"work_us[{p[0].function}]",
            value=round(p[0].work_us, 1),
            peer_value=round(p[0].peer_work_us, 1),
            deviation=round(p[0].z, 2),
        )
        for p in parts[1:]
        if p[0].function != s.function
    ]
    evidence = list(att.evidence) + history_ev + others[:8]
    flagged_steps = sorted({int(x) for x in pairs.step[np.isin(pairs.pair, members)]})
    persistence = float(np.mean(np.minimum(pairs.n_steps[members] / np.maximum(pairs.occurrences[members], 1), 1.0)))
    occurred = int(pairs.occurrences[members].max())
    n_window = len(ctx.results)
    share = _what_if(
        ctx.results,
        pairs.out,
        pairs.worker,
        pairs.fn,
        pairs.step,
        np.asarray(workers),
        functions,
        shared=s.signal == "hardware",
    )
    conf, notes = _confidence(s, att.certainty, persistence, ctx.coverage, ctx.dp)
    finding = Finding(
        id=finding_id(ctx.info.job, ctx.info.window, "worker", workers, s.function, cause, None),
        job=ctx.info.job,
        window=ctx.info.window,
        steps=flagged_steps,
        scope="worker",
        workers=workers,
        hosts=hosts,
        devices=devices,
        group=None,
        function=s.function,
        function_kind=s.kind,
        cause=cause,
        confidence=conf,
        evidence=evidence,
        impact=_impact(share, ctx.info.expected_workers),
        policy=ctx.policy_ref,
        created_at=ctx.now,
        tenant=ctx.info.tenant,
        summary=_summary(
            s,
            workers,
            cause,
            devices,
            len(flagged_steps),
            occurred,
            len(functions) - 1,
            notes
            + ([f"it ran in {occurred} of the window's {n_window} steps"] if occurred < n_window else [])
            + ([att.undecided] if att.undecided else []),
        ),
        window_steps=len(ctx.results),
    )
    return finding, occurred < n_window, s.excess_us


def _switch_elements(
    fn: np.ndarray, res: np.ndarray, elem: np.ndarray, switch: np.ndarray, host: np.ndarray
) -> np.ndarray:
    """NICs of several hosts behind one switch, deviating in one function: the switch is the element."""
    idx = np.flatnonzero((res == "nic") & (switch != ""))
    if idx.size == 0:
        return elem
    _, g, _ = _keys(fn[idx], switch[idx])
    n = int(g.max()) + 1

    def distinct(values: np.ndarray) -> np.ndarray:
        _, _, first = _keys(g, values)
        return np.bincount(g[first], minlength=n)

    merge = (distinct(elem[idx]) > 1) & (distinct(host[idx]) > 1)
    out = elem.astype(object)  # the switch's name may be longer than any element's
    out[idx] = np.where(merge[g], np.char.add("switch:", switch[idx]), elem[idx])
    return out


def _what_if(
    results: list[StepResult],
    out: pa.Table,
    worker: np.ndarray,
    fn: np.ndarray,
    step: np.ndarray,
    members: np.ndarray,
    functions: list[str],
    shared: bool = False,
) -> float:
    """Share of the synchronised step saved if the members' excess in ``functions`` were gone: the mean over the
    window's steps (each step's saving; a step where nothing was flagged saves nothing), what a fix saves per step
    on average, which the GPU-hours per day scale.  (The median of the steps' savings, before issue 21's seventh
    pass, made a checkpoint slow at every third step cost nothing.)

    The finding on its own: the members' work before and after the fix, against
    the slowest healthy worker, so that a smaller fault hidden behind a bigger
    one still shows what it costs once the bigger one is fixed.  ``shared``: the
    time is shared by every worker (a ring at the speed of its slowest link), so
    the excess itself leaves every worker's step.
    """
    saved = []
    excess = _np(out, "excess_us")
    wwork = _np(out, "worker_work_us")
    mine_rows = np.isin(worker, members)
    fixed_rows = mine_rows & np.isin(fn, functions)
    for r in results:
        in_step = step == r.step
        fixed = in_step & fixed_rows
        if not fixed.any() or r.step_time_us <= 0:
            saved.append(0.0)
            continue
        if shared:  # each function's ring at its slowest flagged link, the functions one after the other
            _, f_of = np.unique(fn[fixed], return_inverse=True)
            per_fn = np.zeros(int(f_of.max()) + 1)
            np.maximum.at(per_fn, f_of, excess[fixed])
            saved.append(_share(float(per_fn.sum()), r.step_time_us))
            continue
        mine = in_step & mine_rows
        ws, inv = np.unique(worker[mine], return_inverse=True)
        work_w = np.zeros(ws.size)
        np.maximum.at(work_w, inv, wwork[mine])
        cut = np.zeros(ws.size)
        np.add.at(cut, inv, np.where(fixed[mine], excess[mine], 0.0))
        floor = r.healthy_work_max_us if math.isfinite(r.healthy_work_max_us) else 0.0
        before, after = max(work_w.max(), floor), max((work_w - cut).max(), floor)
        saved.append(_share(float(before - after), r.step_time_us))
    return float(np.mean(saved)) if saved else 0.0


def _share(saved_us: float, step_time_us: float) -> float:
    """The part of a step that ``saved_us`` is, in [0, 1]: a fix cannot save more than the step
    (records that claim so are inconsistent, and dividing them could overflow)."""
    return 1.0 if saved_us >= step_time_us else max(0.0, saved_us) / step_time_us


def _confidence(
    s: Suspect, certainty: float, persistence: float, coverage: float, dp: DiagnosisPolicy
) -> tuple[float, list[str]]:
    """Confidence and what limits it (small or noisy peer group, a comparison by ratio, no hardware samples)."""
    notes = []
    if s.signal == "work":  # past the threshold in most steps already; twice the threshold leaves no doubt
        strength = 0.8 + 0.2 * min(1.0, max(0.0, (s.z - dp.z_threshold) / dp.z_threshold))
    elif s.signal == "ratio":  # the rise over the slowest other worker, against its own threshold
        strength = 0.8 + 0.2 * min(1.0, max(0.0, (s.z - dp.ratio_rise) / dp.ratio_rise))
    else:  # a link steadier than its ring-mates: full when its sd/mean is a quarter of theirs (at the default ratio)
        steadier = max((1.0 - _div(_cv(s.values, m), _cv(s.peer_values, m), 1.0) for m in LINK_METRICS), default=0.0)
        limit = 1.0 - dp.link_steady_ratio
        strength = 0.8 + 0.2 * min(1.0, max(0.0, (steadier - limit) / limit))
    if s.signal == "ratio":
        others = "its only peer" if s.peers == 2 else f"the slowest of its {s.peers - 1} peers"
        notes.append(f"compared by ratio with {others} (too few for a robust z-score)")
        # against the job's own earlier healthy windows: did this worker get slower, or its peers faster?
        if (not math.isfinite(s.baseline_us) or s.baseline_us <= 0) and s.holds_step:
            # the straggler's peers wait for it (its work is the step's highest), so they are not merely faster; the
            # job's own past (below) compares the worker with itself and weighs a little more
            peers = 0.8
            notes.append("its work the step's highest (the others wait for it); no earlier healthy window of the job")
        elif not math.isfinite(s.baseline_us) or s.baseline_us <= 0:
            peers = 0.6
            notes.append("no earlier healthy window of the job to tell a slow worker from faster peers")
        elif s.work_us > (1.0 + dp.regression_rise) * s.baseline_us:
            peers = 0.85
            notes.append(
                f"{s.work_us / s.baseline_us - 1:.0%} above the job's {s.baseline_windows} earlier healthy window(s)"
            )
        else:
            peers = 0.4
            notes.append(f"as in the job's {s.baseline_windows} earlier healthy window(s): its peers got faster")
    elif s.peers >= dp.small_group:
        peers = 1.0
    else:
        peers = 0.85 if s.peers >= 4 else 0.7
        notes.append(f"only {s.peers - 1} peers")
    spread = 1.4826 * s.peer_mad_us / s.peer_work_us if s.peer_work_us > 0 and math.isfinite(s.peer_mad_us) else 0.0
    noise = 1.0
    if spread > dp.noisy_rel_mad:
        noise = 0.75
        notes.append(f"noisy peer group (spread {spread:.0%})")
    if not s.has_hardware:
        notes.append("no hardware samples")
    c = certainty * strength * _persisted(persistence) * peers * noise * (0.5 + 0.5 * coverage)
    return round(min(0.99, max(0.01, c)), 3), notes


def _persisted(persistence: float) -> float:
    """How much the share of the window's steps that showed a deviation (at least the policy's) adds to the confidence."""
    return 0.6 + 0.4 * persistence


def _summary(
    s: Suspect, workers: list[int], cause: str, devices: list[str], n_steps: int, n: int, more: int, notes: list[str]
) -> str:
    """One line: who, where, what deviated against what, in how many steps, the cause and what limits it."""
    who = (
        f"worker {workers[0]}"
        if len(workers) == 1
        else f"{len(workers)} workers ({', '.join(map(str, workers[:6]))}{'...' if len(workers) > 6 else ''})"
    )
    where = f" on {', '.join(devices[:3])}" if devices else ""
    also = f" (and {more} more function{'s' if more > 1 else ''})" if more else ""
    caveat = f"; {', '.join(notes)}" if notes else ""
    if s.signal == "hardware":  # the link steadiest against its ring-mates
        m = min(LINK_METRICS, key=lambda m: _div(_cv(s.values, m), _cv(s.peer_values, m), math.inf))
        v, p = s.values, s.peer_values
        how = (
            f"saturated its link ({m} sd/mean {_cv(v, m):.2f}, peak {v.get(f'{m}_p95', math.nan):.3g}) while its "
            f"{s.peers - 1} ring-mates' links at the same mean rate ({p.get(m, math.nan):.3g}) burst (sd/mean "
            f"{_cv(p, m):.2f}, peak {p.get(f'{m}_p95', math.nan):.3g})"
        )
        return f"{who}{where}: {s.function}{also} {how} in {n_steps}/{n} steps; cause {cause}{caveat}"
    if s.peer_work_us > 0:
        ratio = s.work_us / s.peer_work_us
        how = f"{ratio:.0f}x as long as" if ratio >= 3 else f"{(ratio - 1) * 100:.0f}% slower than"
    else:
        how = f"took {s.work_us:,.0f} us, not run by"
    peers = "its only peer" if s.peers == 2 else f"its {s.peers - 1} peers"
    return f"{who}{where}: {s.function}{also} {how} {peers} in {n_steps}/{n} steps; cause {cause}{caveat}"


def _div(a: float, b: float, default: float = math.nan) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else default


def _cv(values: dict[str, float], metric: str) -> float:
    """A link's spread relative to its mean (sd/mean) from a suspect's (or its peers') values."""
    return _div(values.get(f"{metric}_sd", math.nan), values.get(metric, math.nan))


def _impact(share: float, workers: int) -> Impact:
    share = min(1.0, max(0.0, share))  # a fix cannot save more than the step
    return Impact(step_time_share=round(share, 4), gpu_hours_per_day=round(share * workers * 24.0, 2))


#: a cause rule's finding on a worker whose own work is not a standard error above its peers', short by two standard
#: errors of what the function's excess alone would add to it (the excess is made up elsewhere in its step), and that
#: waits more than its peers (they keep it waiting: a victim) stays below paging
NOT_STANDING_OUT_CAP = 0.45
NOT_STANDING_OUT_Z = 1.0
#: a cause rule's finding on a worker that stands out is at least this confident (paging)
LOCALISED_FLOOR = 0.6
#: a group that splits in two in a function: its slow side is slow, or its fast side fast.  Without an earlier healthy
#: window of the job, the fast side waiting for the slow (they hold the step) says which, as for a worker compared
#: by ratio that holds the step (x 0.8, as there); the job's own past weighs as it does there (:func:`_split_weight`)
SPLIT_WEIGHT = 0.8
SHORT_OF_EXCESS_Z = 2.0


def _refined(ctx: _Ctx, f: Finding, periodic: bool = False, excess_us: float = math.nan, lead: bool = True) -> Finding:
    """A cause rule's worker finding against the localisation: where the localisation has its worker(s), the
    finding pages: its confidence is at least LOCALISED_FLOOR (or the localisation's, if lower; a cause rule refines a
    localisation, and beyond that its own strength, the job's history and the evidence decide); where its workers' own
    work is not even a standard error above their peers' (NOT_STANDING_OUT_Z) and two standard errors short of
    what the function's excess would add to it (SHORT_OF_EXCESS_Z), and it waits more than its peers, it stays below
    paging: the straggler waits least, and a worker its peers keep waiting holds nobody up (where nobody waits, as
    in traces of independent runs side by side, nothing says it is a victim).  A small excess (a GPU kernel at 1% of
    the step) that its own work shows as well as the noise allows is left alone.  Left as they are too: links of
    collectives (a slow link's time is shared by its whole ring) and functions that do not run every step (an
    evaluation every third step cannot move the median step's own work).  Only the ``lead`` finding of a worker that
    stands out is lifted (:func:`_leads`); its others keep their own confidence."""
    if f.function_kind in WAITING_KINDS or not f.workers:
        return f
    st = ctx.standing
    mine = [loc for loc in st.localised if loc.worker in f.workers]
    if mine and not lead:  # another finding of its worker explains the shift (:func:`_leads`): no lift, no cap
        return msgspec.structs.replace(f, evidence=[*f.evidence, _own_evidence(mine[0])])
    if mine:
        # the localisation says where, so the finding pages (at least LOCALISED_FLOOR, or the localisation's own
        # confidence if lower); beyond that the rule's own strength, history and evidence decide
        loc_conf = max(_localised_confidence(ctx, loc) for loc in mine)
        conf = max(f.confidence, min(loc_conf, LOCALISED_FLOOR))
        if conf <= f.confidence:
            return msgspec.structs.replace(f, evidence=[*f.evidence, _own_evidence(mine[0])])
        return msgspec.structs.replace(
            f,
            confidence=conf,
            evidence=[*f.evidence, _own_evidence(mine[0])],
            summary=f.summary
            + f"; its own work {mine[0].shift:.0%} above its peers' ({mine[0].z:.1f} standard errors)",
        )
    zs = [st.z_of(w) for w in f.workers]
    expected = [st.expected_z(w, excess_us) for w in f.workers]
    weak = all(
        math.isfinite(z)
        and z < min(NOT_STANDING_OUT_Z, e - SHORT_OF_EXCESS_Z if math.isfinite(e) else 0.0)
        and st.waits_more_of(w)
        for w, z, e in zip(f.workers, zs, expected, strict=True)
    )
    if st.workers is not None and not periodic and weak and f.confidence > NOT_STANDING_OUT_CAP:
        return msgspec.structs.replace(
            f,
            confidence=NOT_STANDING_OUT_CAP,
            summary=f.summary
            + "; its own work (the step minus its waits) not above its peers' beyond the job's noise: "
            "it may be waiting",
        )
    # a noisy job: its workers' own work moves more from step to step than this excess is; the rule compared one
    # function, and the step around it may make up for it (x 0.75, as for a noisy peer group)
    share = excess_us / max(np.median([r.step_time_median_us for r in ctx.results]), 1.0)
    if not periodic and math.isfinite(st.noise) and st.noise > ctx.dp.noisy_rel_mad and share < st.noise:
        return msgspec.structs.replace(
            f,
            confidence=round(f.confidence * 0.75, 3),
            summary=f.summary + f"; a noisy job (its workers' own work moves {st.noise:.0%} from step to step, "
            f"this excess is {share:.0%} of the step)",
        )
    return f


def _localised_confidence(ctx: _Ctx, loc: Localised) -> float:
    bar = loc.bar if math.isfinite(loc.bar) else ctx.standing.bar  # a function's bar, or the own work's
    strength = min(1.0, loc.z / (2.0 * bar))
    conf = (0.5 + 0.3 * strength) * _persisted(loc.above) * (0.5 + 0.5 * ctx.coverage)
    if loc.basis == "split":
        conf *= _split_weight(ctx, loc)[0]
    return round(min(0.99, max(0.01, conf)), 3)


def _split_weight(ctx: _Ctx, loc: Localised) -> tuple[float, str]:
    """How much a split group's slow side (:mod:`.localise`, basis "split") weighs, and why: against the job's own
    earlier healthy windows (its group's typical work in the function), as a comparison by ratio is: the slow side
    ``regression_rise`` above them is slow (x 0.85); not above them, its fast side got faster (x 0.4); no such
    window: SPLIT_WEIGHT."""
    h = ctx.history
    base = h.work_of().get((loc.group, loc.function), math.nan) if h is not None and h.windows else math.nan
    if not math.isfinite(base) or base <= 0 or h is None:
        return SPLIT_WEIGHT, "no earlier healthy window of the job to tell slow workers from faster ones"
    if loc.work_us > (1.0 + ctx.dp.regression_rise) * base:
        return 0.85, f"{loc.work_us / base - 1:.0%} above the job's {h.windows} earlier healthy window(s)"
    return 0.4, f"as in the job's {h.windows} earlier healthy window(s): its faster peers got faster"


def _own_evidence(loc: Localised) -> Evidence:
    return Evidence(
        feature="own_work_us",
        value=round(loc.own_us, 1),
        peer_value=round(loc.peer_own_us, 1),
        deviation=round(loc.z, 2),
    )


def _function_noise_words(loc: Localised) -> str:
    """What a function-basis localisation's noise is: the function's spread across the peers, or in a pair (where
    that spread is the shift itself) how much the worker's excess over its only peer moves from step to step."""
    return "its excess's step-to-step spread" if loc.peers == 2 else "that function's spread across its peers"


def _function_peer_words(loc: Localised) -> str:
    return "its only peer's" if loc.peers == 2 else "its group's median"


def _own_words(loc: Localised) -> tuple[str, str]:
    """Which steps an own-work localisation was tested over, and its noise."""
    if loc.basis == "occurrence":
        return " of those a function that runs every few steps ran in", "their step-to-step noise"
    return "", "the job's step-to-step noise"


def _localised_finding(ctx: _Ctx, loc: Localised) -> Finding:
    """A worker that stands out from its peers (:mod:`.localise`) that no cause rule named: the worker and the
    function it stands out in, cause ``undetermined``."""
    conf = _localised_confidence(ctx, loc)
    evidence = [
        _own_evidence(loc),
        Evidence(feature="wait_us", value=round(loc.wait_us, 1), peer_value=round(loc.peer_wait_us, 1), deviation=None),
        Evidence(feature="job_noise", value=round(loc.shift, 4), peer_value=round(loc.noise, 4), deviation=None),
    ]
    if loc.function:
        evidence.append(
            Evidence(
                feature=f"work_us[{loc.function}]",
                value=round(loc.work_us, 1),
                peer_value=round(loc.peer_work_us, 1),
                deviation=None,
            )
        )
    function = loc.function or "own work"
    n = len(ctx.results)
    which_steps, noise_words = _own_words(loc)
    if loc.basis == "split":
        others = ", ".join(str(w) for w in loc.slow if w != loc.worker)
        summary = (
            f"worker {loc.worker}: its work in {function} above every one of its group's {len(loc.fast)} fastest "
            f"workers' ({', '.join(str(w) for w in loc.fast)}) in {len(loc.steps)}/{loc.n_steps} steps, as worker "
            f"{others}'s is (the least slow of the {len(loc.slow)} above the fast ones' median by "
            f"{loc.excess_share:.1%} of the step, "
            f"{loc.shift:.0%} of the fast ones' own work; {loc.z:.1f} standard errors against chance making "
            f"{len(loc.slow)} of {loc.peers} workers the slowest): {len(loc.slow)} of {loc.peers} are slow in it, so "
            f"the group's median is no baseline; the fast ones wait {loc.peer_wait_us:,.0f} us, this one "
            f"{loc.wait_us:,.0f}: they wait for the slow; {_split_weight(ctx, loc)[1]}; cause undetermined (no "
            f"cause rule's evidence)"
        )
    elif loc.basis == "function":
        summary = (
            f"worker {loc.worker}: its work in {function} above {_function_peer_words(loc)} in {len(loc.steps)}/"
            f"{loc.n_steps} steps, by {loc.excess_share:.1%} of the step ({loc.shift:.0%} of its peers' own work; "
            f"{loc.z:.1f} standard errors of {_function_noise_words(loc)}, {loc.noise:.2%} of the step), "
            f"where its own work as a whole is within the job's noise; it waits {loc.wait_us:,.0f} us, its peers "
            f"{loc.peer_wait_us:,.0f}: they wait for it; cause undetermined (no cause rule's evidence)"
        )
    else:
        summary = (
            f"worker {loc.worker}: its own work (the step minus its waits) {loc.shift:.0%} above its peers' in "
            f"{len(loc.steps)}/{loc.n_steps} steps{which_steps} ({loc.z:.1f} standard errors of {noise_words} "
            f"{loc.noise:.0%}), most in {function}; it waits {loc.wait_us:,.0f} us, its peers "
            f"{loc.peer_wait_us:,.0f}: they wait for it; cause undetermined (no cause rule's evidence)"
        )
    return Finding(
        id=finding_id(ctx.info.job, ctx.info.window, "worker", [loc.worker], function, "undetermined", None),
        job=ctx.info.job,
        window=ctx.info.window,
        steps=loc.steps,
        scope="worker",
        workers=[loc.worker],
        hosts=[loc.host],
        devices=[],
        group=None,
        function=function,
        function_kind=loc.kind or "python",
        cause="undetermined",
        confidence=conf,
        evidence=evidence,
        impact=_impact(loc.excess_share, ctx.info.expected_workers),
        policy=ctx.policy_ref,
        created_at=ctx.now,
        tenant=ctx.info.tenant,
        summary=summary,
        window_steps=n,
    )


# --------------------------------------------------------------------------- lossy links


def _collective(groups: pa.Table | None) -> tuple[str, str, float]:
    """The window's collective with the largest median share of the step: (function, kind, share); a lossy link
    slows every transfer over it, and the job waits in its collectives."""
    if groups is None or groups.num_rows == 0:
        return "", "collective", 0.0
    g = groups.filter(pc.is_in(groups.column("kind"), value_set=pa.array(list(WAITING_KINDS))))
    if g.num_rows == 0:
        return "", "collective", 0.0
    fn, inv = np.unique(np.asarray(g.column("function").to_pylist(), dtype=object), return_inverse=True)
    med = group_median(np.nan_to_num(_np(g, "share")), inv, fn.size)
    best = int(np.argmax(med))
    kind = g.column("kind").to_pylist()[int(np.flatnonzero(inv == best)[0])]
    return str(fn[best]), kind, float(med[best])


def _link_evidence(link: LossyLink | SlowLink) -> list[Evidence]:
    if isinstance(link, LossyLink):
        evidence = [
            Evidence(
                feature="tcp_retrans_share",
                value=round(link.loss, 5),
                peer_value=round(link.others_loss, 5) if math.isfinite(link.others_loss) else None,
                deviation=round(link.loss / link.others_loss - 1, 2) if link.others_loss > 0 else None,
            ),
            Evidence(feature="lossy_peers", value=float(len(link.peers)), peer_value=None, deviation=None),
        ]
    else:
        evidence = [
            Evidence(
                feature="tcp_busy_mbps",
                value=round(link.mbps, 1),
                peer_value=round(link.others_mbps, 1),
                deviation=round(link.mbps / link.others_mbps - 1, 2),
            ),
            Evidence(feature="slow_peers", value=float(len(link.peers)), peer_value=None, deviation=None),
        ]
    if math.isfinite(link.rtt_us) and math.isfinite(link.others_rtt_us):
        evidence.append(
            Evidence(
                feature="rtt_us",
                value=round(link.rtt_us, 1),
                peer_value=round(link.others_rtt_us, 1),
                deviation=round(link.rtt_us / link.others_rtt_us - 1, 2) if link.others_rtt_us > 0 else None,
            )
        )
    return evidence


def _link_confidence(ctx: _Ctx, link: LossyLink | SlowLink) -> float:
    """Named by its connections alone: from just paging at the bar to 0.9 at ten times the loss (lossy) or a
    quarter of the bar's throughput (slow)."""
    if isinstance(link, LossyLink):
        strength = min(1.0, link.loss / (10.0 * ctx.dp.link_loss_min))
    else:
        ratio = link.mbps / link.others_mbps
        strength = min(1.0, math.log(ctx.dp.link_slow_ratio / max(ratio, 1e-9)) / math.log(4.0))
    return round(min(0.99, (0.55 + 0.35 * max(strength, 0.0)) * (0.5 + 0.5 * ctx.coverage)), 3)


def _link_summary(link: LossyLink | SlowLink, function: str, share: float) -> str:
    peers = ", ".join(map(str, link.peers))
    cost = f"every worker waits for it in {function} ({share:.0%} of the step, what it can cost at most); cause nic"
    if isinstance(link, SlowLink):
        return (
            f"worker {link.worker}: its TCP connections with workers {peers} delivered at most "
            f"{link.mbps:,.0f} MB/s while they had data in flight, the other connections' median "
            f"{link.others_mbps:,.0f} MB/s; the one worker they share, its link (NIC speed, shaping or a congested "
            f"port) is slow; {cost}"
        )
    others = (
        f"the other connections' median {link.others_loss:.2%}"
        if math.isfinite(link.others_loss)
        else "no other connection sent enough to compare"
    )
    return (
        f"worker {link.worker}: its TCP connections with workers {peers} sent {link.loss:.2%} of their data "
        f"segments again ({link.retrans:,} of {link.segs_out:,}; {others}); "
        f"the one worker they share, its link (NIC, cable or switch port) loses packets; {cost}"
    )


def _with_links(ctx: _Ctx, findings: list[Finding], links: list[LossyLink | SlowLink]) -> list[Finding]:
    """A worker named by its lossy or slow connections (:mod:`.links`): a finding of its own on the job's
    collective, cause ``nic``; where a finding already names it in that collective (its timing, or the other rule),
    that finding gets the cause and the evidence."""
    if not links:
        return findings
    function, kind, share = _collective(ctx.groups)
    function = function or "network"
    n = len(ctx.results)
    steps = sorted({r.step for r in ctx.results})
    out = list(findings)
    for link in links:
        conf = _link_confidence(ctx, link)
        evidence = _link_evidence(link)
        summary = _link_summary(link, function, share)
        same = [
            i
            for i, f in enumerate(out)
            if f.scope == "worker" and f.workers == [link.worker] and f.function == function
        ]
        if same:
            f = out[same[0]]
            out[same[0]] = msgspec.structs.replace(
                f,
                id=finding_id(f.job, f.window, f.scope, f.workers, f.function, "nic", f.group),
                cause="nic",
                confidence=max(f.confidence, conf),
                evidence=[*f.evidence, *(e for e in evidence if e.feature not in {x.feature for x in f.evidence})],
                summary=f"{f.summary}; {summary}",
            )
            continue
        host, device = "", ""  # the worker's, as its agent named them
        for r in ctx.results:
            if r.workers is not None and r.workers.num_rows:
                hit = r.workers.filter(pc.equal(r.workers.column("worker"), link.worker))
                if hit.num_rows:
                    host, device = str(hit.column("host")[0].as_py()), str(hit.column("device")[0].as_py() or "")
                    break
        out.append(
            Finding(
                id=finding_id(ctx.info.job, ctx.info.window, "worker", [link.worker], function, "nic", None),
                job=ctx.info.job,
                window=ctx.info.window,
                steps=steps,
                scope="worker",
                workers=[link.worker],
                hosts=[host] if host else [],
                devices=[device] if device else [],
                group=None,
                function=function,
                function_kind=kind,
                cause="nic",
                confidence=conf,
                evidence=evidence,
                impact=_impact(share, ctx.info.expected_workers),
                policy=ctx.policy_ref,
                created_at=ctx.now,
                tenant=ctx.info.tenant,
                summary=summary,
                window_steps=n,
            )
        )
    return out


# --------------------------------------------------------------------------- scope: group


def _labels(group_key: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in group_key.split(";") if "=" in kv)


def _group_findings(ctx: _Ctx, g: pa.Table) -> list[Finding]:
    """One peer group (pipeline stage) with more work per step than the other groups."""
    if g.num_rows == 0:
        return []
    grp = _np(g, "group").astype(str)
    gnames, gi = np.unique(grp, return_inverse=True)
    if gnames.size < 2:
        return []
    compute = ~np.isin(_np(g, "kind").astype(str), WAITING_KINDS)
    fnames, fi = np.unique(_np(g, "function").astype(str), return_inverse=True)
    steps, si = np.unique(_np(g, "step"), return_inverse=True)
    n_g, n_f, n_s = gnames.size, fnames.size, steps.size
    work = np.zeros((n_s, n_g, n_f))  # a function a group does not run is no work
    work[si[compute], gi[compute], fi[compute]] = _np(g, "work_us")[compute]
    by_step = {r.step: r.step_time_median_us for r in ctx.results}
    step_time = np.array([by_step[int(s)] for s in steps])
    total = work.sum(axis=2)  # (steps, groups)
    ref = np.median(total, axis=1, keepdims=True)
    excess = total - ref
    over = excess > ctx.dp.group_excess_share * step_time[:, None]
    persistent = np.flatnonzero(over.sum(axis=0) >= ctx.need)
    findings = []
    kinds = dict(zip(_np(g, "function").astype(str), _np(g, "kind").astype(str)))
    n_workers = dict(zip(grp, _np(g, "workers")))
    for k in persistent:
        in_steps = over[:, k]
        fexcess = np.median(work[in_steps, k, :] - np.median(work[in_steps], axis=1), axis=0)
        f = int(np.argmax(fexcess))
        share = float(np.median(excess[in_steps, k] / step_time[in_steps]))
        persistence = float(in_steps.mean())
        labels = _labels(gnames[k])
        conf = (
            0.9
            * _persisted(persistence)
            * (0.5 + 0.5 * ctx.coverage)
            * (1.0 if n_g >= 4 else 0.85 if n_g == 3 else 0.7)
        )
        name = ", ".join(f"{a}={b}" for a, b in labels.items()) or "(unlabelled)"
        findings.append(
            Finding(
                id=finding_id(ctx.info.job, ctx.info.window, "group", [], str(fnames[f]), "pipeline_imbalance", labels),
                job=ctx.info.job,
                window=ctx.info.window,
                steps=[int(s) for s in steps[in_steps]],
                scope="group",
                workers=[],
                hosts=[],
                devices=[],
                group=labels,
                function=str(fnames[f]),
                function_kind=str(kinds[str(fnames[f])]),
                cause="pipeline_imbalance",
                confidence=round(min(0.99, conf), 3),
                evidence=[
                    Evidence(
                        feature="group_work_us",
                        value=round(float(np.median(total[in_steps, k])), 1),
                        peer_value=round(float(np.median(ref[in_steps, 0])), 1),
                        deviation=round(share, 4),
                    ),
                    Evidence(
                        feature=f"work_us[{fnames[f]}]",
                        value=round(float(np.median(work[in_steps, k, f])), 1),
                        peer_value=round(float(np.median(np.median(work[in_steps, :, f], axis=1))), 1),
                        deviation=None,
                    ),
                ],
                impact=_impact(share, ctx.info.expected_workers),
                policy=ctx.policy_ref,
                created_at=ctx.now,
                tenant=ctx.info.tenant,
                summary=f"peer group {name} ({int(n_workers[gnames[k]])} workers) does {share:.0%} of the step more work than the "
                f"other {n_g - 1} group(s), most in {fnames[f]}, in {int(in_steps.sum())}/{n_s} steps; cause pipeline_imbalance",
                window_steps=len(ctx.results),
            )
        )
    return findings


# --------------------------------------------------------------------------- scope: job


#: a job-wide finding from an expected range alone (communication above comm_share_max of the step): a rule of thumb,
#: not the job's own peers or past, so it does not page by itself
COMM_RANGE_CONFIDENCE = 0.45


def _python_findings(
    ctx: _Ctx, gpu_job: bool, fn: np.ndarray, kind: np.ndarray, step: np.ndarray, share: np.ndarray, n_peer_groups: int
) -> list[Finding]:
    """A Python function above ``python_share_max`` of the step in every peer group, where the GPU does the compute."""
    dp = ctx.dp
    findings: list[Finding] = []
    py = np.flatnonzero(kind == "python") if gpu_job else np.array([], dtype=np.intp)
    if py.size:
        keys, inv, first = _keys(fn[py], step[py])
        lo = np.full(keys.size, np.inf)
        np.minimum.at(lo, inv, share[py])
        n_groups = np.bincount(inv, minlength=keys.size)
        over = (lo > dp.python_share_max) & (n_groups == n_peer_groups)
        for f in np.unique(fn[py][first][over]):
            sel = over & (fn[py][first] == f)
            if sel.sum() >= ctx.need:
                med = float(np.median(lo[sel]))
                findings.append(
                    _share_finding(
                        ctx, str(f), "python", "python_overhead", step[py][first][sel], med, dp.python_share_max, 0.6
                    )
                )

    return findings


def _comm_findings(
    ctx: _Ctx, grp: np.ndarray, kind: np.ndarray, step: np.ndarray, share: np.ndarray, n_peer_groups: int
) -> list[Finding]:
    """Communication (its work, waits excluded) above ``comm_share_max`` of the step in every peer group."""
    dp = ctx.dp
    findings: list[Finding] = []
    comm = np.isin(kind, WAITING_KINDS)
    if comm.any():
        keys, inv, first = _keys(step[comm], grp[comm])
        per = np.bincount(inv, weights=share[comm], minlength=keys.size)
        s_of = step[comm][first]
        steps = np.unique(s_of)
        lo = np.array([per[s_of == s].min() if (s_of == s).sum() == n_peer_groups else 0.0 for s in steps])
        over = lo > dp.comm_share_max
        if over.sum() >= ctx.need:
            med = float(np.median(lo[over]))
            findings.append(
                _share_finding(
                    ctx,
                    "communication",
                    "collective",
                    "framework_config",
                    steps[over],
                    med,
                    dp.comm_share_max,
                    COMM_RANGE_CONFIDENCE,
                )
            )
    return findings


def _job_findings(ctx: _Ctx, g: pa.Table, history: JobHistory | None, found: list[Finding]) -> list[Finding]:
    """No outlier among peers: compare with what is normal (expected ranges) and with the job's own past.

    What the window's worker and group findings (``found``) explain is left out.  A
    culprit makes every member of its collectives wait, and a slow link slows its
    whole ring; when a whole peer group waits (a collective spanning pipeline
    stages, a stage behind one switch) the wait estimate cannot take the wait out
    of its communication, so communication is only judged in windows without such
    findings.  A peer group with a group finding is not judged against its past
    either: its extra work is that finding; nor is a small group (compared by
    ratio) with a worker finding: its median moves with its culprit (of two
    workers, by half the culprit's excess).
    """
    if g.num_rows == 0:
        return []
    dp = ctx.dp
    grp, fn, kind = _np(g, "group").astype(str), _np(g, "function").astype(str), _np(g, "kind").astype(str)
    explained = [";".join(f"{k}={v}" for k, v in (f.group or {}).items()) for f in found if f.scope == "group"]
    culprits = [w for f in found if f.scope == "worker" for w in f.workers]
    if culprits:
        out = _concat([r.outliers for r in ctx.results], ctx.results)
        small = np.unique(grp[_np(g, "workers") <= dp.ratio_peers_max])
        explained += [
            x for x in np.unique(_np(out, "group")[np.isin(_np(out, "worker"), culprits)].astype(str)) if x in small
        ]
    keep = ~np.isin(grp, explained)
    if found:
        keep &= ~np.isin(kind, WAITING_KINDS)
    g = g.filter(pa.array(keep))
    if g.num_rows == 0:
        return []
    grp, fn, kind = grp[keep], fn[keep], kind[keep]
    step, work, st = _np(g, "step"), _np(g, "work_us"), _np(g, "step_time_us")
    share = work / st
    gnames = np.unique(grp)

    gpu_job = bool(np.any(_np(g, "resource").astype(str) == "gpu"))
    findings = _python_findings(ctx, gpu_job, fn, kind, step, share, gnames.size)

    regressions = (
        _regressions(ctx, grp, fn, kind, step, work, st, history) if history is not None and history.windows else []
    )
    # communication, unless a collective is slower than it used to be (that regression says more)
    if not any(f.function_kind in WAITING_KINDS for f in regressions):
        findings += _comm_findings(ctx, grp, kind, step, share, gnames.size)
    return findings + regressions


def _regressions(
    ctx: _Ctx,
    grp: np.ndarray,
    fn: np.ndarray,
    kind: np.ndarray,
    step: np.ndarray,
    work: np.ndarray,
    st: np.ndarray,
    history: JobHistory,
) -> list[Finding]:
    """Every worker of a group (or of the job) slower in a function than in the job's earlier healthy windows."""
    dp = ctx.dp
    hkeys = np.char.add(
        np.char.add(np.asarray(history.group, dtype=str), "\x1f"), np.asarray(history.function, dtype=str)
    )
    order = np.argsort(hkeys)
    hsorted = hkeys[order]
    keys = np.char.add(np.char.add(grp, "\x1f"), fn)
    pos = np.clip(np.searchsorted(hsorted, keys), 0, max(hsorted.size - 1, 0))
    known = hsorted.size > 0
    matched = (hsorted[pos] == keys) if known else np.zeros(keys.size, dtype=bool)
    base = np.where(matched, np.asarray(history.work_us, dtype=np.float64)[order][pos] if known else 0.0, np.nan)
    spread = (
        np.asarray(history.work_spread_us or [0.0] * hsorted.size, dtype=np.float64)[order][pos]
        if known
        else np.zeros(keys.size)
    )
    with np.errstate(invalid="ignore"):
        over = matched & (work > base * (1.0 + dp.regression_rise)) & (work - base > dp.min_excess_share * st)
    cells, inv, first = _keys(grp, fn)
    n_over = _steps_per_key(inv[over], step[over], cells.size) if over.any() else np.zeros(cells.size, dtype=np.int64)
    # ... and the window's median above the baseline's by more than the function's step-to-step spread (then and
    # now) allows for medians of that many steps: a pipeline send/recv waits more or less from one step to the next
    n_steps = _steps_per_key(inv, step, cells.size)
    now = group_median(work, inv, cells.size)
    spread_now = 1.4826 * group_median(np.abs(work - now[inv]), inv, cells.size)
    noise = np.hypot(spread[first], spread_now) / np.sqrt(np.maximum(n_steps, 1))
    regressed = (n_over >= ctx.need) & (now - base[first] > dp.z_threshold * noise)
    findings = []
    for f in np.unique(fn[first][regressed]):
        in_f = fn[first] == f
        groups_f = np.unique(grp[first][in_f & np.isin(np.arange(cells.size), inv[matched])])
        bad = np.unique(grp[first][in_f & regressed])
        rows = over & (fn == f)
        cur, was = float(np.median(work[rows])), float(np.median(base[rows]))
        share = float(np.median((work[rows] - base[rows]) / st[rows]))
        ev = [
            Evidence(
                feature="work_us",
                value=round(cur, 1),
                peer_value=round(was, 1),
                deviation=round(cur / was - 1, 4) if was > 0 else None,
            ),
            Evidence(feature="healthy_windows", value=float(history.windows), peer_value=None, deviation=None),
        ]
        steps = np.unique(step[rows])
        fkind = str(kind[first][in_f][0])
        if bad.size == groups_f.size:
            findings.append(
                _job_finding(
                    ctx,
                    str(f),
                    fkind,
                    "regression",
                    steps,
                    ev,
                    share,
                    0.9,
                    f"every worker: {f} {cur / was - 1:.0%} slower than in the job's {history.windows} earlier healthy window(s)",
                )
            )
            continue
        for gk in bad:
            labels = _labels(str(gk))
            findings.append(
                Finding(
                    id=finding_id(ctx.info.job, ctx.info.window, "group", [], str(f), "regression", labels),
                    job=ctx.info.job,
                    window=ctx.info.window,
                    steps=[int(s) for s in steps],
                    scope="group",
                    workers=[],
                    hosts=[],
                    devices=[],
                    group=labels,
                    function=str(f),
                    function_kind=fkind,
                    cause="regression",
                    confidence=round(0.8 * (0.5 + 0.5 * ctx.coverage), 3),
                    evidence=ev,
                    impact=_impact(share, ctx.info.expected_workers),
                    policy=ctx.policy_ref,
                    created_at=ctx.now,
                    tenant=ctx.info.tenant,
                    window_steps=len(ctx.results),
                    summary=f"peer group {gk}: {f} slower than in the job's {history.windows} earlier healthy window(s); cause regression",
                )
            )
    return findings


def _share_finding(
    ctx: _Ctx, function: str, kind: str, cause: str, steps: np.ndarray, share: float, share_max: float, conf: float
) -> Finding:
    """A job-scope finding of a share of the step (``share``, the median over ``steps``) above its expected range's
    top (``share_max``): the share against the top is its evidence, the excess its impact."""
    ev = Evidence(feature="share", value=round(share, 4), peer_value=share_max, deviation=round(share / share_max, 2))
    return _job_finding(ctx, function, kind, cause, steps, [ev], share - share_max, conf)


def _job_finding(
    ctx: _Ctx,
    function: str,
    kind: str,
    cause: str,
    steps: np.ndarray,
    evidence: list[Evidence],
    share: float,
    conf: float,
    summary: str = "",
) -> Finding:
    n = len(ctx.results)
    st = ctx.standing
    if math.isfinite(st.top_z):  # why no worker is named: the one nearest to standing out, against the bar
        evidence = [
            *evidence,
            Evidence(
                feature=f"own_work_z[worker {st.top_worker}]",
                value=round(st.top_z, 2),
                peer_value=round(st.bar, 2),
                deviation=round(st.top_shift, 4),
            ),
        ]
        summary = (summary or f"every worker: {function} above its expected share of the step") + (
            f"; no worker stands out from its peers (the nearest, worker {st.top_worker}, {st.top_z:.1f} standard "
            f"errors of the job's noise, {st.bar:.1f} needed)"
        )
    return Finding(
        id=finding_id(ctx.info.job, ctx.info.window, "job", [], function, cause, None),
        job=ctx.info.job,
        window=ctx.info.window,
        steps=sorted(int(s) for s in steps),
        scope="job",
        workers=[],
        hosts=[],
        devices=[],
        group=None,
        function=function,
        function_kind=kind,
        cause=cause,
        confidence=round(conf * _persisted(len(steps) / n) * ctx.coverage, 3),
        evidence=evidence,
        impact=_impact(share, ctx.info.expected_workers),
        policy=ctx.policy_ref,
        created_at=ctx.now,
        tenant=ctx.info.tenant,
        summary=(summary or f"every worker: {function} above its expected share of the step")
        + f" in {len(steps)}/{n} steps; cause {cause}",
        window_steps=n,
    )
