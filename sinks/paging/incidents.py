"""Incidents: one per real problem, however many windows see it.  Pure: no DuckDB, no HTTP.

A finding belongs to one window (its id is deterministic per window).  A problem
that persists shows up as a new finding in every later window, so paging per
finding would page once per window.  An *incident* groups them: its key is the
finding's identity **without the window**::

    tenant, job, scope, sorted workers, cause, peer-group labels,
    and the function unless the cause is a device's (a throttled GPU slows every
    kernel; which one costs most may change from window to window)

An incident opens with its first finding (``trigger``), takes later findings
(``update``, no new page) and resolves (``resolve``, with its ``resolved_reason``):

- ``window``: a later window of the job closed with enough coverage and without it;
- ``recovered``: the detector saw the job's step time back at its level before the slowdown
  (a ``JobChange`` ``recovered``, :func:`on_job_news`): the incidents first seen from the
  slowdown's onset on;
- ``job_ended``: the job ended (a ``JobChange`` ``ended``: its final heartbeats, or silence
  after one), which stops its GPU-hour clock;
- ``stale``: nothing has seen it for ``stale_after_s``;
- ``manual``: someone resolved it (``lockstep incident resolve``; ``resolved_by`` names them).

Someone can also *acknowledge* an open incident (``lockstep incident ack``, :func:`acknowledge`): it stays open
and keeps taking findings, the routes it paged are told (PagerDuty ``acknowledge``), and it pages no other route.

A finding of the same key after the resolve reopens it as the next
``occurrence``: a new incident id, a new page.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TypedDict

from ...schemas.errors import LockstepError
from ...schemas.records import HARDWARE_CAUSES, Finding


@dataclass(frozen=True)
class IncidentPolicy:
    resolve_min_coverage: float = 0.9  # a window that saw fewer workers cannot clear a problem
    stale_after_s: float = 12 * 3600.0  # resolve what no window has seen for this long


@dataclass(frozen=True)
class Incident:
    id: str  # "<key>-<occurrence>": the PagerDuty dedup_key
    key: str
    occurrence: int
    tenant: str
    job: str
    scope: str
    cause: str
    function: str
    workers: list[int]
    hosts: list[str]
    devices: list[str]
    status: str  # open | resolved
    opened_at: float
    last_seen_at: float
    resolved_at: float | None
    resolved_by: str | None  # the window that cleared it, or "stale"
    resolved_step: int | None  # first step of that window
    first_finding: str
    last_finding: str
    last_step: int  # last step of the job in which it was seen
    windows: int  # findings (windows) of this occurrence
    confidence: float
    step_time_share: float
    gpu_hours_per_day: float
    # --- incidents that end
    first_window: str = ""  # the window of its first finding ...
    first_step: int = 0  # ... and that window's first step in which it was seen
    first_trigger_at: float | None = None  # when that window was triggered (None: no trigger stored)
    resolved_reason: str | None = None  # window | recovered | job_ended | stale
    after_s: float | None = None  # recovered: the job's step time back (the median of the steps the detector judged)
    # --- incidents acknowledged or resolved by hand (``lockstep incident ack|resolve``)
    acked_at: float | None = None  # when someone acknowledged it (it pages no route it has not paged yet) ...
    acked_by: str | None = None  # ... and who; a resolve by hand keeps its person in ``resolved_by``


#: how an incident can end (``Incident.resolved_reason``)
RESOLVED_REASONS = ("window", "recovered", "job_ended", "stale", "manual")


@dataclass(frozen=True)
class Event:
    """A change of an incident; the pager turns ``trigger`` and ``resolve`` into pages."""

    incident_id: str
    tenant: str
    job: str
    action: str  # trigger | update | acknowledge | resolve
    finding_id: str  # the finding that caused it; for a resolve, the incident's last finding
    reason: str  # window id for findings and window resolves, "stale" for time-outs, "recovered", "job_ended";
    # "manual" for an acknowledge or resolve by hand
    occurred_at: float


@dataclass(frozen=True)
class JobNews:
    """What resolving needs of the detector's ``JobChange`` records ``recovered`` and ``ended``."""

    tenant: str
    job: str
    change: str  # recovered | ended
    step: int  # recovered: the last step judged back at its level; ended: the job's last step
    onset_step: int  # recovered: where the slowdown began
    at: float  # the processor's clock
    after_s: float  # the step time back (recovered)


@dataclass(frozen=True)
class ReportedWindow:
    """What resolving needs of a window report."""

    tenant: str
    job: str
    window: str
    start_step: int
    coverage: float
    closed_at: float


def incident_key(f: Finding) -> str:
    parts = [f.tenant, f.job, f.scope, ",".join(map(str, sorted(f.workers))), f.cause]
    if f.group:
        parts.append(",".join(f"{k}={f.group[k]}" for k in sorted(f.group)))
    if f.cause not in HARDWARE_CAUSES:
        parts.append(f.function)
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


def _span(f: Finding) -> tuple[int, int]:
    return (min(f.steps), max(f.steps)) if f.steps else (0, 0)


class _Latest(TypedDict):
    """What an incident takes from its latest finding: when and what saw it last, who and where, what it costs."""

    last_seen_at: float
    last_finding: str
    workers: list[int]
    hosts: list[str]
    devices: list[str]
    function: str
    confidence: float
    step_time_share: float
    gpu_hours_per_day: float


def _latest(f: Finding) -> _Latest:
    return _Latest(
        last_seen_at=f.created_at,
        last_finding=f.id,
        workers=f.workers,
        hosts=f.hosts,
        devices=f.devices,
        function=f.function,
        confidence=f.confidence,
        step_time_share=f.impact.step_time_share,
        gpu_hours_per_day=f.impact.gpu_hours_per_day,
    )


