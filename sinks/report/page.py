"""The findings store as one HTML page with pictures (``lockstep report``, and the sink's live page).

Pure: typed rows in (:class:`Report`), one self-contained HTML document out (inline SVG and CSS,
nothing fetched), so the page can be mailed, attached to a ticket or opened from a laptop.  What it
shows, for an on-call engineer:

- what is being lost now (open incidents, GPU-hours per day) and by which causes;
- per job, the step time over time (the slowest worker's and the median), the profiling windows
  and the step where the slowdown began;
- per finding: the cause in words, where (workers, devices), what it costs (per step, per day, lost
  so far), the evidence in its units against the peers' median *and* spread, the steps it held in,
  why the window was opened, the incident and its pages, and the commands to run next;
- per window, a worker x function heatmap of the deviation from the peers (the worst cells only: a
  window of 10,000 workers shows its 32 worst workers and 16 worst functions);
- the windows' coverage, and what each evidence feature means.

The live page (``refresh_s``) adds one inline script that fetches the page again every few seconds,
swaps the content in place and says when it could not.  Every string from the store is escaped:
function names, summaries and reasons can hold customers' code.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from ...schemas.records import CAUSES, DEVICE_CAUSES, Evidence, Finding
from ...units import DECIDED_BY, decided_order, feature, hours, joined, number, plural, unit_label, value, with_unit

BAD, PEER, SPREAD, EMPTY, WINDOW, ACCENT = "#c0392b", "#7f8c8d", "#d5dbdb", "#ecf0f1", "#f5cba7", "#2471a3"
WINDOW_MARK = "#e67e22"
SIGMA = "\N{GREEK SMALL LETTER SIGMA}"  # a deviation in units of the peers' spread


# --------------------------------------------------------------------------- typed rows


@dataclass(frozen=True)
class WindowRow:
    """A row of the ``windows`` table, as much as the report shows."""

    job: str
    window: str
    start_step: int
    steps: int
    coverage: float
    findings: int
    closed: str
    closed_at: str
    expected_workers: int = 0
    workers_seen: int = 0
    bytes_per_worker: float = math.nan
    closed_reason: str = ""  # why it failed or timed out; ``closed`` is ``open`` for a trigger not reported yet


@dataclass(frozen=True)
class CauseRow:
    """A row of the ``gpu_hours_lost_by_cause`` view."""

    cause: str
    incidents: int
    open_incidents: int
    gpu_hours_per_day: float
    gpu_hours_lost: float


@dataclass(frozen=True)
class SeriesPoint:
    """A row of ``step_series``: one step of a job."""

    step: int
    step_time_us: float  # the slowest worker's
    median_us: float
    workers: int


@dataclass(frozen=True)
class HeatCell:
    """A row of ``window_deviations``: one worker x function of a window's heatmap."""

    worker: int
    function: str
    worker_rank: int
    function_rank: int
    z: float | None  # None: never flagged (within the peers' spread)
    flagged_steps: int
    workers_total: int
    functions_total: int


@dataclass(frozen=True)
class TriggerRow:
    job: str
    window: str
    kind: str | None
    reason: str
    start_step: int
    steps: int
    created_at: str
    onset_step: int | None = None  # a slowdown's window: the step the detector found the slowdown began at


@dataclass(frozen=True)
class IncidentRow:
    id: str
    status: str
    occurrence: int
    opened_at: str
    last_seen_at: str
    resolved_at: str | None
    resolved_by: str | None
    windows: int
    gpu_hours_per_day: float
    gpu_hours_lost: float  # from its opening until it resolved, or until now
    acked_at: str | None = None  # acknowledged by hand (``lockstep incident ack``): when ...
    acked_by: str | None = None  # ... and who


@dataclass(frozen=True)
class PageRow:
    """A row of ``webhook_deliveries``: one page (trigger or resolve) on one route."""

    route: str
    receiver: str
    action: str
    status: str
    attempts: int
    last_status: int | None
    last_error: str | None
    delivered_at: str | None


@dataclass
class Report:
    """Everything the page shows (read by :func:`lockstep.sinks.report.data.gather`)."""

    findings: list[Finding]
    windows: list[WindowRow]
    causes: list[CauseRow]
    series: dict[str, list[SeriesPoint]] = field(default_factory=dict)  # job -> points, in step order
    heatmaps: dict[tuple[str, str], list[HeatCell]] = field(default_factory=dict)  # (job, window) -> cells
    triggers: dict[tuple[str, str], TriggerRow] = field(default_factory=dict)
    incidents: dict[str, IncidentRow] = field(default_factory=dict)
    pages: dict[str, list[PageRow]] = field(default_factory=dict)  # incident id -> its pages
    incident_of: dict[str, str] = field(default_factory=dict)  # finding id -> incident id
    #: job -> rank -> (step, step time µs): each rank's own line on the step chart (offline windows of few ranks)
    rank_series: dict[str, dict[int, list[tuple[int, float]]]] = field(default_factory=dict)


# --------------------------------------------------------------------------- small helpers


#: how an incident was resolved, for people (``incidents.resolved_by``; anything else is the window that did not see it)
RESOLVED_BY = {
    "job_ended": "the job ended",
    "recovered": "the job's step time is back at its level before the slowdown",
    "stale": "nothing saw it for long",
    "": "-",
}


def resolved_why(resolved_by: str) -> str:
    """Why an incident resolved, for people (``manual:<who>``: someone resolved it by hand)."""
    if resolved_by.startswith("manual:"):
        return f"resolved by hand by {resolved_by.removeprefix('manual:')}"
    return RESOLVED_BY.get(resolved_by, f"window {resolved_by} did not see it")


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _sh(text: str) -> str:
    """A shell word: quoted when it needs it (commands shown for copying)."""
    import shlex

    return shlex.quote(str(text))


def _ms(us: float) -> str:
    return f"{us / 1000:,.1f} ms" if us < 1e6 else f"{us / 1e6:.2f} s"


# --------------------------------------------------------------------------- pictures


def coverage_colour(coverage: float) -> str:
    """Red means low coverage (a window that saw too few workers to trust), amber middling, green complete."""
    return BAD if coverage < 0.5 else "#e67e22" if coverage < 0.9 else "#27ae60"


def hbars(
    rows: list[tuple[str, float, str]],
    width: int = 1100,
    bar_h: int = 18,
    label_w: int = 240,
    colour: Callable[[float], str] = lambda v: BAD,
    top: float | None = None,
) -> str:
    """Horizontal bars, one per (label, value, note), scaled to ``top`` (default: the largest value), each
    coloured by ``colour(value)``."""
    if not rows:
        return ""
    top = top or max((v for _, v, _ in rows if math.isfinite(v)), default=0.0) or 1.0
    room = width - label_w - 420
    parts = []
    for i, (label, val, note) in enumerate(rows):
        y = 2 + i * (bar_h + 6)
        w = max(1.0, room * max(0.0, val) / top) if math.isfinite(val) else 0.0
        parts.append(
            f'<text x="{label_w - 6}" y="{y + bar_h - 5}" text-anchor="end">{_e(label)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour(val)}"><title>{_e(label)}: {number(val)}</title></rect>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + bar_h - 5}">{_e(note)}</text>'
        )
    height = 4 + len(rows) * (bar_h + 6)
    return f'<svg class="bars" width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'


