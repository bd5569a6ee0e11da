"""From a finished profiling window to feature batches, on the agent's window thread.

Chrome trace -> :func:`read_chrome_trace` (op events and step bounds) -> hardware
samples moved onto the trace's clock -> redaction of the events' names -> :func:`summarise`
(one function table per step) -> one :class:`WindowFeatures` with every step of the window
(one table, function names once, only what the diagnosis reads; the worker's TCP connections over the window
beside it).  The raw trace is kept by
the :class:`~lockstep.producers.agent.retention.RawStore`.

The trace reader and the summariser are ``trace.py`` and ``summarise.py``, the same
code ``lockstep diagnose`` runs on trace files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas import functions as ft
from ...schemas.events import connection_records
from ...schemas.records import HardwareSeen, ProfileTrigger, RawRequest, RawTrace, WindowFeatures, WorkerMeta
from .redact import Redaction
from .retention import RawStore, slice_trace
from .summarise import summarise
from .trace import read_chrome_trace

if TYPE_CHECKING:
    from .profiler import ProfilerKind

log = logging.getLogger("lockstep.agent")


def clock_offset_us(step_bounds: dict[int, tuple[float, float]], boundaries_unix_us: dict[int, float]) -> float:
    """Trace clock minus unix clock, in microseconds.

    The agent notes the unix time at every step boundary of the window; the trace
    has the same boundaries as the starts of its ``ProfilerStep#N`` spans.  The median
    difference maps sample times onto the trace's clock whatever its epoch.
    """
    common = sorted(set(step_bounds) & set(boundaries_unix_us))
    if not common:
        return float("nan")
    return float(np.median([step_bounds[s][0] - boundaries_unix_us[s] for s in common]))


def without_threads(trace: dict, tids: frozenset[int]) -> dict:
    """A Chrome trace without the events of the agent's own threads (the Python tracer records every thread)."""
    if not tids:
        return trace
    return {**trace, "traceEvents": [e for e in trace.get("traceEvents", []) if e.get("tid") not in tids]}


def _thread_id(stream: str) -> int | None:
    last = stream.rsplit("/", 1)[-1]
    return int(last) if last.isdigit() else None


def without_thread_events(events: pa.Table, tids: frozenset[int]) -> pa.Table:
    """Op events without those of the agent's own threads; an event's ``stream`` ends in its thread id (``pid/tid``)."""
    if not tids or events.num_rows == 0:
        return events
    enc = pc.dictionary_encode(pc.fill_null(events.column("stream"), "")).combine_chunks()
    own = np.array([_thread_id(s) in tids for s in enc.dictionary.to_pylist()], dtype=bool)  # once per distinct thread
    if not own.any():
        return events
    return events.filter(pa.array(~own[enc.indices.to_numpy(zero_copy_only=False)]))


def to_trace_clock(samples: pa.Table, offset_us: float) -> pa.Table:
    if samples.num_rows == 0 or not np.isfinite(offset_us):
        return samples.slice(0, 0)
    i = samples.schema.get_field_index("t_us")
    return samples.set_column(i, samples.schema.field(i), pc.add(samples.column("t_us"), offset_us))


def window_features(
    summaries: list,
    trigger: ProfileTrigger,
    meta: WorkerMeta,
    hardware: HardwareSeen,
    *,
    tenant: str = "",
    now: float | None = None,
    connections: pa.Table | None = None,
) -> WindowFeatures | None:
    """The worker's summarised steps of the window in one record (steps outside it are dropped; None if none is left).
    The summaries were made from redacted op events (:func:`process_window`): two names that redact alike are one function.
    ``connections``: the worker's TCP connections over the window (:mod:`.tcpdiag`), carried with it."""
    now = time.time() if now is None else now
    kept = [
        s
        for s in summaries
        if trigger.start_step <= s.step < trigger.start_step + trigger.steps
        and s.step_time_us > 0
        and s.functions.num_rows
    ]
    if not kept:
        return None
    kept.sort(key=lambda s: s.step)
    steps = [int(s.step) for s in kept]
    table = ft.window_table(steps, [ft.conform(s.functions) for s in kept])
    sw = trigger.shard_workers
    return WindowFeatures(
        job=trigger.job,
        window=trigger.window,
        window_start=trigger.start_step,
        window_steps=trigger.steps,
        expected_workers=trigger.expected_workers,
        shard=meta.rank // sw,
        shard_workers=sw,
        worker=meta,
        steps=steps,
        step_time_us=[float(s.step_time_us) for s in kept],
        functions=ft.pack_window(table),
        hardware=hardware,
        policy=trigger.policy_ref,
        sent_at=now,
        tenant=tenant or trigger.tenant,
        connections=connection_records(connections) if connections is not None else [],
    )