def _resolved(inc: Incident, at: float, by: str, step: int, reason: str, told: str) -> tuple[Incident, Event]:
    """``inc`` resolved at ``at`` from ``step`` on (``resolved_by`` ``by``, ``resolved_reason`` ``reason``), and its
    ``resolve`` event, whose reason is ``told``."""
    done = replace(inc, status="resolved", resolved_at=at, resolved_by=by, resolved_step=step, resolved_reason=reason)
    return done, Event(inc.id, inc.tenant, inc.job, "resolve", inc.last_finding, told, at)


def on_finding(current: Incident | None, f: Finding) -> tuple[Incident, Event | None]:
    """Apply a finding not seen before to the latest occurrence of its key (None: none yet)."""
    first, last = _span(f)
    if current is not None and current.status == "open":
        inc = replace(current, windows=current.windows + 1, last_step=max(current.last_step, last))
        if f.created_at >= current.last_seen_at:  # an older window's finding, arriving late, leaves the latest's
            inc = replace(inc, **_latest(f))
        return inc, Event(inc.id, f.tenant, f.job, "update", f.id, f.window, f.created_at)
    if current is not None and current.resolved_step is not None and first < current.resolved_step:
        return current, None  # an older window's finding, arriving after the problem cleared
    key = incident_key(f)
    occurrence = 1 if current is None else current.occurrence + 1
    inc = Incident(
        id=f"{key}-{occurrence}",
        key=key,
        occurrence=occurrence,
        tenant=f.tenant,
        job=f.job,
        scope=f.scope,
        cause=f.cause,
        status="open",
        opened_at=f.created_at,
        resolved_at=None,
        resolved_by=None,
        resolved_step=None,
        first_finding=f.id,
        last_step=last,
        windows=1,
        first_window=f.window,
        first_step=first,
        **_latest(f),
    )
    return inc, Event(inc.id, f.tenant, f.job, "trigger", f.id, f.window, f.created_at)


def on_window(
    open_incidents: list[Incident], w: ReportedWindow, policy: IncidentPolicy
) -> list[tuple[Incident, Event]]:
    """A window of the job closed and every one of its findings is applied: resolve what it did not see."""
    if w.coverage < policy.resolve_min_coverage:
        return []
    out = []
    for inc in open_incidents:
        if inc.status == "open" and inc.tenant == w.tenant and inc.job == w.job and inc.last_step < w.start_step:
            out.append(_resolved(inc, w.closed_at, w.window, w.start_step, "window", told=w.window))
    return out


def on_clock(open_incidents: list[Incident], now: float, policy: IncidentPolicy) -> list[tuple[Incident, Event]]:
    """Resolve incidents that no window has seen for ``stale_after_s``."""
    out = []
    for inc in open_incidents:
        if inc.status == "open" and now - inc.last_seen_at >= policy.stale_after_s:
            out.append(_resolved(inc, now, "stale", inc.last_step + 1, "stale", told="stale"))
    return out


def applies(inc: Incident, news: JobNews) -> bool:
    """Whether the detector's news ends this incident.

    Both concern the incidents the job showed up to then: their first window was triggered before the news (when the
    trigger is stored; else their first step is not after the news's step), so that a later run of a job of the same
    name, or a later fault, is not resolved by an earlier end or recovery.  A recovery ends only the incidents first
    seen from the slowdown's onset on: one seen before it was part of the level the job went back to.
    """
    if inc.status != "open" or inc.tenant != news.tenant or inc.job != news.job:
        return False
    before = inc.first_trigger_at <= news.at if inc.first_trigger_at is not None else inc.first_step <= news.step
    if news.change == "ended":
        return before
    return news.change == "recovered" and before and news.onset_step <= inc.first_step


def on_job_news(open_incidents: list[Incident], news: list[JobNews]) -> list[tuple[Incident, Event]]:
    """Resolve the open incidents that a job's end (``job_ended``) or recovery (``recovered``) ends; the earliest news
    that applies resolves each.  Pure; applying the same news again changes nothing (the incidents are resolved)."""
    out = []
    ordered = sorted(news, key=lambda n: (n.at, n.step))
    for inc in open_incidents:
        n = next((n for n in ordered if applies(inc, n)), None)
        if n is None:
            continue
        reason = "job_ended" if n.change == "ended" else "recovered"
        done, ev = _resolved(inc, n.at, reason, n.step + 1, reason, told=reason)
        out.append((replace(done, after_s=n.after_s if n.change == "recovered" else None), ev))
    return out


class IncidentStateError(LockstepError, ValueError):
    """What someone asked of an incident does not apply to it now (acknowledging a resolved one)."""


def acknowledge(inc: Incident, by: str, now: float) -> tuple[Incident, Event | None]:
    """Someone acknowledged an open incident: who and when are kept; acknowledging it again changes nothing
    (no event).  A resolved incident cannot be acknowledged (:class:`IncidentStateError`)."""
    if inc.status != "open":
        raise IncidentStateError(f"incident {inc.id} is resolved ({inc.resolved_reason}); nothing to acknowledge")
    if inc.acked_at is not None:
        return inc, None
    done = replace(inc, acked_at=now, acked_by=by)
    return done, Event(inc.id, inc.tenant, inc.job, "acknowledge", inc.last_finding, "manual", now)


def resolve_by_hand(inc: Incident, by: str, now: float) -> tuple[Incident, Event | None]:
    """Someone resolved an open incident: it ends now (``resolved_reason`` ``manual``, ``resolved_by`` the person);
    a later finding of its key opens the next occurrence.  Resolving a resolved incident changes nothing."""
    if inc.status != "open":
        return inc, None
    return _resolved(inc, now, by, inc.last_step + 1, "manual", told="manual")
