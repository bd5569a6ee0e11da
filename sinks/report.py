"""The findings store as one HTML page with pictures (``lockstep report``).

Pure: typed rows in, a self-contained HTML document out (inline SVG and CSS, no script, nothing
fetched), so the page can be mailed, attached to a ticket or opened from a laptop.  What it shows:

- GPU-hours lost by cause (bars): where the money goes;
- per finding, the evidence as paired bars (the culprit's value beside its peers' median, each
  feature on its own scale) and the window's steps with those the deviation held in filled;
- per window, the coverage (bars) with how it closed and what it found.

Every string from the store is escaped: function names and summaries can hold customers' code.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from dataclasses import dataclass

from ..schemas.records import Finding

BAD, PEER, EMPTY = "#c0392b", "#95a5a6", "#ecf0f1"  # the culprit (and the steps it held in), its peers, steps it did not


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


@dataclass(frozen=True)
class CauseRow:
    """A row of the ``gpu_hours_lost_by_cause`` view."""

    cause: str
    incidents: int
    open_incidents: int
    gpu_hours_per_day: float
    gpu_hours_lost: float


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _num(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if a >= 0.01 or a == 0 else f"{v:.2e}"


def hbars(rows: list[tuple[str, float, str]], width: int = 900, bar_h: int = 18, label_w: int = 220) -> str:
    """Horizontal bars, one per (label, value, note), scaled to the largest value."""
    if not rows:
        return ""
    top = max((v for _, v, _ in rows if math.isfinite(v)), default=0.0) or 1.0
    room = width - label_w - 330
    parts = []
    for i, (label, value, note) in enumerate(rows):
        y = 2 + i * (bar_h + 6)
        w = max(1.0, room * max(0.0, value) / top) if math.isfinite(value) else 0.0
        parts.append(
            f'<text x="{label_w - 6}" y="{y + bar_h - 5}" text-anchor="end">{_e(label)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{BAD}"><title>{_e(label)}: {_num(value)}</title></rect>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + bar_h - 5}">{_e(note)}</text>'
        )
    height = 4 + len(rows) * (bar_h + 6)
    return f'<svg width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'


def evidence_bars(f: Finding, width: int = 900, label_w: int = 220) -> str:
    """Per evidence feature: the culprit's value (red) above its peers' median (grey), on the feature's own scale."""
    items = [e for e in f.evidence if e.value is not None and e.peer_value is not None and math.isfinite(e.value) and math.isfinite(e.peer_value)]
    if not items:
        return ""
    room, bar_h, gap = width - label_w - 200, 12, 14
    parts = []
    for i, e in enumerate(items):
        y = 4 + i * (2 * bar_h + gap)
        top = max(abs(e.value), abs(e.peer_value)) or 1.0
        wv, wp = (max(1.0, room * abs(x) / top) for x in (e.value, e.peer_value))
        dev = f"×{e.value / e.peer_value:.2f}" if e.peer_value else ""  # the deviation field's unit differs by feature
        parts.append(
            f'<text x="{label_w - 6}" y="{y + bar_h}" text-anchor="end">{_e(e.feature)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{wv:.1f}" height="{bar_h}" fill="{BAD}"><title>this finding: {_num(e.value)}</title></rect>'
            f'<text x="{label_w + wv + 6:.1f}" y="{y + bar_h - 2}">{_num(e.value)} {_e(dev)}</text>'
            f'<rect x="{label_w}" y="{y + bar_h}" width="{wp:.1f}" height="{bar_h}" fill="{PEER}"><title>peers: {_num(e.peer_value)}</title></rect>'
            f'<text x="{label_w + wp + 6:.1f}" y="{y + 2 * bar_h - 2}" fill="#7f8c8d">peers {_num(e.peer_value)}</text>'
        )
    height = 4 + len(items) * (2 * bar_h + gap)
    return f'<svg width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'


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
    return f'<svg width="{steps * (cell + 2)}" height="{cell}" role="img">{boxes}</svg>'


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#2c3e50;max-width:980px;margin:2em auto;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em} h2{margin-top:1.8em;border-bottom:1px solid #ddd}
.meta{color:#7f8c8d} .card{border:1px solid #ddd;border-radius:6px;padding:.8em 1em;margin:1em 0}
.card h3{margin:.1em 0 .4em;font-size:1.05em} .kv{display:flex;flex-wrap:wrap;gap:.3em 1.6em;margin:.4em 0}
.kv b{font-weight:600} svg{display:block;margin:.4em 0;font:12px system-ui,sans-serif}
table{border-collapse:collapse} td,th{padding:.2em .8em;text-align:left;border-bottom:1px solid #eee}
"""


def _finding_card(f: Finding, window: WindowRow | None) -> str:
    who = f"workers {', '.join(map(str, f.workers[:16]))}{' …' if len(f.workers) > 16 else ''}" if f.workers else f"{f.scope} scope"
    group = f" · group {', '.join(f'{k}={v}' for k, v in f.group.items())}" if f.group else ""
    start, steps = (window.start_step, window.steps) if window else (min(f.steps, default=0), f.window_steps or len(f.steps))
    held = f"{len(f.steps)} of {f.window_steps or steps} steps"
    unmeasured = [e.feature for e in f.evidence if e.value is None]  # an undetermined cause: the samples that would tell
    missing = f"<span><b>not measured</b> {_e(', '.join(unmeasured))}</span>" if unmeasured else ""
    return (
        f'<div class="card"><h3>{_e(f.cause)} · {_e(f.function)} · {_e(f.job)} / {_e(f.window)}</h3>'
        f"<div>{_e(f.summary)}</div>"
        f'<div class="kv"><span><b>where</b> {_e(who)}{_e(group)}</span>'
        f"<span><b>devices</b> {_e(', '.join(f.devices) or '-')}</span>"
        f"<span><b>confidence</b> {f.confidence:.2f}</span>"
        f"<span><b>cost</b> {f.impact.step_time_share:.1%} of the step, {_num(f.impact.gpu_hours_per_day)} GPU-h/day</span>"
        f"<span><b>held in</b> {held}</span>{missing}</div>"
        f"{evidence_bars(f)}{step_strip(list(f.steps), start, steps)}</div>"
    )


def render(findings: list[Finding], windows: list[WindowRow], causes: list[CauseRow], *, title: str = "Lockstep report",
           scope: str = "", generated_at: dt.datetime | None = None) -> str:  # fmt: skip
    """The whole page.  ``findings`` in the order to show (costliest first); ``scope`` says what was selected."""
    now = (generated_at or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    by_window = {(w.job, w.window): w for w in windows}
    out = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}</style></head><body>',
        f"<h1>{_e(title)}</h1><div class=\"meta\">{_e(scope or 'every job')} · generated {now} · "
        f"{len(findings)} finding(s) · {len(windows)} window(s)</div>",
    ]
    if causes:
        rows = [(c.cause, c.gpu_hours_lost, f"{_num(c.gpu_hours_lost)} GPU-h lost · {c.open_incidents} of {c.incidents} incident(s) open") for c in causes]
        out += ["<h2>GPU-hours lost by cause</h2>", hbars(rows)]
    out.append("<h2>Findings</h2>")
    out += [_finding_card(f, by_window.get((f.job, f.window))) for f in findings] or ["<p>No findings.</p>"]
    if windows:
        rows = [(f"{w.job} / {w.window}", w.coverage, f"coverage {w.coverage:.0%} · {w.findings} finding(s) · {w.closed}") for w in windows]
        out += ["<h2>Profiling windows</h2>", hbars(rows)]
        out.append("<table><tr><th>job</th><th>window</th><th>steps</th><th>coverage</th><th>findings</th><th>closed</th><th>at</th></tr>")
        out += [
            f"<tr><td>{_e(w.job)}</td><td>{_e(w.window)}</td><td>{w.start_step}..{w.start_step + w.steps - 1}</td>"
            f"<td>{w.coverage:.0%}</td><td>{w.findings}</td><td>{_e(w.closed)}</td><td>{_e(w.closed_at)}</td></tr>"
            for w in windows
        ]
        out.append("</table>")
    out.append("</body></html>\n")
    return "\n".join(out)
