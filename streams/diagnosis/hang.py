"""Which worker holds a hung job, and where: the agents' answers to a hang trigger compared (pure, no I/O).

Every agent of a hung job answers the hang window's trigger with where its training thread is
(:class:`~lockstep.schemas.records.HangReport`).  Synchronous workers of a hung job wait in the same place:
the collective (or the frame) where most answers are is where the job waits, the **majority's position**.
The culprits are the workers that are not there:

- a worker in another place (another function, a region the others left, no collective open while the others
  wait in one), or in the same collective but an earlier call of it (a lower sequence number on the same
  process group), or behind the majority's last completed step: cause ``hang``, named by where it is
  (the innermost ``record_function`` region open, else its innermost Python frame);
- an expected worker that did not answer and whose process its host's other agents saw exited (it registered at
  attach and never closed): cause ``worker_died``;
- an expected worker that did not answer while other workers of its host did, its process still there: ``hang``
  (stuck in C code that holds the GIL, or its agent's thread is gone);
- expected workers whose whole host did not answer: ``hang`` at lower confidence (a host that is gone).

Reports sent by closing agents (``reason="exit"``: their training thread ended, e.g. on the error a collective raises
when a peer's process died) are compared the same way, over their hosts' workers only: the worker whose process
exited before them, without closing, is ``worker_died``.

When every worker answered from the same place, nobody is not where the others are: one job-scope finding says
where they all wait (a hang below Python: a device kernel, the network, or a peer outside the job).

Vectorised over workers (numpy): a job of 10,000 workers answers with 10,000 reports, grouped once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ...schemas.records import Evidence, Finding, HangReport, Impact, finding_id

#: confidences: the position of an answering worker differs from a strict majority's / no strict majority
CONFIDENCE_PLACE = 0.9
CONFIDENCE_NO_MAJORITY = 0.6
#: a worker whose process its host's others saw exited
CONFIDENCE_EXITED = 0.9
#: a worker that did not answer while its host's others did / whose whole host did not answer
CONFIDENCE_SILENT = 0.8
CONFIDENCE_HOST_SILENT = 0.5
#: every worker answered from one place: where the job waits, not who holds it
CONFIDENCE_ALL_ALIKE = 0.3
#: culprit workers a finding names at most (a finding per distinct position; the rest are counted in its summary)
MAX_NAMED = 256


@dataclass(frozen=True)
class Position:
    """Where a worker is: what the finding names and what the majority's evidence says."""

    function: str  # the region, else the frame ("" when it did not answer)
    frame: str
    region: str
    collective: str
    collective_seq: int
    collective_group: str
    collective_open: bool
    last_step: int

    def describe(self) -> str:
        where = self.region or self.frame or "an unknown place"
        if self.region and self.frame:
            where = f"{self.region} (in {self.frame})"
        if self.collective_open:
            where += f", inside {self.collective} #{self.collective_seq} on group {self.collective_group}"
        elif self.collective:
            where += f", its last collective {self.collective} #{self.collective_seq} returned"
        return f"{where}, after step {self.last_step}"


def _position(r: HangReport) -> Position:
    return Position(
        function=r.region or r.frame,
        frame=r.frame,
        region=r.region,
        collective=r.collective,
        collective_seq=r.collective_seq,
        collective_group=r.collective_group,
        collective_open=r.collective_open,
        last_step=r.last_step,
    )


def _key(r: HangReport) -> str:
    """Two workers are in the same place when these agree (the step, the region and frame, the open collective)."""
    coll = f"{r.collective}@{r.collective_group}#{r.collective_seq}" if r.collective_open else "-"
    return f"{r.last_step}\x1f{r.region}\x1f{r.frame}\x1f{coll}"


def _kind(function: str, collective_open: bool) -> str:
    f = function.lower()
    if collective_open:
        return "collective"
    if "dataloader" in f or "__getitem__" in f or "__next__" in f:
        return "dataloader"
    return "python" if function else "other"


def latest(reports: Sequence[HangReport]) -> list[HangReport]:
    """One report per worker (the last sent: a replay or a second answer does not count twice)."""
    by: dict[int, HangReport] = {}
    for r in reports:
        old = by.get(r.worker)
        if old is None or r.sent_at >= old.sent_at:
            by[r.worker] = r
    return [by[w] for w in sorted(by)]