def peer_spread(f: Finding, e: Evidence) -> float | None:
    """The peers' spread of an evidence feature, where the finding carries it: work features of a worker or a
    group are compared by robust z = (value - median) / spread, so spread = |value - median| / |z|."""
    if f.scope == "job" or not e.feature.startswith("work_us") or not e.deviation:
        return None
    if e.value is None or e.peer_value is None or not math.isfinite(e.deviation):
        return None
    return float(abs(e.value - e.peer_value) / abs(e.deviation))


def evidence_bars(f: Finding, width: int = 240) -> dict[int, str]:
    """Per evidence item (by index): the culprit's value (red) above its peers' median (grey), the peers'
    spread as a band around the median where known; each feature on its own scale."""
    out = {}
    bar_h = 11
    for i, e in enumerate(f.evidence):
        if e.value is None or e.peer_value is None or not (math.isfinite(e.value) and math.isfinite(e.peer_value)):
            continue
        if feature(e.feature).unit == "bits":  # a set of flags has no length to draw
            continue
        spread = peer_spread(f, e) or 0.0
        top = max(abs(e.value), abs(e.peer_value) + spread) or 1.0
        sx = (width - 4) / top
        wv, wp = max(1.0, abs(e.value) * sx), max(1.0, abs(e.peer_value) * sx)
        band = ""
        if spread:
            lo, hi = max(0.0, abs(e.peer_value) - spread) * sx, (abs(e.peer_value) + spread) * sx
            band = (
                f'<rect class="spread" x="{lo:.1f}" y="{bar_h}" width="{max(1.0, hi - lo):.1f}" height="{bar_h}" fill="{SPREAD}">'
                f"<title>peers: median ± spread {_e(value(e.feature, e.peer_value))} ± {_e(value(e.feature, spread))}</title></rect>"
            )
        out[i] = (
            f'<svg width="{width}" height="{2 * bar_h + 2}" role="img">'
            f'<rect x="0" y="0" width="{wv:.1f}" height="{bar_h}" fill="{BAD}"><title>this finding: {_e(value(e.feature, e.value))}</title></rect>'
            f"{band}"
            f'<rect x="0" y="{bar_h + 3}" width="{wp:.1f}" height="{bar_h - 6}" fill="{PEER}"><title>peers: {_e(value(e.feature, e.peer_value))}</title></rect>'
            "</svg>"
        )
    return out


def step_strip(held: list[int], start: int, steps: int, cell: int = 16) -> str:
    """The window's steps as boxes; filled where the deviation held."""
    if steps <= 0:
        return ""
    steps = min(steps, 64)
    marked = set(held)
    boxes = "".join(
        f'<rect x="{i * (cell + 2)}" y="0" width="{cell}" height="{cell}" fill="{BAD if start + i in marked else EMPTY}">'
        f"<title>step {start + i}: {'held' if start + i in marked else 'not seen'}</title></rect>"
        for i in range(steps)
    )
    return f'<svg class="strip" width="{steps * (cell + 2)}" height="{cell}" role="img">{boxes}</svg>'