@dataclass
class WindowOutcome:
    record: WindowFeatures | None  # the window's features (None: no step could be summarised)
    trace_bytes: int  # raw Chrome trace as exported
    events: int
    seconds: float  # export + read + summarise + pack

    @property
    def steps(self) -> int:
        return len(self.record.steps) if self.record else 0


def process_window(
    prof,
    trigger: ProfileTrigger,
    meta: WorkerMeta,
    samples: pa.Table,
    boundaries_unix_us: dict[int, float],
    hardware: HardwareSeen,
    redaction: Redaction,
    store: RawStore,
    *,
    own_threads: frozenset[int] = frozenset(),
    min_share: float = 0.0,
    tenant: str = "",
    kind: ProfilerKind | None = None,
    connections: pa.Table | None = None,
) -> WindowOutcome:
    from .profiler import export_trace

    export, read = (kind.export, kind.read) if kind is not None else (export_trace, read_chrome_trace)
    t0 = time.perf_counter()
    path = store.dir / f".export-{trigger.window}.json"
    try:
        raw = export(prof, path)
    finally:
        del prof
    try:
        te = read(path, worker=meta.rank)  # from the file: the reader's typed decoding is the fastest
        events = redaction.table(without_thread_events(te.events, own_threads))  # names as they may leave the host
        samples = to_trace_clock(samples, clock_offset_us(te.step_bounds, boundaries_unix_us))
        summaries = summarise(events, samples if samples.num_rows else None, te.step_bounds, min_share=min_share)
        if connections is not None:
            connections = redaction.connections(connections)
        record = window_features(summaries, trigger, meta, hardware, tenant=tenant, connections=connections)
        store.keep(trigger.window, raw, te.step_bounds)
    finally:
        Path(path).unlink(missing_ok=True)
    return WindowOutcome(record, len(raw), events.num_rows, time.perf_counter() - t0)


def answer_raw_request(
    req: RawRequest,
    meta: WorkerMeta,
    store: RawStore,
    redaction: Redaction,
    max_bytes: int,
    *,
    own_threads: frozenset[int] = frozenset(),
    tenant: str = "",
) -> RawTrace:
    """This worker's answer to a raw request: a bounded, redacted, compressed slice, or the reason there is none."""
    common: dict[str, Any] = dict(
        job=req.job,
        request=req.request,
        worker=meta.rank,
        host=meta.host,
        redaction=redaction.spec(),
        tenant=tenant or req.tenant,
    )
    kept = store.load(req.window)
    if kept is None:
        what = f"window {req.window}" if req.window else "any window"
        return RawTrace(
            window=req.window, error=f"no raw trace of {what} is kept on this worker", sent_at=time.time(), **common
        )
    window, trace, bounds = kept
    missing = sorted(set(req.steps) - set(bounds))
    if req.steps and len(missing) == len(set(req.steps)):
        return RawTrace(
            window=window,
            error=f"steps {missing} are not in window {window} (steps {min(bounds)}..{max(bounds)})",
            sent_at=time.time(),
            **common,
        )
    sl = slice_trace(
        redaction.trace(without_threads(trace, own_threads)), bounds, list(req.steps), min(req.max_bytes, max_bytes)
    )
    return RawTrace(
        window=window,
        steps=sl.steps,
        events=sl.events,
        events_total=sl.events_total,
        truncated=sl.truncated,
        trace=sl.data,
        sent_at=time.time(),
        **common,
    )
