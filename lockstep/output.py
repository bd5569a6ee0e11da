"""CLI output: readable tables for people, JSON for programs."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Sequence


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _num(v: float) -> str:
    if v != v:  # NaN
        return "-"
    return f"{v:,.0f}" if abs(v) >= 10_000 else f"{v:.4g}"


def _cell(v: Any, width: int) -> str:
    s = "" if v is None else (_num(v) if isinstance(v, float) else str(v))
    s = s.replace("\n", " ")
    return s if len(s) <= width else s[: width - 1] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int = 60) -> str:
    rows = [list(r) for r in rows]
    widths = [min(max_width, max([len(h)] + [len(_cell(r[i], max_width)) for r in rows])) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(_cell(v, w).ljust(w) for v, w in zip(r, widths)))
    return "\n".join(out)


def findings_table(findings: list[dict]) -> str:
    """The people's view of findings (the --json shape is the Finding record itself)."""
    if not findings:
        return "no findings"
    rows = []
    for f in findings:
        culprit = ",".join(map(str, f["workers"][:8])) + ("…" if len(f["workers"]) > 8 else "") if f["workers"] else f["scope"]
        ev = "; ".join(
            f"{e['feature']} {_cell(e['value'], 10)} vs {_cell(e['peer_value'], 10)}"
            for e in f["evidence"][:3]
        )
        rows.append([
            f["job"], f["window"], culprit, ",".join(f["devices"][:2]), f["function"], f["cause"],
            f"{f['confidence']:.2f}", f"{f['impact']['step_time_share'] * 100:.1f}%", f"{len(f['steps'])}/{f.get('window_steps') or len(f['steps'])}", ev,
        ])  # fmt: skip
    return table(["job", "window", "workers", "device", "function", "cause", "conf", "cost", "steps", "evidence"], rows, max_width=72)
