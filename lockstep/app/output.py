"""CLI output: readable tables for people (numbers with separators and units, lists joined), JSON for programs."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ..units import joined, number, plural, value  # noqa: F401 - plural is part of this module's surface


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return number(v)
    if isinstance(v, (list, tuple)):
        return joined((_text(x) for x in v), limit=16)
    if isinstance(v, dict):
        return ", ".join(f"{k}={_text(x)}" for k, x in v.items())
    return str(v)


def _cell(v: Any, width: int) -> str:
    s = _text(v).replace("\n", " ")
    return s if len(s) <= width else s[: width - 1] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int = 60) -> str:
    rows = [list(r) for r in rows]
    widths = [
        min(max_width, max([len(h)] + [len(_cell(r[i], max_width)) for r in rows])) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(_cell(v, w).ljust(w) for v, w in zip(r, widths)))
    return "\n".join(x.rstrip() for x in out)


def evidence_text(e: dict) -> str:
    """``work 105.9 ms vs 80.0 ms``: a feature, the culprit's value and its peers', in the feature's unit."""
    from ..units import feature

    peer = "" if e.get("peer_value") is None else f" vs {value(e['feature'], e['peer_value'])}"
    return f"{feature(e['feature']).label} {value(e['feature'], e['value'])}{peer}"


#: characters of the findings table's evidence column
EVIDENCE_WIDTH = 110


def evidence_line(cause: str, evidence: list[dict], width: int = EVIDENCE_WIDTH) -> str:
    """The evidence that decided ``cause`` first, each item whole, as many as fit in ``width`` characters (at least
    one), then how many more: ``clock events 0x40 (HW thermal slowdown) vs none; SM clock 1,522 MHz vs 1,981 MHz (+2)``."""
    from ..units import decided_order

    items = [evidence_text(evidence[i]) for i in decided_order(cause, [e["feature"] for e in evidence])]
    out: list[str] = []
    for i, item in enumerate(items):
        more = f" (+{len(items) - i - 1})" if i < len(items) - 1 else ""  # room for the count after this item
        if out and len("; ".join([*out, item])) + len(more) > width:
            return "; ".join(out) + f" (+{len(items) - i})"
        out.append(item)
    return "; ".join(out)


def findings_table(findings: list[dict], acked: dict[str, str] | None = None) -> str:
    """The people's view of findings (the --json shape is the Finding record itself).  ``acked``: finding id -> who
    acknowledged its incident and when (``findings --open``), a column of its own when any was."""
    if not findings:
        return "no findings"
    rows = []
    for f in findings:
        culprit = joined(f["workers"]) if f["workers"] else f["scope"]
        ev = evidence_line(f["cause"], f["evidence"], EVIDENCE_WIDTH)
        rows.append(
            [
                f["job"],
                f["window"],
                culprit,
                joined(f["devices"], 2),
                f["function"],
                f["cause"],
                f"{f['confidence']:.2f}",
                f"{f['impact']['step_time_share'] * 100:.1f}%",
                f"{len(f['steps'])}/{f.get('window_steps') or len(f['steps'])}",
                ev,
            ]
        )
    head = ["job", "window", "workers", "device", "function", "cause", "conf", "cost", "steps", "evidence"]
    if acked:  # before the evidence, whose width is fitted to what is left of the line
        head.insert(-1, "acknowledged")
        for f, row in zip(findings, rows):
            row.insert(-1, acked.get(f["id"], "-"))
    return table(
        head,
        rows,
        max_width=max(72, *(len(r[-1]) for r in rows)),  # evidence is fitted whole by evidence_line, never cut
    )


def windows_table(windows: list[dict]) -> str:
    """Profiling windows and how each ended (``closed``: complete, timeout, failed; ``open``: a trigger whose window
    has not reported yet), with why when it did not complete."""
    if not windows:
        return "no windows"
    rows = [
        [
            w["job"],
            w["window"],
            f"{w['start_step']}..{w['start_step'] + w['steps'] - 1}",
            f"{w['workers_seen'] or '-'} of {w['expected_workers'] or '-'}",
            f"{w['coverage']:.0%}",
            w["findings"],
            w["closed"],
            w["closed_at"],
            w["closed_reason"],
        ]
        for w in windows
    ]
    return table(
        ["job", "window", "steps", "workers", "coverage", "findings", "closed", "at", "why"], rows, max_width=90
    )
