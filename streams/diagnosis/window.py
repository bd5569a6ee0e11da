"""Window diagnosis: from the step results of one window to findings.

- Persistence: a (worker, function) deviation counts only if it holds in enough
  of the window's steps (policy ``persistence`` and ``min_persistent_steps``).
- Topology: deviating workers of one function that share the resource behind it
  (a NIC for inter-node collectives, a host for CPU-bound functions) become one
  finding naming the shared element.
- Job-wide: functions that exceed expected ranges on every worker (a Python
  function over 1% of the critical path, communication over 30%).
- Impact: what-if - the culprits' excess work removed, the synchronised step
  recomputed as the slowest remaining worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.records import Evidence, Finding, Impact, WindowReport, finding_id
from ..policy import Policy
from .causes import Suspect, classify
from .stats import group_median
from .step import EVIDENCE_COLUMNS, StepResult


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


def diagnose_window(
    info: WindowInfo,
    results: list[StepResult],
    policy: Policy,
    *,
    now: float,
    closed: str = "complete",
    bytes_in: int = 0,
) -> WindowDiagnosis:
    dp = policy.diagnosis
    results = sorted(results, key=lambda r: r.step)
    steps_seen = len(results)
    policy_ref = info.policy or policy.ref
    findings: list[Finding] = []
    if steps_seen:
        need = max(min(dp.min_persistent_steps, steps_seen), math.ceil(dp.persistence * steps_seen))
        findings += _worker_findings(info, results, policy, need, now, policy_ref)
        findings += _job_findings(info, results, policy, need, now, policy_ref)
    findings.sort(key=lambda f: (-f.impact.step_time_share, f.id))
    # worker-steps delivered of those expected: a step nobody delivered counts as 0
    coverage = sum(min(r.workers_seen, info.expected_workers) for r in results) / (info.expected_workers * max(info.steps, steps_seen))
    seen = max((r.workers_seen for r in results), default=0)
    report = WindowReport(
        job=info.job,
        window=info.window,
        start_step=info.start_step,
        steps=info.steps,
        steps_seen=steps_seen,
        expected_workers=info.expected_workers,
        workers_seen=seen,
        coverage=round(min(1.0, coverage), 4),
        bytes_per_worker=round(bytes_in / seen, 1) if seen else 0.0,
        findings=len(findings),
        actionable=any(f.cause != "unknown" for f in findings),
        reached_device=any(f.devices for f in findings),
        closed=closed,  # type: ignore[arg-type]
        closed_at=now,
        policy=policy_ref,
        tenant=info.tenant,
    )
    return WindowDiagnosis(findings=findings, report=report)


def _coverage_term(results: list[StepResult], expected: int) -> float:
    return float(np.mean([min(1.0, r.workers_seen / expected) for r in results]))


def _worker_findings(info, results, policy, need, now, policy_ref) -> list[Finding]:
    dp = policy.diagnosis
    tables = [r.outliers.append_column("step", pa.array(np.full(r.outliers.num_rows, r.step, dtype=np.int64))) for r in results]
    out = pa.concat_tables(tables)
    if out.num_rows == 0:
        return []
    worker = out.column("worker").to_numpy()
    fn = out.column("function").to_numpy(zero_copy_only=False).astype(str)
    step = out.column("step").to_numpy()
    pair_keys = np.char.add(np.char.add(worker.astype(str), "\x1f"), fn)
    pairs, pair = np.unique(pair_keys, return_inverse=True)
    n_pairs = pairs.size
    # steps in which each (worker, function) deviated
    n_steps = np.bincount(np.unique(pair * (step.max() + 1) + step) // (step.max() + 1), minlength=n_pairs)
    persistent = n_steps >= need
    if not persistent.any():
        return []
    num = {c: group_median(out.column(c).to_numpy(zero_copy_only=False).astype(np.float64), pair, n_pairs)
           for c in ("z", "work_us", "peer_work_us", "excess_us", "peers", *EVIDENCE_COLUMNS, *(f"peer_{c}" for c in EVIDENCE_COLUMNS))}  # fmt: skip
    first = np.full(n_pairs, -1, dtype=np.int64)
    first[pair[::-1]] = np.arange(pair.size - 1, -1, -1)
    ce = out.column("clock_events").to_numpy().astype(np.uint64)
    pce = out.column("peer_clock_events").to_numpy().astype(np.uint64)
    ce_or = np.zeros(n_pairs, dtype=np.uint64)
    np.bitwise_or.at(ce_or, pair, ce)
    pce_and = np.full(n_pairs, np.iinfo(np.uint64).max, dtype=np.uint64)
    np.bitwise_and.at(pce_and, pair, pce)
    col = {c: out.column(c).to_numpy(zero_copy_only=False) for c in ("worker", "host", "device", "nic", "switch", "group", "function", "kind", "resource", "has_hardware")}

    # cluster persistent pairs: shared NIC for inter-node communication, shared host for CPU-bound work
    clusters: dict[tuple, list[int]] = {}
    for p in np.flatnonzero(persistent):
        r = first[p]
        res = col["resource"][r]
        if res == "nic":
            elem = col["nic"][r] or col["host"][r]
        elif res in ("cpu", "storage"):
            elem = col["host"][r]
        else:
            elem = f"worker:{col['worker'][r]}"
        clusters.setdefault((col["function"][r], res, elem), []).append(p)
    if any(k[1] == "nic" for k in clusters):
        clusters = _merge_by_switch(clusters, first, col)

    cov = _coverage_term(results, info.expected_workers)
    attributed = []
    for (function, resource, _elem), members in clusters.items():
        reps = first[members]
        s = Suspect(
            function=function,
            kind=str(col["kind"][reps[0]]),
            resource=resource,
            workers=sorted(int(w) for w in col["worker"][reps]),
            hosts=[str(x) for x in col["host"][reps]],
            devices=[str(x) for x in col["device"][reps]],
            nics=[str(x) for x in col["nic"][reps]],
            switches=[str(x) for x in col["switch"][reps]],
            peers=int(np.nanmin(num["peers"][members])),
            z=float(np.median(num["z"][members])),
            work_us=float(np.median(num["work_us"][members])),
            peer_work_us=float(np.median(num["peer_work_us"][members])),
            excess_us=float(np.median(num["excess_us"][members])),
            has_hardware=bool(np.all(col["has_hardware"][reps])),
            clock_events=int(np.bitwise_or.reduce(ce_or[members])),
            peer_clock_events=int(np.bitwise_and.reduce(pce_and[members])),
            values={c: float(np.median(num[c][members])) for c in EVIDENCE_COLUMNS},
            peer_values={c: float(np.median(num[f"peer_{c}"][members])) for c in EVIDENCE_COLUMNS},
        )
        attributed.append((s, classify(s, policy.diagnosis), members))

    # one finding per culprit and cause: a throttled GPU slows every kernel, say so once
    merged: dict[tuple, list] = {}
    for s, att, members in attributed:
        merged.setdefault((tuple(s.workers), att.cause, tuple(att.devices)), []).append((s, att, members))
    findings = []
    for (workers, cause, devices), parts in merged.items():
        parts.sort(key=lambda p: -p[0].excess_us * len(p[2]))
        s, att, _ = parts[0]
        members = np.concatenate([p[2] for p in parts])
        functions = [p[0].function for p in parts]
        evidence = list(att.evidence) + [
            Evidence(feature=f"work_us[{p[0].function}]", value=round(p[0].work_us, 1), peer_value=round(p[0].peer_work_us, 1), deviation=round(p[0].z, 2))
            for p in parts[1:]
        ]
        flagged_steps = sorted({int(x) for x in step[np.isin(pair, members)]})
        persistence = float(np.mean(n_steps[members])) / len(results)
        share = _what_if(results, out, worker, fn, step, np.asarray(workers), functions)
        conf = _confidence(s, att.certainty, persistence, cov, policy)
        findings.append(
            Finding(
                id=finding_id(info.job, info.window, "worker", list(workers), s.function, cause, None),
                job=info.job,
                window=info.window,
                steps=flagged_steps,
                scope="worker",
                workers=list(workers),
                hosts=sorted(set(s.hosts)),
                devices=list(devices),
                group=None,
                function=s.function,
                function_kind=s.kind,
                cause=cause,
                confidence=conf,
                evidence=evidence,
                impact=Impact(step_time_share=round(share, 4), gpu_hours_per_day=round(share * info.expected_workers * 24.0, 2)),
                policy=policy_ref,
                created_at=now,
                tenant=info.tenant,
                summary=_summary(s, cause, list(devices), len(flagged_steps), len(results), len(parts) - 1),
                window_steps=len(results),
            )
        )
    return findings


def _merge_by_switch(clusters, first, col):
    """NIC clusters of one function on several hosts behind one switch become one switch cluster."""
    by_fn: dict[tuple, list[tuple]] = {}
    for key, members in clusters.items():
        if key[1] == "nic":
            sw = col["switch"][first[members[0]]]
            if sw:
                by_fn.setdefault((key[0], sw), []).append(key)
    for (function, sw), keys in by_fn.items():
        if len(keys) > 1:
            merged = [p for k in keys for p in clusters.pop(k)]
            clusters[(function, "nic", f"switch:{sw}")] = merged
    return clusters


def _what_if(results, out, worker, fn, step, members, functions) -> float:
    """Share of the synchronised step saved if the members' excess in ``functions`` were gone (median over steps)."""
    saved = []
    excess = out.column("excess_us").to_numpy()
    wwork = out.column("worker_work_us").to_numpy()
    for r in results:
        in_step = step == r.step
        is_member = in_step & np.isin(worker, members)
        fixed = is_member & np.isin(fn, functions)
        if not fixed.any() or not math.isfinite(r.work_max_us) or r.step_time_us <= 0:
            saved.append(0.0)
            continue
        # remaining work of every flagged worker after the fix; healthy workers are unchanged
        ws, inv = np.unique(worker[in_step], return_inverse=True)
        work_w = np.zeros(ws.size)
        np.maximum.at(work_w, inv, wwork[in_step])
        cut = np.zeros(ws.size)
        np.add.at(cut, inv, np.where(fixed[in_step], excess[in_step], 0.0))
        new_max = np.max(work_w - cut)
        if math.isfinite(r.healthy_work_max_us):
            new_max = max(new_max, r.healthy_work_max_us)
        saved.append(max(0.0, r.work_max_us - new_max) / r.step_time_us)
    return float(np.median(saved)) if saved else 0.0