def _rolling_median(xs: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        w = sorted(xs[max(0, i - k + 1) : i + 1])
        out.append(w[len(w) // 2])
    return out


def _quantile(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))]


#: the least and the most a slowdown must rise above its baseline to be marked (between them: six times the
#: baseline's own noise, so that a 2% slowdown of a steady job is marked and a noisy job's jitter is not)
MIN_RISE, MAX_RISE = 0.01, 0.10


def first_bad_step(
    points: list[SeriesPoint], before_step: int, rise: float | None = None
) -> tuple[int, float, float] | None:
    """Where a slowdown that led to a window began: the first step of the run, ending just before
    ``before_step``, in which the rolling median of the synchronised step time stays more than ``rise``
    above the baseline (the 25th percentile of the rolling median before it, as the detector's).  ``rise``
    by default is six times the baseline's noise (the robust spread of the lower half of the rolling
    median), within [1%, 10%].  Returns (step, baseline µs, step time µs at the end of the run), or None."""
    pts = [p for p in points if p.step < before_step]
    if len(pts) < 10:
        return None
    r = _rolling_median([p.step_time_us for p in pts])
    ordered = sorted(r)
    base = _quantile(ordered, 0.25)
    if base <= 0:
        return None
    if rise is None:
        low = ordered[: max(2, len(ordered) // 2)]
        mid = _quantile(low, 0.5)
        noise = 1.4826 * _quantile(sorted(abs(x - mid) for x in low), 0.5) / base
        rise = min(MAX_RISE, max(MIN_RISE, 6 * noise))
    i = len(r) - 1
    if r[i] <= base * (1 + rise):
        return None
    while i > 0 and r[i - 1] > base * (1 + rise):
        i -= 1
    if i == 0:  # slow from the first point on: the start is not in the series
        return None
    # the rolling median lags by up to half its width: the first raw step above the threshold near there
    j = next((k for k in range(max(0, i - 4), i + 1) if pts[k].step_time_us > base * (1 + rise)), i)
    return pts[j].step, base, r[-1]


def detector_onset(
    points: list[SeriesPoint], windows: list[WindowRow], triggers: dict[tuple[str, str], TriggerRow], first_window: int
) -> tuple[int, float, float] | None:
    """Where the slowdown that opened the window at ``first_window`` began, as the detector found it (its trigger's
    onset): (step, median step time µs of up to 50 steps before it, median from it to the window), or None when the
    detector gave none or the series does not reach back to it.  Unlike :func:`first_bad_step` this holds however
    long the slowdown ran before its window (a processor that caught up late, a window that found nothing)."""
    onsets = [
        t.onset_step
        for w in windows
        if w.start_step == first_window and (t := triggers.get((w.job, w.window))) and t.onset_step
    ]
    if not onsets:
        return None
    onset = min(onsets)
    before = sorted(p.step_time_us for p in points if onset - 50 <= p.step < onset)
    during = sorted(p.step_time_us for p in points if onset <= p.step < first_window)
    if len(before) < 5 or not during:
        return None
    return onset, _quantile(before, 0.5), _quantile(during, 0.5)


@dataclass(frozen=True)
class YRange:
    """A step chart's y-axis: ``lo``..``hi`` µs, chosen from the bulk of the points; ``clipped``: the points above
    it (a first step of seconds, a checkpoint), drawn at the top edge and marked."""

    lo: float
    hi: float
    clipped: list[SeriesPoint]


def robust_range(points: list[SeriesPoint]) -> YRange:
    """The y-range that shows the bulk of the step times: points beyond three interquartile ranges above the
    slowest worker's upper quartile are outliers (clipped and marked); the range is then the rest's least and
    most, padded by 8% (and at least 4% of the top, so that a flat series is not magnified into noise).  It
    starts at 0 only when the data come near it: a 2% slowdown must be as visible as a 30% one."""
    slow = sorted(p.step_time_us for p in points)
    q1, q3 = _quantile(slow, 0.25), _quantile(slow, 0.75)
    fence = q3 + 3 * max(q3 - q1, 0.02 * q3)
    clipped = [p for p in points if p.step_time_us > fence]
    kept = [p for p in points if p.step_time_us <= fence] or points
    hi = max(p.step_time_us for p in kept)
    lo = min(min(p.median_us for p in kept), min(p.step_time_us for p in kept))
    span = max(hi - lo, 0.04 * hi, 1.0)
    lo, hi = lo - 0.08 * span, hi + 0.08 * span
    if lo < 0.25 * hi:  # the data come near zero anyway: let the axis start there
        lo = 0.0
    return YRange(max(0.0, lo), hi, clipped)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values between ``lo`` and ``hi`` (steps of 1, 2, 2.5 or 5 times a power of ten)."""
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step) + 1)]


def _text_w(text: str, px: float = 6.2) -> float:
    """The width of a label at the charts' 11 px font, about (a layout that avoids collisions needs no more)."""
    return len(text) * px


def step_chart(
    job: str,
    points: list[SeriesPoint],
    windows: list[WindowRow],
    triggers: dict[tuple[str, str], TriggerRow],
    findings: list[Finding],
    width: int = 1100,
    height: int = 280,
    ranks: dict[int, list[tuple[int, float]]] | None = None,
) -> str:
    """A job's step time per step: the slowest worker (red) and the median worker (grey) on a robust y-range
    (outliers clipped to the top edge and marked ▲), the profiling windows as bands (labelled in a strip above
    the plot; darker where they found something) and where the slowdown began (a dashed line, labelled in a
    second strip).  Labels live in strips of their own, the legend below the axis: nothing overlaps the lines."""
    if not points:
        return ""
    left, right, top, bottom = 72, 16, 40, 50
    s0, s1 = points[0].step, points[-1].step
    wins = [w for w in windows if w.job == job]
    s0 = min([s0] + [w.start_step for w in wins if w.start_step + w.steps >= s0 - 50])
    s1 = max([s1] + [w.start_step + w.steps - 1 for w in wins if w.start_step <= s1 + 50])
    wins = [w for w in wins if w.start_step + w.steps - 1 >= s0 and w.start_step <= s1]
    yr = robust_range(points)
    plot = _Plot(left, top, width - left - right, height - top - bottom, s0, max(1, s1 - s0), yr.lo, yr.hi)
    found = {(f.job, f.window) for f in findings}
    parts = [
        *_axes(plot, height),
        *_window_bands(plot, wins, triggers, found),
        *_series_lines(plot, points, yr, ranks or {}),
        *_onset_mark(plot, points, wins, triggers, found),
    ]
    return f'<svg class="steps" data-job="{_e(job)}" width="{width}" height="{height}" role="img">{"".join(parts)}{_legend(plot, yr, height)}</svg>'


@dataclass(frozen=True)
class _Plot:
    """The step chart's plot area (``left``, ``top``, ``pw`` x ``ph`` px) and its scales: steps ``s0`` to
    ``s0 + span`` across, step times ``ylo`` to ``yhi`` up (clipped to them)."""

    left: int
    top: int
    pw: int
    ph: int
    s0: int
    span: int
    ylo: float
    yhi: float

    def x(self, step: float) -> float:
        return self.left + self.pw * (step - self.s0) / self.span

    def y(self, us: float) -> float:
        return self.top + self.ph * (1 - (min(max(us, self.ylo), self.yhi) - self.ylo) / (self.yhi - self.ylo))


def _axes(p: _Plot, height: int) -> list[str]:
    """The horizontal grid with its step times (in ms), a ≈ where the y-axis does not start at zero, the steps."""
    left, top, pw, ph = p.left, p.top, p.pw, p.ph
    parts = []
    for v in _ticks(p.ylo, p.yhi):  # horizontal grid, in ms
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{p.y(v):.1f}" y2="{p.y(v):.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{p.y(v) + 4:.1f}" text-anchor="end" class="axis">{_e(_ms(v))}</text>'
        )
    if p.ylo > 0:  # say so: the axis does not start at zero
        parts.append(
            f'<text x="{left - 6}" y="{top + ph + 14}" text-anchor="end" class="axis"><title>the y-axis starts at '
            f"{_e(_ms(p.ylo))}, not at zero, so that small changes show</title>≈</text>"
        )
    for k in range(6):
        st = round(p.s0 + p.span * k / 5)
        parts.append(f'<text x="{p.x(st):.1f}" y="{top + ph + 16}" text-anchor="middle" class="axis">{st:,}</text>')
    parts.append(f'<text x="{left + pw}" y="{height - 6}" text-anchor="end" class="axis">step</text>')
    return parts


def _window_bands(
    p: _Plot, wins: list[WindowRow], triggers: dict[tuple[str, str], TriggerRow], found: set[tuple[str, str]]
) -> list[str]:
    """Each profiling window as a band (darker where it found something) with a mark and its name in the strip above
    the plot (names that would overlap the one before are left out; the mark and the band's tooltip stay)."""
    left, top, pw, ph = p.left, p.top, p.pw, p.ph
    parts = []
    label_end = -math.inf  # the right end of the last window label drawn: labels that would overlap are left out
    for w in sorted(wins, key=lambda w: w.start_step):
        x0, x1 = p.x(w.start_step - 0.5), p.x(w.start_step + w.steps - 0.5)
        x0, x1 = max(left, x0), min(left + pw, x1)
        if x1 - x0 < 3:  # a short window on a long series: at least 3 px, so it is always seen
            x0, x1 = (x0 + x1) / 2 - 1.5, (x0 + x1) / 2 + 1.5
        t = triggers.get((w.job, w.window))
        why = f" · {_reason(t)}" if t else ""
        hit = w.findings > 0 or (w.job, w.window) in found
        tip = (
            f"window {w.window}: steps {w.start_step}..{w.start_step + w.steps - 1}, "
            f"{plural(w.findings, 'finding')}{why}"
        )
        parts.append(
            f'<rect class="window" x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{ph}" fill="{WINDOW if hit else EMPTY}" '
            f'opacity="0.8"><title>{_e(tip)}</title></rect>'
            f'<path class="window-mark" d="M{(x0 + x1) / 2 - 4:.1f},{top - 1} h8 l-4,5 z" fill="{WINDOW_MARK if hit else PEER}">'
            f"<title>{_e(tip)}</title></path>"
        )
        cx, half = (x0 + x1) / 2, _text_w(w.window) / 2
        cx = min(max(cx, left + half), left + pw - half)
        if cx - half > label_end + 4:
            parts.append(
                f'<text class="label window-label" x="{cx:.1f}" y="{top - 6}" text-anchor="middle">{_e(w.window)}'
                f"<title>{_e(tip)}</title></text>"
            )
            label_end = cx + half
    return parts


def _series_lines(
    p: _Plot, points: list[SeriesPoint], yr: YRange, ranks: dict[int, list[tuple[int, float]]]
) -> list[str]:
    """Each rank's own line (faint), the median worker's and the slowest worker's, and a mark at the top edge for
    each step off the scale."""
    parts = []
    for rank, pts in sorted(ranks.items()):  # each rank's own line, faint, under the two series
        own = " ".join(f"{p.x(st):.1f},{p.y(us):.1f}" for st, us in pts)
        parts.append(
            f'<polyline class="rank" points="{own}" fill="none" stroke="{PEER}" stroke-opacity="0.35" stroke-width="1">'
            f"<title>rank {rank}</title></polyline>"
        )
    line = " ".join(f"{p.x(pt.step):.1f},{p.y(pt.step_time_us):.1f}" for pt in _thin(points, p.pw))
    med = " ".join(f"{p.x(pt.step):.1f},{p.y(pt.median_us):.1f}" for pt in _thin(points, p.pw))
    parts.append(f'<polyline class="median" points="{med}" fill="none" stroke="{PEER}" stroke-width="1.2"/>')
    parts.append(f'<polyline class="slowest" points="{line}" fill="none" stroke="{BAD}" stroke-width="1.6"/>')
    for pt in yr.clipped[:50]:  # outliers: a mark at the top edge, the value on hover and in the legend below
        parts.append(
            f'<path class="clipped" d="M{p.x(pt.step) - 4:.1f},{p.top + 7} l4,-7 l4,7 z" fill="{BAD}">'
            f"<title>step {pt.step:,}: {_e(_ms(pt.step_time_us))}, off the scale</title></path>"
        )
    return parts


def _onset_mark(
    p: _Plot,
    points: list[SeriesPoint],
    wins: list[WindowRow],
    triggers: dict[tuple[str, str], TriggerRow],
    found: set[tuple[str, str]],
) -> list[str]:
    """Where the slowdown began, a dashed line labelled in the strip above the window names: before the first window
    that found something (else the first a slowdown triggered); nothing when there is neither, or no onset."""
    first_window = min((w.start_step for w in wins if w.findings > 0 or (w.job, w.window) in found), default=None)
    if first_window is None:  # a slowdown the detector saw is worth marking even before a finding
        first_window = min(
            (w.start_step for w in wins if (t := triggers.get((w.job, w.window))) and t.kind == "slowdown"),
            default=None,
        )
    if first_window is None:
        return []
    bad = detector_onset(points, wins, triggers, first_window) or first_bad_step(points, first_window)
    if bad is None:
        return []
    step, base, now = bad
    top, sx = p.top, p.x(step)
    text = f"slower from step {step:,} ({_ms(base)} → {_ms(now)}, {now / base - 1:+.0%})"
    anchor, tx = ("end", sx - 4) if sx + _text_w(text) + 4 > p.left + p.pw else ("start", sx + 4)
    return [
        f'<line class="onset" x1="{sx:.1f}" x2="{sx:.1f}" y1="{top - 16}" y2="{top + p.ph}" stroke="{ACCENT}" '
        f'stroke-dasharray="4 3" stroke-width="1.5"><title>slower from step {step}: {_e(_ms(now))} against {_e(_ms(base))} before'
        f'</title></line><text class="label onset-label" x="{tx:.1f}" y="{top - 20}" text-anchor="{anchor}" fill="{ACCENT}">'
        f"{_e(text)}</text>"
    ]


def _legend(p: _Plot, yr: YRange, height: int) -> str:
    """The legend below the axis: the two series, and what is off the scale."""
    off = ""
    if yr.clipped:
        worst = max(yr.clipped, key=lambda pt: pt.step_time_us)
        off = (
            f'  <tspan fill="{BAD}">▲ off the scale: {plural(len(yr.clipped), "step")}, up to {_e(_ms(worst.step_time_us))} '
            f"(step {worst.step:,})</tspan>"
        )
    return (
        f'<text class="axis legend" x="{p.left}" y="{height - 6}"><tspan fill="{BAD}">━ slowest worker</tspan>'
        f'  <tspan fill="{PEER}">━ median worker</tspan>{off}</text>'
    )


def _thin(points: list[SeriesPoint], pixels: float) -> list[SeriesPoint]:
    """At most about two points per pixel: keep each bucket's slowest step (peaks must stay visible)."""
    k = max(1, int(len(points) / max(1.0, 2 * pixels)))
    if k == 1:
        return points
    return [max(points[i : i + k], key=lambda p: p.step_time_us) for i in range(0, len(points), k)]


#: a deviation this many peers' spreads away is as significant as any (the colour saturates there)
Z_FULL = 50.0


def significance(z: float | None, held: int, steps: int) -> float:
    """How much a cell of the heatmap matters, 0..1: its deviation in peers' spreads (on a log scale, full at
    :data:`Z_FULL`) times the share of the window's steps it held in.  A persistent 14-spread slowdown outranks
    one step's 300-spread spike (a log flush, a page fault): the colour says what persisted, not what spiked."""
    if z is None or not math.isfinite(z) or held <= 0 or steps <= 0:
        return 0.0
    return min(1.0, held / steps) * min(1.0, math.log1p(abs(z)) / math.log1p(Z_FULL))


def sigmas(z: float) -> str:
    """A deviation in peers' spreads, short enough for a cell: +14, +493, +11k, then SIGMA."""
    if abs(z) < 0.5:
        return f"0{SIGMA}"  # not "-0"
    return f"{z:+.0f}{SIGMA}" if abs(z) < 1000 else f"{z / 1000:+.0f}k{SIGMA}"


def _is_link_cell(c: HeatCell) -> bool:
    """A cell the step stage flagged by its link's samples, not by its work (its z is 0 by construction)."""
    return c.z == 0.0 and c.flagged_steps > 0


def _heat_colour(z: float | None, sig: float = 1.0, link: bool = False) -> str:
    if z is None or (sig <= 0 and not link):
        return "#f4f6f7"
    a = 0.12 + 0.88 * sig
    if link:
        return f"rgba(125,60,152,{a:.2f})"  # a link or device: violet
    return f"rgba(192,57,43,{a:.2f})" if z > 0 else f"rgba(36,113,163,{a:.2f})"


@dataclass(frozen=True)
class DeviceRow:
    """A row of the heatmap for a link or device a finding named: its deciding evidence, where it held."""

    device: str
    function: str
    label: str  # the deciding evidence, short: "NIC spread -78%"
    detail: str  # the same, whole, for the tooltip
    held: int
    cause: str
    change: float = 0.0  # the deciding evidence's relative change against the peers' (-0.23: 23% below)


def device_rows(findings: list[Finding]) -> list[DeviceRow]:
    """One row per device of each finding whose culprit is a link or a device (:data:`DEVICE_CAUSES`)."""
    out = []
    for f in findings:
        if f.cause not in DEVICE_CAUSES or not f.devices:
            continue
        order = decided_order(f.cause, [e.feature for e in f.evidence])
        numeric = [
            f.evidence[i]
            for i in order
            if f.evidence[i].value is not None
            and f.evidence[i].peer_value  # a relative change needs a non-zero peer value
            and feature(f.evidence[i].feature).unit != "bits"
        ]
        lead = numeric[0] if numeric else None
        label, detail, change = f.cause, f.cause, 0.0
        if lead is not None:
            ft = feature(lead.feature)
            change = cast(float, lead.value) / cast(float, lead.peer_value) - 1
            label = f"{ft.label} {change:+.0%}"
            peers = f" vs {value(lead.feature, lead.peer_value)}" if lead.peer_value is not None else ""
            detail = f"{f.cause}: {ft.label} {value(lead.feature, lead.value)}{peers}"
        for d in f.devices:
            out.append(DeviceRow(d, f.function, label, detail, len(f.steps), f.cause, change))
    return out


def device_significance(d: DeviceRow, steps: int) -> float:
    """A device row's colour, 0..1: the share of steps it held in times its deciding change (a halving, or
    a doubling, is full); a device whose change is unknown counts its steps only."""
    size = min(1.0, abs(d.change) / 0.5) if d.change else 1.0
    return min(1.0, d.held / max(1, steps)) * size


def heatmap(
    job: str,
    window: str,
    cells: list[HeatCell],
    findings: list[Finding] | None = None,
    steps: int = 0,
    cell_w: int = 64,
    cell_h: int = 40,
    label_w: int = 190,
    head_h: int = 150,
) -> str:
    """Workers (rows) x functions (columns) of a window, coloured by :func:`significance` (red: slower, blue:
    faster, pale: within the peers' spread in every step); each cell says how many of the peers' spreads it
    deviated (median over the steps it was flagged in) and in how many of the window's steps it held.  The
    findings' cells are outlined; links and devices that findings named get rows of their own below the workers
    (violet), with the evidence that decided them."""
    findings = [f for f in findings or [] if (f.job, f.window) == (job, window)]
    if not cells and not findings:
        return ""
    workers = [w for _, w in sorted({(c.worker_rank, c.worker) for c in cells})]
    functions = [fn for _, fn in sorted({(c.function_rank, c.function) for c in cells})]
    devices = device_rows(findings)
    for fn in [f.function for f in findings] + [d.function for d in devices]:
        if fn not in functions:
            functions.append(fn)
    for f in findings:
        workers += [w for w in f.workers if w not in workers and f.cause not in DEVICE_CAUSES]
    steps = (
        steps or max((c.flagged_steps for c in cells), default=0) or max((len(f.steps) for f in findings), default=1)
    )
    grid = _Grid(cell_w, cell_h, label_w, head_h, functions, steps)
    rows = len(workers) + len(devices) + (1 if devices else 0)
    width, height = label_w + cell_w * len(functions) + 120, head_h + cell_h * rows + 8  # room for the last name
    parts = []
    for j, fn in enumerate(functions):
        cx = label_w + j * cell_w + cell_w / 2
        parts.append(
            f'<text transform="translate({cx + 4:.1f},{head_h - 6}) rotate(-50)" class="axis fn">{_e(fn[:40])}'
            f"<title>{_e(fn)}</title></text>"
        )
    by = {(c.worker, c.function): c for c in cells}
    outlined = {(w, f.function) for f in findings for w in f.workers}
    for i, w in enumerate(workers):
        parts += _worker_row(grid, i, w, by, outlined)
    if devices:
        parts += _device_rows(grid, len(workers), devices)
    return f'<svg class="heatmap" data-window="{_e(job)}/{_e(window)}" width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'


@dataclass(frozen=True)
class _Grid:
    """The heatmap's layout: cells of ``cell_w`` x ``cell_h`` px right of the row labels (``label_w``) and below the
    function names (``head_h``), one column per function; ``steps``: the window's, that each cell held in some of."""

    cell_w: int
    cell_h: int
    label_w: int
    head_h: int
    functions: list[str]
    steps: int

    def box(self, x0: float, y0: float, fill: str, tip: str, top: str, below: str, outline: bool, dark: bool) -> str:
        """One cell: its colour and tooltip, and two lines of text in it (none when ``top`` is empty)."""
        cell_w, cell_h = self.cell_w, self.cell_h
        stroke = ' stroke="#1b2631" stroke-width="3"' if outline else ""
        ink = "#fff" if dark else "#2c3e50"
        text = (
            f'<text x="{x0 + (cell_w - 2) / 2:.1f}" y="{y0 + 16}" text-anchor="middle" class="z" fill="{ink}">{_e(top)}</text>'
            f'<text x="{x0 + (cell_w - 2) / 2:.1f}" y="{y0 + 31}" text-anchor="middle" class="held" fill="{ink}">{_e(below)}</text>'
            if top
            else ""
        )
        return (
            f'<rect class="cell{" finding" if outline else ""}" x="{x0}" y="{y0}" width="{cell_w - 2}" height="{cell_h - 2}" '
            f'fill="{fill}"{stroke}><title>{_e(tip)}</title></rect>{text}'
        )


def _worker_row(
    g: _Grid, i: int, w: int, by: dict[tuple[int, str], HeatCell], outlined: set[tuple[int, str]]
) -> list[str]:
    """Row ``i`` of the heatmap, worker ``w``: its label and a cell per function (``by``: the cells flagged;
    ``outlined``: the findings' cells)."""
    steps = g.steps
    y0 = g.head_h + i * g.cell_h
    parts = [
        f'<text x="{g.label_w - 8}" y="{y0 + g.cell_h / 2 + 4:.1f}" text-anchor="end" class="axis">worker {w}</text>'
    ]
    for j, fn in enumerate(g.functions):
        c = by.get((w, fn))
        z = c.z if c else None
        held = c.flagged_steps if c else 0
        link = c is not None and _is_link_cell(c)
        sig = significance(z, held, steps) if not link else min(1.0, held / max(1, steps))
        if link:
            tip, top = (
                f"worker {w} · {fn}: its link was flagged (steady while its ring-mates burst) in {held} of {steps} steps",
                "link",
            )
        elif c and z is not None:
            tip = (
                f"worker {w} · {fn}: {z:+.1f} peers' spreads from the peers' median (median over the steps it was "
                f"flagged in), held in {held} of {steps} steps"
            )
            top = sigmas(z)
        else:
            tip, top = f"worker {w} · {fn}: within its peers' spread", ""
        if (w, fn) in outlined:
            tip += " · a finding"
        parts.append(
            g.box(
                g.label_w + j * g.cell_w,
                y0,
                _heat_colour(z, sig, link),
                tip,
                top,
                f"{held}/{steps}",
                (w, fn) in outlined,
                sig > 0.4,
            )
        )
    return parts


def _device_rows(g: _Grid, n_workers: int, devices: list[DeviceRow]) -> list[str]:
    """Below the ``n_workers`` workers' rows: a heading, then a row per link or device a finding named, its one cell
    in the finding's function's column."""
    cell_h, label_w, steps = g.cell_h, g.label_w, g.steps
    y0 = g.head_h + n_workers * cell_h
    parts = [
        f'<text x="4" y="{y0 + cell_h / 2 + 8:.1f}" class="axis devices-head">'
        "links and devices the findings named (the evidence that decided, against the peers')</text>"
    ]
    for k, d in enumerate(devices):
        y0 = g.head_h + (n_workers + 1 + k) * cell_h
        parts.append(
            f'<text x="{label_w - 8}" y="{y0 + cell_h / 2 - 2:.1f}" text-anchor="end" class="axis device">{_e(d.device)}'
            f'<tspan x="{label_w - 8}" dy="13">{_e(d.label.rsplit(" ", 1)[0])}</tspan></text>'
        )
        j = g.functions.index(d.function)
        sig = device_significance(d, steps)
        parts.append(
            g.box(
                label_w + j * g.cell_w,
                y0,
                _heat_colour(1.0, sig, link=True),
                f"{d.device} · {d.function}: {d.detail}, held in {d.held} of {steps} steps · a finding",
                d.label.rsplit(" ", 1)[-1],
                f"{d.held}/{steps}",
                True,
                sig > 0.4,
            ).replace('class="cell finding"', 'class="cell device finding"')
        )
    return parts


# --------------------------------------------------------------------------- words

#: what an on-call engineer does about each cause, first
ADVICE = {
    "gpu_throttle_thermal": "Check the GPU's cooling (fans, airflow, inlet temperature): nvidia-smi -q -d TEMPERATURE,PERFORMANCE on {host}. Drain the node if it stays hot.",
    "gpu_throttle_power": "Check the power cap and the power supply: nvidia-smi -q -d POWER,PERFORMANCE on {host}.",
    "gpu_throttle": "The GPU's clock is down without a reported reason: nvidia-smi -q -d PERFORMANCE,CLOCK on {host}.",
    "gpu_slow": "Slow at full clock: drain {host}, run the vendor diagnostics (dcgmi diag -r 3), reset or replace the GPU.",
    "nvlink": "Check the GPU's NVLink state and error counters: nvidia-smi nvlink -s / -e on {host}.",
    "pcie": "Check the GPU's PCIe link width and speed (lspci -vv) and AER errors (dmesg) on {host}.",
    "nic": "Check the NIC or bond: ethtool -S (errors, drops), the bond's members, the switch port's counters.",
    "switch": "Check the switch's port counters and congestion; move jobs off it if it persists.",
    "host_cpu_contention": "Find what takes the CPU on {host} (top, pidstat); stop or pin it away from the training cores.",
    "host_memory": "Check memory pressure on {host} (free, page cache, swap).",
    "storage": "Check the storage's latency and throughput from {host}; cache or prefetch the data.",
    "dataloader": "Give the data loader more workers, pin_memory and prefetch; check the decoding cost.",
    "input_imbalance": "Balance the input across ranks (sequence-length bucketing, packing, routing capacity).",
    "pipeline_imbalance": "Rebalance layers across the pipeline stages.",
    "rank_specific_code": "Move the rank-specific work (logging, evaluation, checkpoints) off the training step or make it asynchronous.",
    "framework_config": "Compare the framework and communication-library settings across ranks.",
    "python_overhead": "Reduce Python overhead: gc.freeze() after start-up, CUDA graphs, fewer small kernels.",
    "regression": "Compare with the job's earlier healthy windows: what changed in this function (code, library, input)?",
    "unknown": "Read the evidence and the raw trace of the workers named.",
    "hang": "Look at where the worker named is (its stack: py-spy dump --pid on {host}) against where its peers wait; restart the job from its last checkpoint.",
    "worker_died": "Read the worker's exit on {host} (the launcher's log, dmesg for the OOM killer); restart the job from its last checkpoint.",
}


def next_commands(f: Finding) -> list[tuple[str, str]]:
    """(command, why) an on-call engineer runs next for this finding."""
    out = []
    if f.workers and f.scope != "job":
        out.append(
            (
                f"lockstep raw {_sh(f.job)} --workers {','.join(map(str, f.workers[:8]))} --window {_sh(f.window)}",
                "the raw profiler trace of those workers in this window (opens in Perfetto)",
            )
        )
    out.append((f"lockstep findings --job {_sh(f.job)} --open", "is the problem still open?"))
    out.append(
        (
            f'lockstep trigger {_sh(f.job)} --reason "after the fix"',
            "profile again after acting: a complete window without it resolves the incident",
        )
    )
    return out


def _reason(t: TriggerRow) -> str:
    """``slowdown: median of ...`` (the reason names its kind already, except for old triggers)."""
    kind = t.kind or "trigger"
    return t.reason if t.reason.startswith(kind) else f"{kind}: {t.reason}"


def _ago(t: str | None, now: dt.datetime) -> str:
    if not t:
        return ""
    try:
        then = dt.datetime.fromisoformat(str(t).replace(" ", "T")).replace(tzinfo=dt.UTC)
    except ValueError:
        return ""
    s = max(0.0, (now - then).total_seconds())
    return (
        f"{s:.0f} s ago"
        if s < 120
        else f"{s / 60:.0f} min ago"
        if s < 7200
        else f"{s / 3600:.1f} h ago"
        if s < 172800
        else f"{s / 86400:.0f} days ago"
    )


def _when(t: str | None) -> str:
    return str(t)[:19].replace("T", " ") + " UTC" if t else ""


def evidence_table(f: Finding) -> str:
    bars = evidence_bars(f)
    rows = []
    for n, i in enumerate(decided_order(f.cause, [e.feature for e in f.evidence])):
        e = f.evidence[i]
        ft = feature(e.feature)
        spread = peer_spread(f, e)
        ratio = f"×{e.value / e.peer_value:.2f}" if e.value is not None and e.peer_value not in (None, 0) else ""
        peers = value(e.feature, e.peer_value) if e.peer_value is not None else "-"
        deciding = e.feature in DECIDED_BY.get(f.cause, ())
        cls = ' class="decided"' if deciding else ""
        note = '<div class="meta">decided the cause</div>' if deciding and n == 0 else ""
        rows.append(
            f'<tr{cls}><td><abbr title="{_e(ft.meaning)}">{_e(ft.label)}</abbr>{note}</td>'
            f'<td class="v bad">{_e(value(e.feature, e.value))}</td>'
            f'<td class="v">{_e(peers)}</td><td class="v">{"± " + _e(value(e.feature, spread)) if spread else ""}</td>'
            f'<td class="v">{_e(ratio)}</td><td>{bars.get(i, "")}</td></tr>'
        )
    return (
        '<table class="evidence"><tr><th>evidence</th><th>this</th><th>peers (median)</th><th>peers\' spread</th><th>ratio</th>'
        f'<th><span class="key bad"></span> this <span class="key peer"></span> peers <span class="key spread"></span> spread</th></tr>{"".join(rows)}</table>'
    )


def device_kind(findings: list[Finding]) -> str:
    """What a job's hours are hours of (the store's ``gpu_hours`` count the job's workers' devices): ``CPU`` where
    the findings name a worker's CPU (``host/cpu``: a job without accelerators) and nothing of a GPU, else ``GPU``
    (a GPU, NVLink, PCIe or NCCL named, or nothing said: a host or a NIC is on any job).  What the findings say of
    the workers themselves (``device_kind``, from their agents' devices) decides first; findings from before it are
    judged by the names."""
    said = {f.device_kind for f in findings if f.device_kind}
    if said:
        return "CPU" if said == {"cpu"} else "GPU"
    names = [d.lower() for f in findings for d in f.devices] + [f.function.lower() for f in findings]
    gpu = any(k in d for d in names for k in ("gpu", "cuda", "mtia", "nvlink", "pcie", "nccl", "rocm", "hip"))
    return "CPU" if not gpu and any(d.endswith("/cpu") for d in names) else "GPU"


def jobs_by_cost(r: Report) -> list[str]:
    """The jobs to draw, the costliest first: what their open incidents lose per day, else their findings' cost,
    then their name."""
    cost: dict[str, float] = dict.fromkeys(r.series, 0.0)
    for f in r.findings:
        cost[f.job] = cost.get(f.job, 0.0) + f.impact.gpu_hours_per_day
    return sorted(cost, key=lambda j: (-cost[j], j))


def _finding_card(f: Finding, r: Report, now: dt.datetime) -> str:
    window = next((w for w in r.windows if (w.job, w.window) == (f.job, f.window)), None)
    who = f"workers {joined(f.workers, 16)}" if f.workers else f"the {f.scope}"
    group = f" · group {', '.join(f'{k}={v}' for k, v in f.group.items())}" if f.group else ""
    start, steps = (
        (window.start_step, window.steps) if window else (min(f.steps, default=0), f.window_steps or len(f.steps))
    )
    trig = r.triggers.get((f.job, f.window))
    inc = r.incidents.get(r.incident_of.get(f.id, ""))
    pages = r.pages.get(inc.id, []) if inc else []
    host = f.hosts[0] if f.hosts else "the host"
    dev = device_kind([x for x in r.findings if x.job == f.job])
    cost = f"{f.impact.step_time_share:.1%} of every step · {hours(f.impact.gpu_hours_per_day, dev)} per day while it lasts"
    if inc is not None:
        lost = f"{hours(inc.gpu_hours_lost, dev)} lost so far ({'since' if inc.status == 'open' else 'from'} {_when(inc.opened_at)}"
        cost += f" · {lost}{', ' + _ago(inc.opened_at, now) if inc.status == 'open' else ''})"
    out = [
        f'<div class="card finding" data-finding="{_e(f.id)}"><h3><span class="cause">{_e(f.cause)}</span> · {_e(f.function)} · '
        f"{_e(f.job)} / {_e(f.window)}</h3>",
        f'<div class="why">{_e(CAUSES.get(f.cause, ""))}</div><div>{_e(f.summary)}</div>',
        f'<div class="kv"><span><b>where</b> {_e(who)}{_e(group)}</span><span><b>devices</b> {_e(joined(f.devices) or "-")}</span>'
        f"<span><b>hosts</b> {_e(joined(f.hosts) or '-')}</span><span><b>confidence</b> {f.confidence:.2f}</span></div>",
        f'<div class="kv"><span><b>cost</b> {_e(cost)}</span></div>',
        evidence_table(f),
        *(
            [
                f'<div class="kv"><span><b>not measured</b> {_e(joined(unmeasured))}: the samples that would tell the cause</span></div>'
            ]
            if (unmeasured := [e.feature for e in f.evidence if e.value is None])
            else []
        ),
        f'<div class="kv"><span><b>held in</b> {len(f.steps)} of {f.window_steps or steps} steps</span>{step_strip(list(f.steps), start, steps)}</div>',
    ]
    if trig is not None:
        out.append(
            f'<div class="kv"><span><b>window opened by</b> {_e(_reason(trig))} '
            f"(steps {trig.start_step:,}..{trig.start_step + trig.steps - 1:,}, {_e(_when(trig.created_at))})</span></div>"
        )
    if inc is not None:
        state = (
            f"open since {_when(inc.opened_at)}, seen in {plural(inc.windows, 'window')}"
            if inc.status == "open"
            else f"resolved {_when(inc.resolved_at)}: {resolved_why(inc.resolved_by or '')}"
        )
        if inc.status == "open" and inc.acked_at:
            state += f", acknowledged by {inc.acked_by or 'someone'} {_when(inc.acked_at)}"
        page_items = "".join(
            f"<li>{_e(p.route)} ({_e(p.receiver)}): {_e(p.action)} {_e(p.status)}"
            f"{', HTTP ' + str(p.last_status) if p.last_status else ''}{', ' + _e(p.last_error) if p.last_error and p.status != 'delivered' else ''}"
            f"{' after ' + plural(p.attempts, 'attempt') if p.attempts > 1 else ''}</li>"
            for p in pages
        )
        out.append(
            f'<div class="kv incident"><span><b>incident</b> <code>{_e(inc.id)}</code> {_e(state)}'
            f"{'' if inc.occurrence <= 1 else f' (occurrence {inc.occurrence})'}</span></div>"
            f'<ul class="pages">{page_items or "<li>not paged (no route matched, or paging is off)</li>"}</ul>'
        )
    advice = ADVICE.get(f.cause, ADVICE["unknown"]).format(host=host)
    cmds = "".join(f'<li><code>{_e(c)}</code> <span class="meta">{_e(why)}</span></li>' for c, why in next_commands(f))
    out.append(f'<div class="next"><b>next</b> {_e(advice)}<ul>{cmds}</ul></div></div>')
    return "".join(out)


def _heat_section(r: Report) -> list[str]:
    out = []
    keys = sorted(set(r.heatmaps) | {(f.job, f.window) for f in r.findings if f.cause in DEVICE_CAUSES})
    for job, window in keys:
        cells = r.heatmaps.get((job, window), [])
        w = next((x for x in r.windows if (x.job, x.window) == (job, window)), None)
        shown_w, shown_f = len({c.worker for c in cells}), len({c.function for c in cells})
        total_w, total_f = (cells[0].workers_total, cells[0].functions_total) if cells else (0, 0)
        seen = f" of the window's {plural(w.workers_seen, 'worker')}" if w and w.workers_seen else ""
        found = [f for f in r.findings if (f.job, f.window) == (job, window)]
        out.append(
            f'<div class="card"><h3>{_e(job)} / {_e(window)}</h3><div class="meta">The {shown_w} of {plural(total_w, "worker")} '
            f"that deviated in some step{_e(seen)}, and {shown_f} of their {plural(total_f, 'function')}, worst first. "
            f"Each cell: how many of the peers' spreads the work deviated from the peers' median ({SIGMA}, the median over the "
            "steps it was flagged in), and in how many of the window's steps it held. The colour is the significance: "
            "the deviation (log scale) times the share of steps it held, so what persisted is darker than a one-step "
            "spike (red: slower, blue: faster, pale: within the peers' spread in every step). Outlined: the findings; "
            "violet: links and devices (a saturated link slows its ring-mates alike, so it shows on its own row).</div>"
            f"{heatmap(job, window, cells, found, w.steps if w else 0)}</div>"
        )
    return out


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#2c3e50;max-width:1180px;margin:1.5em auto;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.meta{color:#7f8c8d} .card{border:1px solid #ddd;border-radius:6px;padding:.7em 1em;margin:.8em 0}
.card h3{margin:.1em 0 .3em;font-size:1.05em} .cause{color:#c0392b} .why{color:#7f8c8d;font-style:italic}
.kv{display:flex;flex-wrap:wrap;align-items:center;gap:.3em 1.6em;margin:.35em 0} .kv b{font-weight:600}
svg{display:block;margin:.3em 0;font:12px system-ui,sans-serif} svg.strip{display:inline-block;margin:0}
svg .axis{fill:#7f8c8d;font-size:11px} svg .label{font-size:11px;fill:#6e2c00} svg .z{font-size:13px;font-weight:600}
svg .held{font-size:10px} svg .fn{fill:#2c3e50;font-size:12px} svg .device,svg .devices-head{fill:#7d3c98}
table{border-collapse:collapse} td,th{padding:.15em .7em;text-align:left;border-bottom:1px solid #eee;vertical-align:middle}
td.v{text-align:right;white-space:nowrap} tr.decided td:first-child{border-left:3px solid #c0392b;padding-left:.5em}
.evidence td:first-child{max-width:26em;overflow-wrap:anywhere} td.bad{color:#c0392b;font-weight:600} abbr{text-decoration:underline dotted}
td.closed-failed{color:#c0392b;font-weight:600} td.closed-failed .meta{font-weight:normal}
.key{display:inline-block;width:.9em;height:.7em;margin:0 .2em 0 .6em} .key.bad{background:#c0392b} .key.peer{background:#7f8c8d}
.key.spread{background:#d5dbdb} code{background:#f4f6f7;padding:0 .3em;border-radius:3px}
.next ul,.pages{margin:.2em 0 .2em 1.2em;padding:0} .summary{display:flex;gap:2.5em;margin:.8em 0}
.summary div b{display:block;font-size:1.6em} #live{font-size:.9em} #live.stale{color:#c0392b;font-weight:600}
"""

_SCRIPT = """
(function(){
  var every = %d, n = 0, last = new Date();
  window.addEventListener('error', function(e){ document.body.setAttribute('data-script-error', String(e.message)); });
  function say(cls, text){ var el = document.getElementById('live'); el.className = cls; el.textContent = text; }
  function tick(){
    fetch(location.href, {credentials: 'same-origin', cache: 'no-store'}).then(function(r){
      if (!r.ok) { throw new Error('the sink answered HTTP ' + r.status); }
      return r.text();
    }).then(function(text){
      var fresh = new DOMParser().parseFromString(text, 'text/html').getElementById('content');
      if (!fresh) { throw new Error('the answer was not the page'); }
      document.getElementById('content').replaceWith(fresh);
      last = new Date(); n += 1;
      document.body.setAttribute('data-refreshed', String(n));
      say('ok', 'live: updated ' + last.toLocaleTimeString() + ', every ' + every / 1000 + ' s');
    }).catch(function(err){
      say('stale', 'not updated since ' + last.toLocaleTimeString() + ': ' + err.message);
    }).then(function(){ setTimeout(tick, every); });
  }
  say('ok', 'live: updated ' + last.toLocaleTimeString() + ', every ' + every / 1000 + ' s');
  setTimeout(tick, every);
})();
"""


def render(
    r: Report,
    *,
    title: str = "Lockstep report",
    scope: str = "",
    generated_at: dt.datetime | None = None,
    refresh_s: float | None = None,
    summary: bool = True,
) -> str:
    """The whole page.  ``r.findings`` in the order to show (costliest first); ``scope`` says what was selected;
    ``refresh_s``: the live page (refreshes itself that often)."""
    now = generated_at or dt.datetime.now(dt.UTC)
    dev = device_kind(r.findings)
    failed = [w for w in r.windows if w.closed == "failed"]
    body = ['<main id="content">', *_overview(r, scope, now, dev, failed, summary), *_step_section(r)]
    body.append("<h2>Findings</h2>")
    body += [_finding_card(f, r, now) for f in r.findings] or [
        "<p>No findings."
        + (
            f" {plural(len(failed), 'window')} failed (below), the latest: {_e(failed[0].job)} / "
            f"{_e(failed[0].window)}, {_e(failed[0].closed_reason)}"
            if failed
            else ""
        )
        + "</p>"
    ]
    heat = _heat_section(r)
    if heat:
        body += ["<h2>Deviation from the peers, per window</h2>", *heat]
    body += _windows_section(r)
    body += _evidence_section(r)
    body.append("</main>")
    live = ""
    script = ""
    if refresh_s:
        live = '<div id="live" class="ok">live</div>'
        script = f"<script>{_SCRIPT % int(refresh_s * 1000)}</script>"
    return "\n".join(
        [
            f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{_e(title)}</h1>{live}",
            *body,
            f"{script}</body></html>\n",
        ]
    )


def _overview(r: Report, scope: str, now: dt.datetime, dev: str, failed: list[WindowRow], summary: bool) -> list[str]:
    """What was selected and when; what is lost now and so far (``summary``: an offline window has no incidents, no
    pages, nothing lost over time to sum); the hours lost by cause."""
    open_inc = sum(c.open_incidents for c in r.causes)
    per_day = sum(c.gpu_hours_per_day for c in r.causes)
    lost = sum(c.gpu_hours_lost for c in r.causes)
    cov = [w.coverage for w in r.windows if w.closed != "open"]
    waiting = sum(w.closed == "open" for w in r.windows)
    ended = "".join(f" · {n} {what}" for n, what in ((len(failed), "failed"), (waiting, "open")) if n)
    body = [
        f'<div class="meta">{_e(scope or "every job")} · generated {now.strftime("%Y-%m-%d %H:%M:%S UTC")} · '
        f"{plural(len(r.findings), 'finding')} · {plural(len(r.windows), 'window')}{ended}</div>",
    ]
    if summary:
        body.append(
            f'<div class="summary"><div><b>{open_inc}</b>open {"incident" if open_inc == 1 else "incidents"}</div>'
            f"<div><b>{_e(hours(per_day, dev))}</b>per day being lost now</div><div><b>{_e(hours(lost, dev))}</b>lost so far</div>"
            f"<div><b>{_e(f'{sum(cov) / len(cov):.0%}' if cov else '-')}</b>mean coverage of the windows</div></div>"
        )
    if r.causes:
        rows = [
            (
                c.cause,
                c.gpu_hours_lost,
                f"{hours(c.gpu_hours_lost, dev)} lost · {hours(c.gpu_hours_per_day, dev)}/day now · "
                f"{c.open_incidents} of {plural(c.incidents, 'incident')} open",
            )
            for c in r.causes
        ]
        body += [f"<h2>{_e(dev)}-hours lost by cause</h2>", hbars(rows)]
    return body


def _step_section(r: Report) -> list[str]:
    """A card per job (costliest first) with its step chart."""
    jobs = jobs_by_cost(r)
    if not jobs:
        return []
    body = ["<h2>Step time</h2>"]
    for job in jobs:
        pts = r.series.get(job, [])
        chart = (
            step_chart(job, pts, r.windows, r.triggers, r.findings, ranks=r.rank_series.get(job))
            if pts
            else '<p class="meta">No step times stored for this job.</p>'
        )
        n = f"steps {pts[0].step:,}..{pts[-1].step:,}, {plural(max(p.workers for p in pts), 'worker')}" if pts else ""
        body.append(
            f'<div class="card"><h3>{_e(job)}</h3><div class="meta">{_e(n)}; shaded: profiling windows'
            f"{'; faint: each rank' if r.rank_series.get(job) else ''}</div>{chart}</div>"
        )
    return body


def _windows_section(r: Report) -> list[str]:
    """The profiling windows: their coverage as bars, then a table of each."""
    if not r.windows:
        return []
    rows = [
        (
            f"{w.job} / {w.window}",
            w.coverage,
            f"coverage {w.coverage:.0%} · {plural(w.findings, 'finding')} · "
            + (f"closed {w.closed}" if w.closed != "open" else "open")
            + (f": {w.closed_reason}" if w.closed_reason else ""),
        )
        for w in r.windows
    ]
    body = ["<h2>Profiling windows</h2>", hbars(rows, colour=coverage_colour, top=1.0)]
    body.append(
        "<table><tr><th>job</th><th>window</th><th>steps</th><th>workers</th><th>coverage</th><th>per worker</th>"
        "<th>findings</th><th>closed</th><th>at</th></tr>"
    )
    body += [
        f"<tr><td>{_e(w.job)}</td><td>{_e(w.window)}</td><td>{w.start_step:,}..{w.start_step + w.steps - 1:,}</td>"
        f"<td>{w.workers_seen or '-'} of {w.expected_workers or '-'}</td><td>{w.coverage:.0%}</td>"
        f"<td>{_e(with_unit('B', w.bytes_per_worker))}</td><td>{w.findings}</td>"
        f'<td class="closed-{_e(w.closed)}" title="{_e(w.closed_reason)}">{_e(w.closed)}'
        + (f'<div class="meta">{_e(w.closed_reason)}</div>' if w.closed_reason else "")
        + f"</td><td>{_e(_when(w.closed_at))}</td></tr>"
        for w in r.windows
    ]
    body.append("</table>")
    return body


def _evidence_section(r: Report) -> list[str]:
    """What each evidence feature the findings show means, in its unit."""
    used = sorted({e.feature.partition("[")[0] for f in r.findings for e in f.evidence})
    if not used:
        return []
    body = ["<h2>What the evidence means</h2><table>"]
    body += [
        f"<tr><td>{_e(feature(u).label)}</td><td>{_e(unit_label(feature(u).unit))}</td><td>{_e(feature(u).meaning)}</td></tr>"
        for u in used
    ]
    body.append("</table>")
    return body
