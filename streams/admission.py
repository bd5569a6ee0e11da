"""Window admission: the policy checks every window passes, automatic or an operator's, and the window it opens.

Pure.  The checks, in order: job selectors, the job's end, windows open per job, cool-down after the last window,
windows open on this processor (the fleet limit); each refusal says why in words.  A window starts far enough ahead
for every worker to hear of it in time (:func:`margin_steps`), queued behind the job's open windows (they never
overlap), and counts as open until the job passes its last step or it expires.  The detector
(:class:`~lockstep.streams.detector.SlowdownDetector`) decides when to ask; this module says yes or no.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from ..schemas.records import ProfileTrigger, RefusalCode, Sampling, TriggerRefused
from .jobstate import JobState, OpenedWindow
from .policy import DetectorPolicy, Policy

#: a window counts as open until the job passes its last step, or at least this long
#: after it was triggered when the job never gets there (a hang, a job that died)
WINDOW_EXPIRY_MIN_S = 60.0


def is_open(st: JobState, w: OpenedWindow, now: float) -> bool:
    return w.end > st.max_step and now < w.expires_at


def refusal(policy: Policy, job: str, code: RefusalCode, reason: str, now: float, request: str = "") -> TriggerRefused:
    return TriggerRefused(
        job=job, request=request or "-", code=code, reason=reason, policy=policy.id, policy_hash=policy.hash, at=now
    )


def refused(
    p: Policy, st: JobState, now: float, kind: str, fleet_open: Callable[[], int], request: str = ""
) -> TriggerRefused | None:
    """The policy's refusal of a window for ``st`` now, or None when every check passes.  ``fleet_open`` counts the
    windows open on this processor (asked only once the job's own checks passed)."""
    dp = p.detector
    if not st.selected:
        j = p.jobs
        return refusal(
            p,
            st.job,
            "excluded",
            f"job {st.job!r} (tenant {st.tenant!r}) is not selected by policy {p.ref} (include {list(j.include)}, exclude {list(j.exclude)}, tenants {list(j.tenants) or 'all'})",
            now,
            request,
        )
    if st.ended:
        return refusal(
            p, st.job, "ended", f"job {st.job!r} ended at step {st.max_step} (final heartbeat)", now, request
        )
    opened, last = _opened_and_last(st, now)
    # a hang's window profiles nothing (its steps never come; the agents answer where they are): a window opened
    # before the job stopped, and the cool-down after one, never hold it back (the job will not reach their ends)
    if kind != "hang" and len(opened) >= dp.max_windows_per_job:
        names = ", ".join(f"{w.name} (steps {w.start}..{w.end - 1})" for w in opened)
        return refusal(
            p,
            st.job,
            "job_limit",
            f"job {st.job!r} already has {len(opened)} window(s) open or scheduled: {names}; policy allows {dp.max_windows_per_job}",
            now,
            request,
        )
    if kind != "hang" and last is not None and st.max_step < last.end + dp.cooldown_steps:
        return refusal(
            p,
            st.job,
            "cooldown",
            f"job {st.job!r} is in cool-down until step {last.end + dp.cooldown_steps} (window {last.name} ended at step {last.end - 1}, cooldown_steps {dp.cooldown_steps}); it is at step {st.max_step}",
            now,
            request,
        )
    n_open = fleet_open()
    if n_open >= dp.max_windows_fleet:
        return refusal(
            p,
            st.job,
            "fleet_limit",
            f"{n_open} windows are open on this processor; policy allows {dp.max_windows_fleet} (max_windows_fleet)",
            now,
            request,
        )
    return None


def _opened_and_last(st: JobState, now: float) -> tuple[list[OpenedWindow], OpenedWindow | None]:
    """The job's windows open or scheduled now, and the one that closed last (None: none closed)."""
    opened = [w for w in st.windows if is_open(st, w, now)]
    closed = [w for w in st.windows if not is_open(st, w, now)]
    return opened, max(closed, key=lambda w: w.end, default=None)


def admit(
    p: Policy,
    st: JobState,
    now: float,
    kind: str,
    reason: str,
    start: int,
    steps: int,
    interval_s: float,
    workers: Callable[[], int],
    request: str = "",
) -> ProfileTrigger:
    """Open a window of ``steps`` steps from ``start`` (or after the job's open windows) for a job that passed
    :func:`refused`: record it in ``st.windows`` (the open ones and the last closed one) and return its trigger.
    ``interval_s``: the job's wall-clock step interval (NaN: unknown); ``workers``: the job's membership."""
    dp = p.detector
    opened, last = _opened_and_last(st, now)
    start = max([start] + [w.end for w in opened])  # queued behind open windows: they never overlap
    expiry = (
        max(WINDOW_EXPIRY_MIN_S, 3.0 * (start + steps - st.max_step) * interval_s)
        if math.isfinite(interval_s)
        else WINDOW_EXPIRY_MIN_S
    )
    expected = max(1, workers())
    window = OpenedWindow(f"w{start}", start, start + steps, now + expiry, expected=expected, kind=kind)
    st.windows = opened + ([last] if last else []) + [window]
    return ProfileTrigger(
        job=st.job,
        window=window.name,
        start_step=start,
        steps=steps,
        expected_workers=expected,
        sampling=Sampling(hardware_hz=dp.hardware_hz, record_shapes=dp.record_shapes, with_stack=dp.with_stack),
        policy=p.id,
        policy_hash=p.hash,
        reason=f"{reason}; starts {start - st.max_step} steps ahead",
        created_at=now,
        tenant=st.tenant,
        kind=kind,  # type: ignore[arg-type]
        request=request,
    )


def control_latency_s(st: JobState, jobs: Iterable[JobState], dp: DetectorPolicy) -> float:
    """The slowest echoed receipt of a trigger among the job's recent windows, else among any
    job's on this processor (``jobs``), else the policy's assumed ``control_latency_s``."""
    seen = list(st.trigger_latency_s.values()) or [v for j in jobs for v in j.trigger_latency_s.values()]
    return max(0.0, max(seen)) if seen else dp.control_latency_s


def margin_steps(dp: DetectorPolicy, interval_s: float, st: JobState, control_latency: Callable[[], float]) -> int:
    """Steps between the last step seen and the window's start.

    The trigger must reach every worker before it starts the step: allow for
    how far behind the heartbeats we are (the detector's view is that old)
    plus the control topic's latency (``control_latency``, asked only when the
    interval is known), twice over, in units of the job's wall-clock step
    interval (``interval_s``).  The lag compares two hosts' clocks; NTP's ~10 ms
    error is small against the seconds this margin is about.  After windows of the
    slowdown watched that every worker refused as ``past`` (the trigger came too late),
    the margin doubles for each (``st.watch.widen``).
    """
    if not (math.isfinite(interval_s) and interval_s > 0):
        return max(dp.min_margin_steps, 5) << st.watch.widen
    lag = float(np.median(st.lag_s)) if st.lag_s else 0.0
    return max(dp.min_margin_steps, math.ceil(2.0 * (lag + control_latency()) / interval_s) + 1) << st.watch.widen


def all_refused(w: OpenedWindow) -> bool:
    """Every worker the window's trigger expects refused it (a window restored from the table expects none known)."""
    return not w.refused and w.expected > 0 and len(w.refusals) >= w.expected
