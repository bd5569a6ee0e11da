"""Change detection on one job's synchronised step times: the cusum rule (:class:`StepTimeChange`, policy
``rule: cusum``) with its onset and periodic steps, and the older median rule (:func:`median_rule`).

Pure: fed each complete step's time, it says when the job slowed down (an :class:`Alarm`); the detector
(:mod:`~lockstep.streams.detector`) decides what to do about it.
"""

from __future__ import annotations

import bisect
import functools
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from .policy import DetectorPolicy

#: the cusum rule's baseline (median and spread) is recomputed every this many steps once it is full
REFRESH_STEPS = 8
#: an alarm's size is the median of the excursion's last this many steps (at least recent_steps): the level now,
#: not that of a long excursion too small to matter that a slowdown came on top of
LEVEL_STEPS = 50
#: the reference's autocorrelation is also read robustly from this many steps on
AUTOCORR_STEPS = 100
#: a step this many spreads above the baseline is a spike (a candidate periodic step) ...
SPIKE_SPREADS = 4.0
#: ... and this many spikes are remembered to recognise periodic ones
SPIKE_MEMORY = 32
#: log step times the cusum rule keeps per job (at least; the reference and the current excursion must fit)
LOG_STEPS = 2048
_NORMAL = NormalDist()


@functools.lru_cache(maxsize=8192)
def _normal_score(twice_rank: int, n: int) -> float:
    """The normal score of a value with ``twice_rank / 2`` of ``n`` reference values below it (ties count half)."""
    return _NORMAL.inv_cdf((0.5 * twice_rank + 0.5) / (n + 1))


def median_sorted(v: Sequence[float] | npt.NDArray[np.float64]) -> float:
    m = len(v) // 2
    return float(v[m] if len(v) % 2 else 0.5 * (v[m - 1] + v[m]))


def _np_median(a: np.ndarray) -> float:
    """np.median without its overhead (a few hundred values, no NaN)."""
    m = a.size // 2
    if a.size % 2:
        return float(np.partition(a, m)[m])
    p = np.partition(a, (m - 1, m))
    return 0.5 * float(p[m - 1] + p[m])


@dataclass
class Alarm:
    """A sustained slowdown the cusum rule found: since ``since_step``, ``level_s`` against ``baseline_s``."""

    excursion: int  # which excursion of the evidence it is (the index of its first step)
    since_step: int  # where the slowdown began (the step after the excursion's lowest evidence)
    steps: int  # steps judged since
    level_s: float  # the median step time of the last LEVEL_STEPS of them
    baseline_s: float
    spread: float  # the job's step-to-step spread (robust sd of log step time)
    evidence: float  # the CUSUM, in spreads

    @property
    def shift(self) -> float:
        return self.level_s / self.baseline_s - 1.0


