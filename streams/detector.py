"""Slowdown detector: the always-on signal decides when to profile (brief 2.4).

Pure: fed heartbeats and the current time, it returns the triggers to publish.
Per job it tracks the synchronised step time (the slowest worker of each
step), compares the median of the most recent steps with a robust baseline (a
low percentile of the earlier steps: the recent best), and fires one
step-aligned window whose start lies far enough ahead for every worker to hear
of it in time: the margin comes from the observed wall-clock step interval and
the control-topic latency.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..schemas.records import ProfileTrigger, Sampling, StepHeartbeat
from .policy import Policy


@dataclass
class _StepAgg:
    slowest_s: float = 0.0
    workers: int = 0
    first_seen: float = 0.0  # wall clock of the processor


@dataclass
class JobState:
    job: str
    tenant: str = ""
    steps: dict[int, _StepAgg] = field(default_factory=dict)  # steps not yet complete
    history: deque = field(default_factory=lambda: deque(maxlen=512))  # (step, synchronised step time s)
    last_step_of: dict[int, int] = field(default_factory=dict)  # worker -> last step seen
    sent_at: dict[int, float] = field(default_factory=dict)  # step -> first worker's sent_at (one host's clock)
    clock_worker: int | None = None
    max_step: int = -1
    first_step: int = -1
    lag_s: deque = field(default_factory=lambda: deque(maxlen=64))  # heartbeat arrival lag, processor clock - worker clock
    last_complete: int = -1
    last_trigger_step: int | None = None  # start step of the last window
    last_trigger_end: int = -1


class SlowdownDetector:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.jobs: dict[str, JobState] = {}
        self.control_latency_s = policy.detector.control_latency_s

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy

    def restore(self, job: str, last_trigger_step: int, last_trigger_end: int) -> None:
        """Carry the cool-down across restarts (from the processor's table)."""
        st = self.jobs.setdefault(job, JobState(job))
        st.last_trigger_step = last_trigger_step
        st.last_trigger_end = last_trigger_end

    def active_workers(self, st: JobState) -> int:
        horizon = st.max_step - 3 * self.policy.detector.recent_steps
        return sum(1 for s in st.last_step_of.values() if s >= horizon)

    def open_windows(self, now_step_by_job: dict[str, int] | None = None) -> int:
        return sum(1 for st in self.jobs.values() if st.last_trigger_end >= st.max_step)

    def observe(self, hb: StepHeartbeat, now: float | None = None) -> list[ProfileTrigger]:
        now = time.time() if now is None else now
        st = self.jobs.get(hb.job)
        if st is None:
            st = self.jobs[hb.job] = JobState(hb.job, tenant=hb.tenant)
        st.last_step_of[hb.worker] = max(hb.step, st.last_step_of.get(hb.worker, -1))
        if hb.step <= st.last_complete:
            return []  # late or replayed heartbeat of a step already judged
        if st.clock_worker is None:
            st.clock_worker = hb.worker
        if hb.worker == st.clock_worker:
            st.sent_at[hb.step] = hb.sent_at
            st.lag_s.append(max(0.0, now - hb.sent_at))
        agg = st.steps.get(hb.step)
        if agg is None:
            agg = st.steps[hb.step] = _StepAgg(first_seen=now)
        agg.slowest_s = max(agg.slowest_s, hb.step_time_s)
        agg.workers += 1
        st.max_step = max(st.max_step, hb.step)
        if st.first_step < 0:
            st.first_step = hb.step
        self._complete_steps(st)
        return self._judge(st, now)

    def _complete_steps(self, st: JobState) -> None:
        # the set of workers is known once the job has run a few steps
        active = self.active_workers(st) if st.max_step >= st.first_step + 2 else None
        for s in sorted(st.steps):
            agg = st.steps[s]
            # complete when every active worker reported, or two later steps have started
            if (active is not None and agg.workers >= active) or s <= st.max_step - 2:
                st.history.append((s, agg.slowest_s))
                st.last_complete = max(st.last_complete, s)
                del st.steps[s]
            else:
                break
        for s in [s for s in st.sent_at if s < st.max_step - 64]:
            del st.sent_at[s]

    def step_interval_s(self, st: JobState) -> float:
        """Wall-clock seconds per step, from one worker's own clock (never across hosts)."""
        steps = sorted(st.sent_at)[-16:]
        if len(steps) < 2:
            return math.nan
        d = np.diff([st.sent_at[s] for s in steps]) / np.diff(steps)
        return float(np.median(d))

    def margin_steps(self, st: JobState) -> int:
        """Steps between the last step seen and the window's start.

        The trigger must reach every worker before it starts the step: allow for
        how far behind the heartbeats we are (the detector's view is that old)
        plus the control topic's latency, twice over, in units of the job's
        wall-clock step interval.  The lag compares two hosts' clocks; NTP's ~10 ms
        error is small against the seconds this margin is about.
        """
        dp = self.policy.detector
        interval = self.step_interval_s(st)
        if not (math.isfinite(interval) and interval > 0):
            return max(dp.min_margin_steps, 5)
        lag = float(np.median(st.lag_s)) if st.lag_s else 0.0
        return max(dp.min_margin_steps, math.ceil(2.0 * (lag + self.control_latency_s) / interval) + 1)

    def _judge(self, st: JobState, now: float) -> list[ProfileTrigger]:
        dp = self.policy.detector
        h = [t for _, t in st.history]
        if len(h) < dp.baseline_steps + dp.recent_steps:
            return []
        if st.last_trigger_step is not None and st.max_step < st.last_trigger_end + dp.cooldown_steps:
            return []
        if self.open_windows() >= dp.max_windows_fleet:
            return []
        earlier = np.asarray(h[: -dp.recent_steps][-4 * dp.baseline_steps :])
        baseline = float(np.percentile(earlier, 25))
        recent = float(np.median(h[-dp.recent_steps :]))  # a median: one hiccup is not a slowdown
        if not recent > baseline * (1.0 + dp.slowdown_threshold):
            return []
        return [self._trigger(st, now, f"slowdown: median of last {dp.recent_steps} steps {recent * 1e3:.1f} ms vs baseline {baseline * 1e3:.1f} ms (+{(recent / baseline - 1) * 100:.0f}%)")]

    def manual(self, job: str, now: float | None = None, reason: str = "manual") -> ProfileTrigger | None:
        st = self.jobs.get(job)
        if st is None or st.max_step < 0:
            return None
        return self._trigger(st, time.time() if now is None else now, reason)

    def _trigger(self, st: JobState, now: float, reason: str) -> ProfileTrigger:
        dp = self.policy.detector
        margin = self.margin_steps(st)
        start = st.max_step + margin
        st.last_trigger_step = start
        st.last_trigger_end = start + dp.window_steps
        return ProfileTrigger(
            job=st.job,
            window=f"w{start}",
            start_step=start,
            steps=dp.window_steps,
            expected_workers=max(1, self.active_workers(st)),
            sampling=Sampling(hardware_hz=dp.hardware_hz),
            policy=self.policy.id,
            policy_hash=self.policy.hash,
            reason=reason,
            created_at=now,
            tenant=st.tenant,
        )