def diagnose_hang(
    job: str,
    window: str,
    reports: Sequence[HangReport],
    expected_workers: int,
    *,
    policy: str = "default",
    tenant: str = "",
    now: float,
) -> list[Finding]:
    """The findings of one hang window from its answers (any order, duplicates allowed)."""
    reps = latest(reports)
    if not reps:
        return []
    c = _compare(reps)
    known_host = _known_hosts(reps)
    make = _HangFindings(
        job=job,
        window=window,
        majority=c.majority,
        expected_workers=expected_workers,
        policy=policy,
        tenant=tenant or reps[0].tenant,
        now=now,
        hosts={r.worker: r.host for r in reps},
        known_host=known_host,
        devices={r.worker: r.device for r in reps},
    )
    exits = all(r.reason == "exit" for r in reps)
    where = f"{int(c.counts[c.mode])} of {len(reps)} answering workers wait in {c.majority.describe()}"
    if exits:  # the others' training ended (their collectives failed), not stuck: nobody among them is a culprit
        where = f"{len(reps)} worker(s) of its host closed after it, their training ended at step {int(c.last.max())}"
        c.culprit[:] = False
    out = _place_findings(make, reps, c, where)
    out += _silent_findings(make, reps, c.workers, expected_workers, exits, known_host, where)
    if not out and exits:  # nobody exited before them: nothing to say
        return []
    if not out:  # every worker in one place
        out.append(_all_alike(make, c.workers))
    return out


@dataclass
class _Compared:
    """The answers compared by place: each answer's worker and place (``inverse``, an index into the distinct places;
    ``counts``: answers at each), the majority's place (``mode``, its position ``majority``; ``strict``: more than
    half the answers are there), each answer's last step, and which answers are not where the majority is."""

    workers: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray
    mode: int
    majority: Position
    strict: bool
    last: np.ndarray
    culprit: np.ndarray


def _compare(reps: list[HangReport]) -> _Compared:
    """Where most answers are, and who is not there."""
    workers = np.array([r.worker for r in reps], dtype=np.int64)
    keys = np.array([_key(r) for r in reps], dtype=object)
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    mode = int(np.argmax(counts))
    m = reps[int(np.flatnonzero(inverse == mode)[0])]
    last = np.array([r.last_step for r in reps], dtype=np.int64)
    is_open = np.array([r.collective_open for r in reps], dtype=bool)
    same_coll = np.array(
        [r.collective == m.collective and r.collective_group == m.collective_group for r in reps], dtype=bool
    )
    seq = np.array([r.collective_seq for r in reps], dtype=np.int64)
    # not where the majority is; a worker in the majority's collective at the same or a later call waits too, as does
    # one already past the majority's step
    culprit = inverse != mode
    if m.collective_open:
        culprit &= ~(is_open & same_coll & (seq >= m.collective_seq))
    culprit &= ~(last > m.last_step)
    culprit |= last < m.last_step
    return _Compared(workers, inverse, counts, mode, _position(m), bool(counts[mode] * 2 > len(reps)), last, culprit)


def _known_hosts(reps: list[HangReport]) -> dict[int, str]:
    """The host of every worker an answer names as its host's (``host_workers``), answering or not."""
    known_host: dict[int, str] = {}
    for r in reps:
        for w in r.host_workers:
            known_host.setdefault(w, r.host)
    return known_host


@dataclass(frozen=True)
class _HangFindings:
    """What every finding of one hang window shares: the window, the majority's position (the step it names), the
    policy, and where each worker is (its host and device, from its answer, else from its host's answers)."""

    job: str
    window: str
    majority: Position
    expected_workers: int
    policy: str
    tenant: str
    now: float
    hosts: dict[int, str]  # worker -> the host it answered from
    known_host: dict[int, str]  # worker -> its host, as its host's answers name it
    devices: dict[int, str]

    def finding(
        self, ws: list[int], function: str, kind: str, cause: str, conf: float, summary: str, ev: list[Evidence]
    ) -> Finding:
        """A finding naming workers ``ws`` (the first MAX_NAMED of them; the rest counted in its summary)."""
        named = ws[:MAX_NAMED]
        scope: Literal["worker", "group"] = "worker" if len(ws) == 1 else "group"
        return Finding(
            id=finding_id(self.job, self.window, scope, named, function, cause, None),
            job=self.job,
            window=self.window,
            steps=[max(0, self.majority.last_step + 1)],
            scope=scope,
            workers=named,
            hosts=sorted({self.hosts.get(w) or self.known_host.get(w, "") for w in named} - {""}),
            devices=sorted({self.devices.get(w, "") for w in named} - {""}),
            function=function,
            function_kind=kind,
            cause=cause,
            confidence=conf,
            evidence=ev,
            impact=Impact(step_time_share=1.0, gpu_hours_per_day=24.0 * self.expected_workers),
            policy=self.policy,
            created_at=self.now,
            tenant=self.tenant,
            summary=summary + (f" ({len(ws) - len(named)} more not named)" if len(ws) > len(named) else ""),
            window_steps=1,
        )


