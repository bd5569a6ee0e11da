"""TEMPORARY stand-in for issue 4's ``trace.py`` and ``summarise.py``; delete when they land.

Same interface (``read_chrome_trace`` -> ``TraceEvents``, ``summarise`` -> ``[StepSummary]``)
so that the agent can be built and tested before the real reader and summariser are
merged.  ``lockstep.producers.agent.window`` imports the real modules first and falls
back to this one only while they are missing.  Deliberately crude: self time on the
event's thread as critical-path time, per-step means of the hardware samples.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from ...schemas import functions as ft
from ...schemas.events import OP_EVENT_SCHEMA

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COLLECTIVE = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_?to_?all|nccl|gloo", re.I)
_P2P = re.compile(r"\b(send|recv)\b", re.I)


@dataclass
class TraceEvents:
    worker: int
    events: pa.Table
    step_bounds: dict[int, tuple[float, float]]
    meta: dict = field(default_factory=dict)


@dataclass
class StepSummary:
    worker: int
    step: int
    step_time_us: float
    functions: pa.Table


def _kind(cat: str, name: str) -> str:
    if cat in ("kernel",):
        return "compute"
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    if _COLLECTIVE.search(name):
        return "collective"
    if _P2P.search(name):
        return "p2p"
    if name.startswith("Optimizer."):
        return "optimizer"
    if "DataLoader" in name:
        return "dataloader"
    if cat == "python_function":
        return "python"
    return "other"


def read_chrome_trace(source: str | Path | dict, worker: int | None = None) -> TraceEvents:
    trace = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if worker is None:
        worker = int(trace.get("distributedInfo", {}).get("rank", 0))
    raw = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    bounds = {}
    for e in raw:
        m = _STEP.match(e.get("name", ""))
        if m:
            bounds[int(m.group(1))] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    rows = [e for e in raw if not _STEP.match(e.get("name", "")) and e.get("cat") != "Trace" and not str(e.get("name", "")).startswith("<built-in")]
    starts = np.array([float(e["ts"]) for e in rows])
    step_of = np.full(len(rows), -1, dtype=np.int64)
    for s, (lo, hi) in bounds.items():
        step_of[(starts >= lo) & (starts < hi)] = s
    keep = step_of >= 0
    rows = [e for e, k in zip(rows, keep) if k]
    table = pa.table(
        {
            "worker": np.full(len(rows), worker, dtype=np.int64),
            "step": step_of[keep],
            "function": [re.sub(r" at 0x[0-9a-f]+", "", e["name"]) for e in rows],
            "kind": [_kind(e.get("cat", ""), e["name"]) for e in rows],
            "start_us": starts[keep],
            "duration_us": np.array([float(e["dur"]) for e in rows]),
            "host": pa.nulls(len(rows), pa.string()),
            "device": pa.nulls(len(rows), pa.string()),
            "resource": pa.nulls(len(rows), pa.string()),
            "bytes": pa.nulls(len(rows), pa.float64()),
            "stream": [str(e.get("tid", "")) for e in rows],
        },
        schema=OP_EVENT_SCHEMA,
    )
    return TraceEvents(worker, table, bounds, {"baseTimeNanoseconds": trace.get("baseTimeNanoseconds")})


def _self_times(start: np.ndarray, dur: np.ndarray, stream: list[str]) -> np.ndarray:
    out = dur.copy()
    order = np.lexsort((-dur, start))
    stacks: dict[str, list[int]] = {}
    for i in order:
        st = stacks.setdefault(stream[i], [])
        while st and start[st[-1]] + dur[st[-1]] <= start[i]:
            st.pop()
        if st:
            out[st[-1]] -= dur[i]
        st.append(i)
    return np.clip(out, 0, None)


def summarise(events: pa.Table, samples: pa.Table | None = None, step_bounds: dict | None = None, *, min_share: float = 0.0) -> list[StepSummary]:
    out = []
    if events.num_rows == 0:
        return out
    worker = int(events.column("worker")[0].as_py())
    for step in sorted(set(events.column("step").to_pylist())):
        ev = events.filter(pa.compute.equal(events.column("step"), step))
        start = ev.column("start_us").to_numpy()
        dur = ev.column("duration_us").to_numpy()
        self_t = _self_times(start, dur, ev.column("stream").to_pylist())
        names = np.asarray(ev.column("function").to_pylist(), dtype=object)
        kinds = dict(zip(names, ev.column("kind").to_pylist()))
        uniq, inv = np.unique(names, return_inverse=True)
        crit = np.bincount(inv, weights=self_t)
        total = np.bincount(inv, weights=dur)
        calls = np.bincount(inv)
        lo, hi = (step_bounds or {}).get(step, (float(start.min()), float((start + dur).max())))
        keep = np.argsort(-crit)[:64]
        keep = keep[(crit[keep] >= min_share * (hi - lo)) | (total[keep] >= min_share * (hi - lo))]
        cols: dict[str, object] = {
            "function": uniq[keep].tolist(),
            "kind": [kinds[n] for n in uniq[keep]],
            "calls": calls[keep].astype(np.int32),
            "total_us": total[keep],
            "critical_us": crit[keep],
        }
        if samples is not None and samples.num_rows:
            t = samples.column("t_us").to_numpy()
            inside = samples.filter(pa.array((t >= lo) & (t < hi)))
            for metric in ft.HARDWARE:
                v = inside.filter(pa.compute.equal(inside.column("metric"), metric)).column("value").to_numpy()
                if v.size:
                    cols[metric] = np.full(keep.size, float(np.mean(v)))
        out.append(StepSummary(worker, step, float(hi - lo), ft.make_table(cols)))
    return out
