"""Raw retention: the last window's profiler trace, kept on the host, bounded; slices on request.

The Chrome trace the profiler exported is kept zstd-compressed next to the step
bounds the reader found in it; the previous window's trace is deleted.  When the
compressed trace is larger than the bound, the longest events that fit are kept
(:func:`slice_trace`), so what stays is what a person looks at first.  A
:class:`~lockstep.schemas.records.RawRequest` is answered with a slice of the same
kind, cut to the request's steps and byte bound.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import cramjam
import msgspec
import numpy as np

from ...schemas.compression import CompressionError, zstd_decompress

log = logging.getLogger("lockstep.agent")

Bounds = dict[int, tuple[float, float]]


def compress(data: bytes) -> bytes:
    return bytes(cramjam.zstd.compress(data, level=3))


#: the most a kept raw trace may expand to when it is read back (a window of a busy job's profiler
#: output; a file that expands further is not one the agent wrote)
MAX_TRACE_BYTES = 2 << 30


def decompress(data: bytes, max_bytes: int = MAX_TRACE_BYTES) -> bytes:
    """A zstd-compressed trace, bounded (:func:`~lockstep.schemas.compression.zstd_decompress`)."""
    return zstd_decompress(data, max_bytes)


@dataclass
class Slice:
    data: bytes  # zstd-compressed Chrome-trace JSON
    steps: list[int]
    events: int  # events kept (metadata events not counted)
    events_total: int  # events of those steps
    truncated: bool


def slice_trace(trace: dict, bounds: Bounds, steps: list[int] | None, max_bytes: int) -> Slice:
    """The events of ``steps`` (all steps if empty/None) that fit, compressed, into ``max_bytes``; longest first.

    Metadata events (process and thread names) are always kept.  If even those do
    not fit, the slice holds no events at all.
    """
    events = trace.get("traceEvents", [])
    wanted = sorted(s for s in (steps or bounds) if s in bounds)
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    ts = np.fromiter((float(e.get("ts", np.nan)) for e in body), dtype=np.float64, count=len(body))
    dur = np.fromiter((float(e.get("dur", 0.0) or 0.0) for e in body), dtype=np.float64, count=len(body))
    inside = np.zeros(len(body), dtype=bool)
    for s in wanted:
        lo, hi = bounds[s]
        inside |= (ts < hi) & (ts + dur > lo)
    idx = np.flatnonzero(inside)
    by_length = idx[np.argsort(-dur[idx], kind="stable")]
    header = {k: v for k, v in trace.items() if k not in ("traceEvents", "traceName")}

    def pack(k: int) -> bytes:
        top = by_length[:k]
        keep = top[np.argsort(ts[top], kind="stable")]  # back in time order
        doc = {**header, "traceEvents": meta + [body[i] for i in keep]}
        return compress(msgspec.json.encode(doc))

    data = pack(len(by_length))
    if len(data) <= max_bytes:
        return Slice(data, wanted, len(by_length), len(by_length), False)
    lo, hi = 0, len(by_length)  # largest k whose slice fits: lo fits (or is 0), hi does not
    best = pack(0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate = pack(mid)
        if len(candidate) <= max_bytes:
            lo, best = mid, candidate
        else:
            hi = mid
    if len(best) > max_bytes:
        best = compress(msgspec.json.encode({**header, "traceEvents": []}))
        lo = 0
    return Slice(best, wanted, lo, len(by_length), True)


def safe_file_name(name: str) -> str:
    """``name`` as one file-name component: letters, digits, ``-_.`` (others become ``_``), at most 200."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:200] or "_"


class RawStore:
    """Keeps the last window's raw trace in ``directory``, at most ``max_bytes`` compressed."""

    def __init__(self, directory: Path, max_bytes: int):
        self.dir = Path(directory)
        self.max_bytes = max_bytes

    def keep(self, window: str, raw: bytes, bounds: Bounds) -> Path:
        """Keep this window's trace (``raw``: the JSON as exported), replacing the previous window's."""
        self.dir.mkdir(parents=True, exist_ok=True)
        data = compress(raw)
        if len(data) > self.max_bytes:
            sl = slice_trace(msgspec.json.decode(raw), bounds, None, self.max_bytes)
            log.warning(
                "raw trace of window %s is %d bytes compressed, over the %d-byte bound: keeping its %d longest of %d events",
                window,
                len(data),
                self.max_bytes,
                sl.events,
                sl.events_total,
            )
            data = sl.data
        path = self.dir / f"{safe_file_name(window)}.trace.json.zst"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        meta = {"window": window, "bounds": {str(k): list(v) for k, v in bounds.items()}}
        (self.dir / f"{safe_file_name(window)}.meta.json").write_text(json.dumps(meta))
        tmp.replace(path)
        for old in self.dir.iterdir():
            if not old.name.startswith(f"{safe_file_name(window)}."):
                old.unlink(missing_ok=True)
        return path

    def load(self, window: str = "") -> tuple[str, dict, Bounds] | None:
        """(window, trace, step bounds) of the kept window if it is ``window`` (or any, for ""), else None."""
        metas = sorted(self.dir.glob("*.meta.json")) if self.dir.is_dir() else []
        for meta_path in metas:
            try:
                meta = json.loads(meta_path.read_text())
                if window and meta["window"] != window:
                    continue
                trace_path = self.dir / f"{safe_file_name(meta['window'])}.trace.json.zst"
                if not trace_path.exists():
                    continue
                trace = msgspec.json.decode(decompress(trace_path.read_bytes()))
                return meta["window"], trace, {int(k): (float(v[0]), float(v[1])) for k, v in meta["bounds"].items()}
            except (OSError, ValueError, KeyError, TypeError, CompressionError, msgspec.DecodeError) as exc:
                log.warning("raw trace %s cannot be read back (%s); it is not sent", meta_path, exc)
        return None