def _who(ws: list[int]) -> str:
    return f"worker {ws[0]}" if len(ws) == 1 else f"workers {', '.join(map(str, ws[:8]))}"


def _place_findings(make: _HangFindings, reps: list[HangReport], c: _Compared, where: str) -> list[Finding]:
    """The answering culprits, one finding per distinct position: where each is, against the majority's place."""
    majority = make.majority
    out = []
    for k in np.unique(c.inverse[c.culprit]):
        idx = np.flatnonzero(c.culprit & (c.inverse == k))
        ws = [int(w) for w in c.workers[idx]]
        p = _position(reps[int(idx[0])])
        ev = [
            Evidence(
                feature="last_step", value=float(p.last_step), peer_value=float(majority.last_step), deviation=None
            ),
            Evidence(
                feature="collective_seq",
                value=float(p.collective_seq) if p.collective_open else None,
                peer_value=float(majority.collective_seq) if majority.collective_open else None,
                deviation=None,
            ),
        ]
        out.append(
            make.finding(
                ws,
                p.function or "(unknown place)",
                _kind(p.function, p.collective_open),
                "hang",
                CONFIDENCE_PLACE if c.strict else CONFIDENCE_NO_MAJORITY,
                f"hang: {_who(ws)} is in {p.describe()}; {where}",
                ev,
            )
        )
    return out


def _silent_findings(
    make: _HangFindings,
    reps: list[HangReport],
    workers: np.ndarray,
    expected_workers: int,
    exits: bool,
    known_host: dict[int, str],
    where: str,
) -> list[Finding]:
    """The expected workers that did not answer: their process exited, their host's others answered, or nobody of
    their host did (``exits``: the answers are closing agents', and only their hosts' workers are expected)."""
    answered = set(workers.tolist())
    expected = sorted({w for r in reps for w in r.host_workers} | answered) if exits else list(range(expected_workers))
    silent = [w for w in expected if w not in answered]
    answered_hosts = {r.host for r in reps}
    exited = {w for r in reps for w in r.exited}
    gone = [w for w in silent if w in exited]
    died = [w for w in silent if w not in exited and known_host.get(w) in answered_hosts]
    host_silent = [w for w in silent if w not in exited and w not in died]
    out = []
    for ws, fn, cause, conf, why in (
        (
            gone,
            "(process exited)",
            "worker_died",
            CONFIDENCE_EXITED,
            "did not answer: its process exited (its host's other workers saw it gone)",
        ),
        (
            died,
            "(no answer)",
            "hang",
            CONFIDENCE_SILENT,
            "did not answer while its host's other workers did (stuck in C code that holds the GIL, or its agent is "
            "gone)",
        ),
        (
            host_silent,
            "(no answer)",
            "hang",
            CONFIDENCE_HOST_SILENT,
            "did not answer, nor did any worker known to share its host",
        ),
    ):
        if not ws:
            continue
        ev = [Evidence(feature="answered", value=0.0, peer_value=float(len(reps)), deviation=None)]
        out.append(make.finding(ws, fn, "other", cause, conf, f"{cause}: {_who(ws)} {why}; {where}", ev))
    return out


def _all_alike(make: _HangFindings, workers: np.ndarray) -> Finding:
    """Every worker answered from one place: one job-scope finding says where they all wait."""
    majority = make.majority
    ws = [int(w) for w in workers]
    ev = [Evidence(feature="last_step", value=float(majority.last_step), peer_value=None, deviation=None)]
    f = make.finding(
        ws,
        majority.function or "(unknown place)",
        _kind(majority.function, majority.collective_open),
        "hang",
        CONFIDENCE_ALL_ALIKE,
        f"hang: every answering worker waits in the same place, {majority.describe()}: the cause is below "
        "Python (a device kernel, the network) or outside these workers",
        ev,
    )
    return _job_scope(f, make.job, make.window)


def _job_scope(f: Finding, job: str, window: str) -> Finding:
    f.scope = "job"
    f.id = finding_id(job, window, "job", f.workers, f.function, f.cause, None)
    return f