def _confidence(s: Suspect, certainty: float, persistence: float, coverage: float, policy: Policy) -> float:
    thr = policy.diagnosis.z_threshold
    strength = 0.6 + 0.4 * min(1.0, max(0.0, (s.z - thr) / (3 * thr)))
    peers = 1.0 if s.peers >= 8 else (0.85 if s.peers >= 4 else 0.7)
    c = certainty * strength * (0.5 + 0.5 * persistence) * peers * (0.5 + 0.5 * coverage)
    return round(min(0.99, max(0.01, c)), 3)


def _summary(s: Suspect, cause: str, devices: list[str], n_steps: int, n: int, more: int = 0) -> str:
    who = f"worker {s.workers[0]}" if len(s.workers) == 1 else f"{len(s.workers)} workers ({', '.join(map(str, s.workers[:6]))}{'...' if len(s.workers) > 6 else ''})"
    slower = (s.work_us / s.peer_work_us - 1) * 100 if s.peer_work_us > 0 else float("nan")
    where = f" on {', '.join(devices[:3])}" if devices else ""
    also = f" (and {more} more function{'s' if more > 1 else ''})" if more else ""
    return f"{who}{where}: {s.function}{also} {slower:.0f}% slower than {s.peers} peers in {n_steps}/{n} steps; cause {cause}"


