"""Slowdown and hang detector: the always-on signal decides when to profile (brief 2.4).

Pure: fed heartbeats, ticks, operator requests and the current time, it returns
the triggers (and refusals) to publish; the faust agent around it does the I/O.

- **Slowdown.** Per job the synchronised step time (the slowest worker of each
  step); when a step completes, the median of the most recent steps is compared
  with a robust baseline (a low percentile of the earlier steps: the recent best).
- **Hang.** No progress for ``hang_factor`` usual step intervals (and at least
  ``hang_min_s``).  No heartbeat arrives during a hang, so the processor's timer
  asks for a check (:meth:`SlowdownDetector.due_ticks`, then :meth:`tick` inside
  the stream).  The window starts at the first step no worker can have begun.
- **Baseline.** A healthy job is profiled ``baseline_every_steps`` after its last
  window (or after the detector first saw it): the job's own healthy past, which
  job-wide regressions are judged against.
- **Operators** ask for a window (:meth:`request`) and get it or a refusal.

Every window passes the same policy checks: job selectors, windows open per job,
cool-down after the last window, windows open on this processor (the fleet limit).
A window starts far enough ahead for every worker to hear of it in time: the
margin comes from the job's wall-clock step interval, the heartbeat lag and the
control topic's latency (measured from agents' echoes, else the policy's value).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from ..schemas.records import AgentCounters, ProfileTrigger, RecordError, Sampling, StepHeartbeat, TriggerRefused, TriggerRequest
from .policy import Policy

#: a window counts as open until the job passes its last step, or at least this long
#: after it was triggered when the job never gets there (a hang, a job that died)
WINDOW_EXPIRY_MIN_S = 60.0
#: a job silent this long is forgotten (its cool-down stays in the processor's table)
FORGET_AFTER_S = 3600.0
#: a new heartbeat this many steps behind the job is a restart (from a checkpoint), not a late record
RESTART_STEPS = 16
#: echoed control latencies kept per job (one value per window: the slowest worker's)
LATENCY_WINDOWS = 8
#: an echo above this is a broken clock or a stale replay, not the control topic's latency
LATENCY_MAX_S = 60.0
#: a heartbeat more steps than this beyond the job's highest step (plus what its pace allows since it was
#: last heard) is from the future: a forged or corrupted record, not progress
FUTURE_STEPS = 1000
#: ... the pace allowance: this many times the job's own wall-clock step rate
FUTURE_PACE = 10.0
#: a heartbeat whose clock is more than this ahead of the processor's is from a broken clock
FUTURE_CLOCK_S = 86_400.0


@dataclass
class _StepAgg:
    slowest_s: float = 0.0
    workers: set[int] = field(default_factory=set)


@dataclass
class Window:
    name: str
    start: int
    end: int  # first step after the window
    expires_at: float  # processor clock


@dataclass
class JobState:
    job: str
    tenant: str = ""
    selected: bool = True  # by the policy's job selectors
    steps: dict[int, _StepAgg] = field(default_factory=dict)  # steps not yet complete
    history: deque = field(default_factory=lambda: deque(maxlen=512))  # synchronised step times (s) of complete steps
    counts: deque = field(default_factory=lambda: deque(maxlen=16))  # workers of recent complete steps
    expected: int = 0  # workers a step waits for before it is complete (most of recent steps)
    last_step_of: dict[int, int] = field(default_factory=dict)  # worker -> last step seen
    sent_at: dict[int, float] = field(default_factory=dict)  # step -> clock worker's sent_at (one host's clock)
    clock_worker: int | None = None
    newest_sent_at: float = 0.0
    max_step: int = -1
    first_step: int = -1  # the first step judged: a job that never had a window counts from here
    baseline_after: int = -1  # no baseline window is asked for before this step (backs off after a refusal)
    last_complete: int = -1
    lag_s: deque = field(default_factory=lambda: deque(maxlen=64))  # heartbeat arrival lag, processor clock - worker clock
    last_progress_at: float = 0.0  # processor clock when max_step last advanced
    last_seen_at: float = 0.0
    ended: bool = False  # a worker sent its final heartbeat and nothing progressed since
    hang_step: int = -1  # max_step at which a hang window was triggered
    tick_at: float = 0.0  # last hang check requested
    windows: list[Window] = field(default_factory=list)  # open ones and the last closed one
    trigger_latency_s: dict[str, float] = field(default_factory=dict)  # window -> slowest echoed receipt
    agents: dict[int, AgentCounters] = field(default_factory=dict)  # worker -> its agent's last counters (sent on change)


class SlowdownDetector:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.jobs: dict[str, JobState] = {}
        self.suppressed: Counter = Counter()  # automatic windows not opened, by refusal code

    # ------------------------------------------------------------------ state

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        for st in self.jobs.values():
            st.selected = policy.jobs.matches(st.job, st.tenant)

    def _job(self, job: str, tenant: str, now: float) -> JobState:
        st = self.jobs.get(job)
        if st is None:
            st = self.jobs[job] = JobState(job, tenant=tenant, selected=self.policy.jobs.matches(job, tenant), last_progress_at=now)
        return st

    def restore(self, job: str, last_trigger_step: int, last_trigger_end: int, now: float | None = None) -> None:
        """Carry the last window (cool-down, open window) across restarts (from the processor's table)."""
        now = time.time() if now is None else now
        st = self._job(job, "", now)
        st.windows = [Window(f"w{last_trigger_step}", last_trigger_step, last_trigger_end, now + WINDOW_EXPIRY_MIN_S)]

    def drop(self, jobs) -> None:
        """Partitions revoked: their jobs now belong to another processor."""
        for job in jobs:
            self.jobs.pop(job, None)

    def agent_counters(self) -> dict[str, AgentCounters]:
        """Per job, its agents' counters summed over the workers that reported any (agents send them on change)."""
        fields = AgentCounters.__struct_fields__
        return {
            job: AgentCounters(**{f: sum(getattr(c, f) for c in st.agents.values()) for f in fields})
            for job, st in self.jobs.items()
            if st.agents
        }

    def forget_idle(self, now: float) -> list[str]:
        gone = [j for j, st in self.jobs.items() if now - st.last_seen_at > FORGET_AFTER_S]
        self.drop(gone)
        return gone

    # ------------------------------------------------------------------ heartbeats

    def observe(self, hb: StepHeartbeat, now: float | None = None) -> list[ProfileTrigger]:
        """Raises RecordError('from_the_future') for a heartbeat no real worker of the job can have sent."""
        now = time.time() if now is None else now
        self._plausible(hb, now)
        st = self._job(hb.job, hb.tenant, now)
        if hb.tenant != st.tenant:  # e.g. a job restored from the table before its first heartbeat
            st.tenant, st.selected = hb.tenant, self.policy.jobs.matches(hb.job, hb.tenant)
        if hb.step < st.last_complete - RESTART_STEPS and hb.sent_at > st.newest_sent_at:
            # far behind yet newer than anything seen: the job restarted (from a checkpoint)
            st = self.jobs[hb.job] = JobState(hb.job, tenant=st.tenant, selected=st.selected, last_progress_at=now)
        st.last_seen_at = now
        st.newest_sent_at = max(st.newest_sent_at, hb.sent_at)
        if hb.trigger_window and isinstance(hb.trigger_latency_s, float):  # an agent's echo of a trigger
            self._echo(st, hb.trigger_window, hb.trigger_latency_s)
        st.last_step_of[hb.worker] = max(hb.step, st.last_step_of.get(hb.worker, -1))
        if hb.agent:  # UNSET (absent) is falsy
            st.agents[hb.worker] = hb.agent
        if hb.final:
            st.ended = True
            return []
        if hb.step <= st.last_complete:
            return []  # late or replayed heartbeat of a step already judged
        if hb.step > st.max_step:
            st.max_step = hb.step
            st.last_progress_at = now
            st.ended = False
        if st.clock_worker is None:
            st.clock_worker = hb.worker
        if hb.worker == st.clock_worker:
            st.sent_at[hb.step] = hb.sent_at
            st.lag_s.append(max(0.0, now - hb.sent_at))
        agg = st.steps.get(hb.step)
        if agg is None:
            agg = st.steps[hb.step] = _StepAgg()
        agg.slowest_s = max(agg.slowest_s, hb.step_time_s)
        agg.workers.add(hb.worker)
        if not self._complete_steps(st):
            return []
        return self._judge(st, now)

    def _plausible(self, hb: StepHeartbeat, now: float) -> None:
        """Steps and clocks from the future poison a job's state (a step 10^9 ahead would schedule its
        windows at steps never reached and complete every real step early; a sent_at years ahead would
        hide every later restart), so such heartbeats are refused before they touch it."""
        if hb.sent_at > now + FUTURE_CLOCK_S:
            raise RecordError("from_the_future", f"sent_at is {(hb.sent_at - now) / 3600:.0f} h ahead of the processor's clock "
                              f"(at most {FUTURE_CLOCK_S / 3600:.0f} h): the clock of host {hb.host!r} is broken")  # fmt: skip
        st = self.jobs.get(hb.job)
        if st is None or st.max_step < 0 or hb.step <= st.max_step + FUTURE_STEPS:
            return  # nothing shown yet (any step can be the job's), or near enough
        interval = self.step_interval_s(st)
        pace = FUTURE_PACE * (now - st.last_seen_at) / interval if math.isfinite(interval) and interval > 0 else 0.0
        allowed = FUTURE_STEPS + pace
        if hb.step > st.max_step + allowed:
            raise RecordError("from_the_future", f"step {hb.step} of job {hb.job!r} (worker {hb.worker}) is {hb.step - st.max_step} steps "
                              f"beyond the highest it has shown ({st.max_step}); at most {allowed:.0f} are plausible")  # fmt: skip

    def _echo(self, st: JobState, window: str, latency_s: float) -> None:
        if latency_s > LATENCY_MAX_S:
            return
        lat = st.trigger_latency_s
        lat[window] = max(lat.get(window, 0.0), latency_s)  # below 0: clock skew; counts as 0
        while len(lat) > LATENCY_WINDOWS:
            del lat[next(iter(lat))]

    def _complete_steps(self, st: JobState) -> bool:
        """Move complete steps to the history; True if any completed."""
        done = False
        for s in sorted(st.steps):
            agg = st.steps[s]
            # complete when as many workers reported as in recent steps, or two later steps have started
            if (st.expected and len(agg.workers) >= st.expected) or s <= st.max_step - 2:
                st.history.append(agg.slowest_s)
                st.counts.append(len(agg.workers))
                st.expected = max(st.counts)
                st.last_complete = max(st.last_complete, s)
                if st.first_step < 0:
                    st.first_step = s
                del st.steps[s]
                done = True
            else:
                break
        if done:
            for s in [s for s in st.sent_at if s < st.max_step - 64]:
                del st.sent_at[s]
        return done

    def _judge(self, st: JobState, now: float) -> list[ProfileTrigger]:
        dp = self.policy.detector
        if not st.selected or len(st.history) < dp.baseline_steps + dp.recent_steps:
            return []
        h = list(st.history)
        earlier = np.asarray(h[: -dp.recent_steps][-4 * dp.baseline_steps :])
        baseline = float(np.percentile(earlier, 25))
        recent = float(np.median(h[-dp.recent_steps :]))  # a median: one hiccup is not a slowdown
        if not recent > baseline * (1.0 + dp.slowdown_threshold):
            return self._baseline(st, now)
        reason = f"slowdown: median of last {dp.recent_steps} steps {recent * 1e3:.1f} ms vs baseline {baseline * 1e3:.1f} ms (+{(recent / baseline - 1) * 100:.0f}%)"
        return self._automatic(st, now, "slowdown", reason, st.max_step + self.margin_steps(st))

    def _baseline(self, st: JobState, now: float) -> list[ProfileTrigger]:
        """A healthy job is profiled now and then, so that the window stage has the job's own healthy past
        to compare with (a job-wide regression has no outlier, and one present from the job's start never
        looks like a slowdown).  Not counted when refused, but tried again only a tenth of the interval later:
        with the fleet limit reached, thousands of due jobs would otherwise each check it at every step."""
        every = self.policy.detector.baseline_every_steps
        since = max((w.end for w in st.windows), default=st.first_step)
        if every <= 0 or st.max_step - since < every or st.max_step < st.baseline_after:
            return []
        reason = f"baseline: {st.max_step - since} steps since " + ("the last window" if st.windows else "the detector first saw the job")
        decision = self._decide(st, now, "baseline", reason, st.max_step + self.margin_steps(st), self.policy.detector.window_steps)
        if isinstance(decision, ProfileTrigger):
            return [decision]
        st.baseline_after = st.max_step + max(1, every // 10)
        return []

    def _automatic(self, st: JobState, now: float, kind: str, reason: str, start: int) -> list[ProfileTrigger]:
        decision = self._decide(st, now, kind, reason, start, self.policy.detector.window_steps)
        if isinstance(decision, TriggerRefused):
            self.suppressed[decision.code] += 1
            return []
        return [decision]

    # ------------------------------------------------------------------ hangs

    def step_interval_s(self, st: JobState) -> float:
        """Wall-clock seconds per step, from one worker's own clock (never across hosts)."""
        steps = sorted(st.sent_at)[-16:]
        if len(steps) < 2:
            return math.nan
        d = np.diff([st.sent_at[s] for s in steps]) / np.diff(steps)
        return float(np.median(d))

    def hang_after_s(self, st: JobState) -> float:
        """Silence after which the job is hung; NaN while its step interval is unknown."""
        dp = self.policy.detector
        interval = self.step_interval_s(st)
        return max(dp.hang_min_s, dp.hang_factor * interval) if math.isfinite(interval) else math.nan

    def _stalled(self, st: JobState, now: float) -> bool:
        if not st.selected or st.ended or st.hang_step == st.max_step:
            return False
        after = self.hang_after_s(st)
        return math.isfinite(after) and now - st.last_progress_at >= after

    def due_ticks(self, now: float) -> list[str]:
        """Jobs that look hung: the caller sends each a tick into its partition (then :meth:`tick`).

        At most one tick per job per hang interval, so a refused hang window is retried.
        """
        due = []
        for job, st in self.jobs.items():
            if self._stalled(st, now) and now - st.tick_at >= self.hang_after_s(st):
                st.tick_at = now
                due.append(job)
        return due

    def tick(self, job: str, now: float | None = None) -> list[ProfileTrigger]:
        """Check a job for a hang (inside the stream, in order with its heartbeats)."""
        now = time.time() if now is None else now
        st = self.jobs.get(job)
        if st is None or not self._stalled(st, now):
            return []
        dp = self.policy.detector
        silent = now - st.last_progress_at
        behind = np.fromiter((w for w, s in st.last_step_of.items() if s < st.max_step), dtype=np.int64)
        behind.sort()
        who = f"; {behind.size} worker(s) behind step {st.max_step}: {', '.join(map(str, behind[:8]))}{', ...' if behind.size > 8 else ''}" if behind.size else ""
        reason = f"hang: no progress for {silent:.1f} s ({silent / self.step_interval_s(st):.0f}x the usual step interval) after step {st.max_step}{who}"
        # workers may be inside max_step + 1 already: start at the first step none can have begun
        out = self._automatic(st, now, "hang", reason, st.max_step + max(2, dp.min_margin_steps))
        if out:
            st.hang_step = st.max_step
        return out

    # ------------------------------------------------------------------ operators

    def request(self, req: TriggerRequest, now: float | None = None) -> ProfileTrigger | TriggerRefused:
        """An operator's window: the same checks as the automatic ones, and an answer either way."""
        now = time.time() if now is None else now
        dp = self.policy.detector
        st = self.jobs.get(req.job)
        if st is None or st.max_step < 0:
            return self._refuse(req.job, "unknown_job", f"no heartbeats of job {req.job!r} have reached the detector (unknown job, or not started)", now, req.request)
        steps = req.steps or dp.window_steps
        if steps > dp.max_window_steps:
            return self._refuse(st.job, "too_long", f"{steps} steps exceed the policy's max_window_steps ({dp.max_window_steps})", now, req.request)
        reason = "manual" + (f": {req.reason}" if req.reason else "") + (f" (by {req.requested_by})" if req.requested_by else "")
        return self._decide(st, now, "manual", reason, st.max_step + self.margin_steps(st), steps, req.request)

    # ------------------------------------------------------------------ policy checks

    def is_open(self, st: JobState, w: Window, now: float) -> bool:
        return w.end > st.max_step and now < w.expires_at

    def open_windows(self, now: float) -> int:
        """Windows open or scheduled on this processor (the fleet limit counts them)."""
        return sum(self.is_open(st, w, now) for st in self.jobs.values() for w in st.windows)

    def _refuse(self, job: str, code: str, reason: str, now: float, request: str = "") -> TriggerRefused:
        p = self.policy
        return TriggerRefused(job=job, request=request or "-", code=code, reason=reason, policy=p.id, policy_hash=p.hash, at=now)  # type: ignore[arg-type]

    def _decide(self, st: JobState, now: float, kind: str, reason: str, start: int, steps: int, request: str = "") -> ProfileTrigger | TriggerRefused:
        p, dp = self.policy, self.policy.detector
        if not st.selected:
            j = p.jobs
            return self._refuse(st.job, "excluded", f"job {st.job!r} (tenant {st.tenant!r}) is not selected by policy {p.ref} (include {list(j.include)}, exclude {list(j.exclude)}, tenants {list(j.tenants) or 'all'})", now, request)
        if st.ended:
            return self._refuse(st.job, "ended", f"job {st.job!r} ended at step {st.max_step} (final heartbeat)", now, request)
        is_open = [w for w in st.windows if self.is_open(st, w, now)]
        closed = [w for w in st.windows if not self.is_open(st, w, now)]
        if len(is_open) >= dp.max_windows_per_job:
            names = ", ".join(f"{w.name} (steps {w.start}..{w.end - 1})" for w in is_open)
            return self._refuse(st.job, "job_limit", f"job {st.job!r} already has {len(is_open)} window(s) open or scheduled: {names}; policy allows {dp.max_windows_per_job}", now, request)
        last = max(closed, key=lambda w: w.end, default=None)
        if last is not None and st.max_step < last.end + dp.cooldown_steps:
            return self._refuse(st.job, "cooldown", f"job {st.job!r} is in cool-down until step {last.end + dp.cooldown_steps} (window {last.name} ended at step {last.end - 1}, cooldown_steps {dp.cooldown_steps}); it is at step {st.max_step}", now, request)
        n_open = self.open_windows(now)
        if n_open >= dp.max_windows_fleet:
            return self._refuse(st.job, "fleet_limit", f"{n_open} windows are open on this processor; policy allows {dp.max_windows_fleet} (max_windows_fleet)", now, request)
        start = max([start] + [w.end for w in is_open])  # queued behind open windows: they never overlap
        interval = self.step_interval_s(st)
        expiry = max(WINDOW_EXPIRY_MIN_S, 3.0 * (start + steps - st.max_step) * interval) if math.isfinite(interval) else WINDOW_EXPIRY_MIN_S
        window = Window(f"w{start}", start, start + steps, now + expiry)
        st.windows = is_open + ([last] if last else []) + [window]
        return ProfileTrigger(
            job=st.job,
            window=window.name,
            start_step=start,
            steps=steps,
            expected_workers=max(1, self.active_workers(st)),
            sampling=Sampling(hardware_hz=dp.hardware_hz, record_shapes=dp.record_shapes, with_stack=dp.with_stack),
            policy=p.id,
            policy_hash=p.hash,
            reason=f"{reason}; starts {start - st.max_step} steps ahead",
            created_at=now,
            tenant=st.tenant,
            kind=kind,  # type: ignore[arg-type]
            request=request,
        )

    # ------------------------------------------------------------------ margin

    def active_workers(self, st: JobState) -> int:
        """Workers heard from recently: what a window's coverage is measured against."""
        horizon = st.max_step - 3 * self.policy.detector.recent_steps
        return int(np.count_nonzero(np.fromiter(st.last_step_of.values(), dtype=np.int64, count=len(st.last_step_of)) >= horizon))

    def control_latency_s(self, st: JobState) -> float:
        """The slowest echoed receipt of a trigger among the job's recent windows, else among any
        job's on this processor, else the policy's assumed ``control_latency_s``."""
        seen = list(st.trigger_latency_s.values()) or [v for j in self.jobs.values() for v in j.trigger_latency_s.values()]
        return max(0.0, max(seen)) if seen else self.policy.detector.control_latency_s

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
        return max(dp.min_margin_steps, math.ceil(2.0 * (lag + self.control_latency_s(st)) / interval) + 1)