class StepTimeChange:
    """The cusum rule on one job's synchronised step times (pure; O(1) per step, amortised).

    **Baseline.** A reference of up to ``reference_steps`` earlier steps, ending where the
    current excursion began (below): its median log step time is the baseline, 1.4826 x the
    MAD the job's step-to-step spread.  Recomputed every :data:`REFRESH_STEPS` steps.

    **Score.** Each step's place in the reference, as a normal score: ``Phi^-1`` of its rank
    (ties halved) among the reference's steps.  On a Gaussian job this is the step's excess in
    spreads; on a skewed one (the slowest of many workers, mixture-of-experts routing, variable
    sequence lengths) it is still centred and of unit spread, where a z-score would drift up with
    the skew.  A step beyond every reference step scores about 2.5 (80 steps) to 2.9 (400): one
    hiccup adds little.  On a job whose spread is below ``spread_floor`` the score is the excess
    over the floor instead.  Scores are capped at ``step_cap`` and divided by
    ``sqrt((1 + r) / (1 - r))``, r the reference's lag-1 autocorrelation (0..0.9; see :meth:`_refresh`): correlated noise has wider sums, and the CUSUM is a sum.

    **Evidence.** ``S = max(0, S + score - k)``, ``k`` = ``cusum_k`` + 2/sqrt(reference size) (the
    reference's own uncertainty): noise drifts it down, a shift of more than ``k`` spreads up.
    The steps since ``S`` last was 0 (the excursion) never enter the reference, so a slowdown
    does not become its own baseline while the evidence builds.  An alarm needs ``S >= cusum_h``,
    and the median of the last :data:`LEVEL_STEPS` (at least ``recent_steps``) steps since the
    change began ``slowdown_threshold`` above the baseline; the change began where the mean of
    the excursion rises most (:meth:`_onset`: an excursion can start with noise).  An excursion that stays below that size for
    longer than the reference becomes the new normal (drift); so does a slowdown a window was
    opened for, once its cool-down is over (:meth:`~lockstep.streams.detector.SlowdownDetector._judge`; unless it got worse).
    An excursion whose evidence reached the alarm and fell back to 0 (a slowdown that ended on its
    own) is forgotten: it never enters the reference.

    **Periodic steps.** A step :data:`SPIKE_SPREADS` spreads above the baseline is a spike; a spike with two earlier
    ones ``P`` and ``2P`` steps back (``P >= periodic_min_gap``) and few other spikes in between (a quarter of the steps)
    (so not a sustained slowdown) is a periodic step (a checkpoint, an evaluation) and is ignored.
    """

    __slots__ = (
        "cached_hi",
        "ignored",
        "inflation",
        "log",
        "mu",
        "n",
        "peak",
        "raw_sigma",
        "ref",
        "ref_from",
        "s",
        "sigma",
        "spikes",
        "start",
        "steps",
    )

    def __init__(self) -> None:
        self.log = array(
            "d"
        )  # log step times of the steps judged, oldest first (trimmed to LOG_STEPS..2 x LOG_STEPS) ...
        self.steps = array("q")  # ... and their step numbers
        self.n = 0  # steps appended so far: log[i] is step index n - len(log) + i
        self.ref_from = 0  # the reference starts at this index at the earliest (after a change was accepted)
        self.s = 0.0  # the evidence (CUSUM), in spreads
        self.start = 0  # index of the first step of the current excursion (valid while s > 0) ...
        self.peak = 0.0  # ... and its highest evidence
        self.mu = math.nan  # baseline: median log step time of the reference
        self.sigma = math.nan  # spread: robust sd of log step time of the reference (at least spread_floor) ...
        self.raw_sigma = 0.0  # ... and as measured
        self.inflation = 1.0  # sqrt((1 + r) / (1 - r)) for the reference's lag-1 autocorrelation r
        self.ref: list[float] = []  # the reference, sorted
        self.cached_hi = -1  # the reference's end when it was last computed
        self.spikes: deque[int] = deque(maxlen=SPIKE_MEMORY)  # step numbers of recent spikes
        self.ignored = 0  # periodic steps ignored

    def _window(self, lo: int, hi: int) -> array[float]:
        base = self.n - len(self.log)
        return self.log[lo - base : hi - base]

    def _append(self, step: int, x: float) -> None:
        log = self.log
        log.append(x)
        self.steps.append(step)
        self.n += 1
        if len(log) >= 2 * LOG_STEPS:
            del log[: len(log) - LOG_STEPS]
            del self.steps[: len(self.steps) - LOG_STEPS]

    def reference(self, dp: DetectorPolicy) -> tuple[int, int]:
        """Index range of the reference: up to ``reference_steps`` steps before the current excursion."""
        hi = self.start if self.s > 0 else self.n
        return max(self.ref_from, hi - dp.reference_steps, self.n - len(self.log)), hi

    def _refresh(self, lo: int, hi: int, dp: DetectorPolicy) -> None:
        window = np.frombuffer(self._window(lo, hi), dtype=np.float64)
        ref = np.sort(window)
        mu = self.mu = median_sorted(ref)
        self.raw_sigma = 1.4826 * _np_median(np.abs(window - mu))
        self.sigma = max(self.raw_sigma, dp.spread_floor)
        # lag-1 autocorrelation: the correlation of successive steps (hiccups clipped) less its standard error, or
        # from AUTOCORR_STEPS steps on, if higher, the robust reading (step-to-step differences spread sqrt(2 (1 - r))
        # times the steps), which heavy tails and slow wander do not hide; on 30 independent steps it exceeds 0.5
        # one time in 15
        r = 0.0
        if self.raw_sigma >= dp.spread_floor:  # (below the floor steps are scored against it: no spread to correlate)
            w = np.clip(window, mu - 3.0 * self.sigma, mu + 3.0 * self.sigma)
            w = w - w.mean()
            r = float(w[1:] @ w[:-1]) / float(w @ w) - 1.0 / math.sqrt(window.size)
            if window.size >= AUTOCORR_STEPS:
                d = np.diff(window)
                r = max(r, 1.0 - 0.5 * (1.4826 * _np_median(np.abs(d - _np_median(d))) / self.raw_sigma) ** 2)
            r = min(max(r, 0.0), 0.9)
        self.inflation = math.sqrt((1.0 + r) / (1.0 - r))
        self.ref = ref.tolist()
        self.cached_hi = hi

    def _score(self, x: float, dp: DetectorPolicy) -> float:
        if self.raw_sigma < dp.spread_floor:
            z = (x - self.mu) / dp.spread_floor
        else:
            ref = self.ref
            z = _normal_score(bisect.bisect_left(ref, x) + bisect.bisect_right(ref, x), len(ref))
        return float(max(-dp.step_cap, min(z, dp.step_cap)) / self.inflation)

    def _periodic(self, step: int, min_gap: int) -> bool:
        spikes = self.spikes  # ascending step numbers
        m = len(spikes)
        for i, q in enumerate(spikes):
            gap = step - q
            if gap < min_gap:
                break
            # spikes at step - gap and step - 2 gap, and few others since (a quarter of the steps at most): a
            # pattern, not a sustained slowdown
            if m - i - 1 > (gap - 1) // 4:
                continue
            try:
                j = spikes.index(q - gap)
            except ValueError:
                continue
            if m - j - 2 <= (2 * gap - 2) // 4:
                return True
        return False

    def update(self, step: int, step_time_s: float, dp: DetectorPolicy) -> Alarm | None:
        """Judge one completed step; an :class:`Alarm` while a slowdown worth a window is seen."""
        x = math.log(max(step_time_s, 1e-9))
        lo, hi = self.reference(dp)
        if hi - lo < dp.baseline_steps and self.s > 0:  # the reference left the buffer during a long excursion
            self.rebaseline()
            lo, hi = self.reference(dp)
        if hi - lo < dp.baseline_steps:  # learning the baseline
            self._append(step, x)
            return None
        if self.cached_hi < 0 or hi - self.cached_hi >= min(REFRESH_STEPS, max(1, (hi - lo) // 16)):
            self._refresh(lo, hi, dp)
        spike = x - self.mu > SPIKE_SPREADS * self.sigma
        if spike and dp.periodic_min_gap and self._periodic(step, dp.periodic_min_gap):
            self.ignored += 1
            return None
        if spike:
            self.spikes.append(step)
        s = max(0.0, self.s + self._score(x, dp) - dp.cusum_k - 2.0 / math.sqrt(len(self.ref)))
        if s > 0.0 and self.s == 0.0:
            self.start, self.peak = self.n, 0.0
        elif s == 0.0 and self.s > 0.0 and self.peak >= dp.cusum_h:
            self._forget_excursion()
        self.s = min(s, 2.0 * dp.cusum_h)  # bounded: a job that recovers drops below the alarm within a few steps
        self.peak = max(self.peak, self.s)
        self._append(step, x)
        if self.s < dp.cusum_h or self.n - self.start < dp.recent_steps:
            return None
        onset = self._onset(dp)
        level = median_sorted(sorted(self._window(max(onset, self.n - max(LEVEL_STEPS, dp.recent_steps)), self.n)))
        alarm = Alarm(
            self.start,
            self.steps[onset - self.n],
            self.n - onset,
            math.exp(level),
            math.exp(self.mu),
            self.sigma,
            self.s,
        )
        if alarm.shift >= dp.slowdown_threshold:
            return alarm
        if self.n - self.start > dp.reference_steps:
            self.rebaseline()  # a change too small to matter that lasted: the new normal
        return None

    def _onset(self, dp: DetectorPolicy) -> int:
        """Where in the excursion the change began: the split with the largest standardised rise of the mean
        (the reference, at its median, before it; hiccups clipped), leaving at least ``recent_steps`` after
        it.  An excursion can begin with noise before the slowdown; its level is that of the steps after."""
        v = np.frombuffer(self._window(self.start, self.n), dtype=np.float64)
        m = v.size
        if m <= dp.recent_steps:
            return self.start
        # hiccups clipped: at twice the recent level's excess, at least step_cap spreads
        c = max(dp.step_cap * self.sigma, 2.0 * (_np_median(v[-min(m, LEVEL_STEPS) :]) - self.mu))
        excess = np.clip(v - self.mu, -c, c)
        a = np.arange(m - dp.recent_steps + 1)  # excursion steps before the split
        after = np.cumsum(excess[::-1])[::-1][a]  # the excess of the steps from the split on ...
        before = np.concatenate(([0.0], np.cumsum(excess[: m - dp.recent_steps])))  # ... and of those before it
        nb, na = len(self.ref) + a, m - a
        gain = (after / na - before / nb) * np.sqrt(nb * na / (nb + na))
        return self.start + int(np.argmax(gain))

    def _forget_excursion(self) -> None:
        """A slowdown that ended on its own (the evidence rose to an alarm, then fell back to 0) is not the
        job's normal: its steps leave the log, so that the reference never holds them (a recurrence at the
        same level would otherwise rank as ordinary)."""
        keep = self.start - (self.n - len(self.log))
        if keep >= 0:
            del self.log[keep:]
            del self.steps[keep:]
            self.n = self.start
        self.peak = 0.0
        self.cached_hi = -1

    def rebaseline(self, fresh: bool = False) -> None:
        """The current excursion's level becomes the baseline (it lasted, too small to matter); ``fresh``: the
        steps from now on do (a window was opened for a slowdown: its level now is the job's new normal)."""
        if fresh:
            self.ref_from = self.n
        elif self.s > 0.0:
            self.ref_from = self.start
        self.s = self.peak = 0.0
        self.cached_hi = -1

    def describe(self, dp: DetectorPolicy) -> str:
        """What the rule sees, for people: the recent median against the baseline, and the evidence."""
        if not self.log:
            return "no complete step yet"
        # the current excursion if there is one, else the last quarter of a reference
        recent_n = max(1, self.n - self.start) if self.s > 0 else min(len(self.log), max(1, dp.reference_steps // 4))
        recent = math.exp(median_sorted(sorted(self._window(self.n - recent_n, self.n))))
        lo, hi = self.reference(dp)
        if hi - lo < dp.baseline_steps or math.isnan(self.mu):
            return f"median step time {recent * 1e3:.1f} ms; still learning the baseline ({hi - lo} of {dp.baseline_steps} steps)"
        base = math.exp(self.mu)
        return (
            f"median step time {recent * 1e3:.1f} ms over the last {recent_n} steps vs baseline {base * 1e3:.1f} ms "
            f"({(recent / base - 1) * 100:+.1f}%; step-to-step spread {self.sigma * 100:.1f}%, slowdown_threshold "
            f"{dp.slowdown_threshold * 100:g}%); evidence {self.s:.1f} of {dp.cusum_h:g} spreads"
        )


def median_rule(history: Sequence[float], dp: DetectorPolicy) -> tuple[float, float] | None:
    """The older rule (``rule: median``): the median of the last ``recent_steps`` step times (one
    hiccup is not a slowdown) and the 25th percentile of up to 4 x ``baseline_steps`` earlier ones (the
    recent best); None until there are enough steps."""
    if len(history) < dp.baseline_steps + dp.recent_steps:
        return None
    h = list(history)
    return float(np.median(h[-dp.recent_steps :])), float(
        np.percentile(h[: -dp.recent_steps][-4 * dp.baseline_steps :], 25)
    )