def _job_findings(info, results, policy, need, now, policy_ref) -> list[Finding]:
    """Expected ranges, every worker at once: no outlier exists, so compare against what is normal."""
    dp = policy.diagnosis
    g = pa.concat_tables([r.groups.append_column("step", pa.array(np.full(r.groups.num_rows, r.step, dtype=np.int64))) for r in results])
    if g.num_rows == 0:
        return []
    findings = []
    # a Python function above python_share_max of the step in every peer group, in enough steps
    py = g.filter(pc.equal(g.column("kind"), "python"))
    if py.num_rows:
        fn = py.column("function").to_numpy(zero_copy_only=False).astype(str)
        share = py.column("share").to_numpy()
        step = py.column("step").to_numpy()
        for f in np.unique(fn):
            m = fn == f
            per_step_min = {int(s_): float(share[m & (step == s_)].min()) for s_ in np.unique(step[m])}
            over = [s_ for s_, v in per_step_min.items() if v > dp.python_share_max]
            if len(over) >= need:
                med = float(np.median([per_step_min[s_] for s_ in over]))
                findings.append(_job_finding(info, results, policy_ref, now, f, "python", "python_overhead", sorted(over),
                                             [Evidence(feature="share", value=round(med, 4), peer_value=dp.python_share_max, deviation=round(med / dp.python_share_max, 2))],
                                             med - dp.python_share_max, 0.6))  # fmt: skip
    # communication above comm_share_max of the step on every worker
    comm = g.filter(pc.is_in(g.column("kind"), pa.array(["collective", "p2p"])))
    if comm.num_rows:
        step = comm.column("step").to_numpy()
        grp = comm.column("group").to_numpy(zero_copy_only=False).astype(str)
        share = comm.column("share").to_numpy()
        over = []
        vals = []
        for s_ in np.unique(step):
            m = step == s_
            per_group = {gg: share[m & (grp == gg)].sum() for gg in np.unique(grp[m])}
            lo = min(per_group.values())
            if lo > dp.comm_share_max:
                over.append(int(s_))
                vals.append(lo)
        if len(over) >= need:
            med = float(np.median(vals))
            findings.append(_job_finding(info, results, policy_ref, now, "communication", "collective", "framework_config", over,
                                         [Evidence(feature="share", value=round(med, 4), peer_value=dp.comm_share_max, deviation=round(med / dp.comm_share_max, 2))],
                                         med - dp.comm_share_max, 0.5))  # fmt: skip
    return findings


def _job_finding(info, results, policy_ref, now, function, kind, cause, steps, evidence, share, conf) -> Finding:
    return Finding(
        id=finding_id(info.job, info.window, "job", [], function, cause, None),
        job=info.job,
        window=info.window,
        steps=steps,
        scope="job",
        workers=[],
        hosts=[],
        devices=[],
        group=None,
        function=function,
        function_kind=kind,
        cause=cause,
        confidence=round(conf * _coverage_term(results, info.expected_workers), 3),
        evidence=evidence,
        impact=Impact(step_time_share=round(max(0.0, share), 4), gpu_hours_per_day=round(max(0.0, share) * info.expected_workers * 24.0, 2)),
        policy=policy_ref,
        created_at=now,
        tenant=info.tenant,
        summary=f"every worker: {function} above its expected share of the step in {len(steps)}/{len(results)} steps; cause {cause}",
        window_steps=len(results),
    )
