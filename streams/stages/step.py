"""The step stage: feature batches and step slices (key ``job:step``) -> one ``StepReport`` per step (key ``job``).

:class:`~lockstep.streams.windows.StepAssembler` collects a step's workers, one ``FeatureBatch`` each from agents
that send those, many in a ``StepSlice`` from the shard stage, until every expected worker is accounted for (or the
step timed out); the stage then checks the function tables of the whole step at once (``ft.check_tables`` and
``ft.bad_owners``: the refused records go to the dead-letter topic, the step goes on without them), builds the
step's frame (:func:`step_frame`: a worker's first rows count, in rank order), runs :func:`analyze_step` and
publishes the report.  A step's input records are acknowledged only once its report is sent, in offset order per
partition (:class:`InOrderAcks`).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from ...schemas import functions as ft
from ...schemas.events import read_connections_ipc
from ...schemas.records import MAX_NAMED_MISSING, FeatureBatch, RecordError, StepSlice, decode, encode
from ..diagnosis import StepFrame, analyze_step, step_report
from ..diagnosis.frame import WORKER_SCHEMA, worker_columns
from ..windows import ClosedStep, Handle, PendingStep, StepAssembler
from .base import RecordIn, TimedAssemblingStage


class StepStage(TimedAssemblingStage[ClosedStep[RecordIn]]):
    """``topics.features`` -> :class:`StepAssembler` + :func:`analyze_step` -> ``topics.stepreports``."""

    name = "steps"
    assembler_class = StepAssembler
    assembler: StepAssembler[RecordIn]
    open_gauge = "open_steps"

    async def _add(self, record: RecordIn, handle: Handle[RecordIn]) -> tuple[ClosedStep[RecordIn] | None, bool]:
        rec = decode(record.value, (FeatureBatch, StepSlice))
        if isinstance(rec, FeatureBatch):
            table = ft.read(rec.functions, rec.functions_codec)  # values: checked per step (_finish)
            return self.assembler.add(rec, table, len(record.value), handle, self.clock())
        workers, functions = read_slice(rec)
        return self.assembler.add_slice(rec, workers, functions, handle, self.clock())

    async def _finish(self, closed: ClosedStep[RecordIn]) -> None:
        p = closed.pending
        m = self.metrics
        t0 = time.perf_counter()
        report = None
        try:
            diagnosis = self.policies.for_ref(p.policy).diagnosis
            frame, refused = step_frame(p, diagnosis.peer_group_keys)
            if frame is not None:
                rec = step_report(
                    analyze_step(frame, diagnosis),
                    window_start=p.window_start,
                    window_steps=p.window_steps,
                    expected_workers=p.expected_workers,
                    bytes_in=p.bytes_in,
                    policy=p.policy,
                    tenant=p.tenant,
                    closed="complete" if closed.reason == "complete" else "timeout",  # budget: closed early
                )
                rec.missing, rec.missing_total = missing_workers(p.expected_workers, frame.rank)
                rec.connections = step_connections(p)
                report = encode(rec)
        except Exception as exc:
            await self.failed([h.item for h in p.handles], exc)
            await self.release(p.handles)
            return
        for handle, err in refused:
            await self.dead_letter(handle.item, err)
        if report is not None:
            await self.send(self.topics.stepreports, p.job, report)
            m.inc("steps_closed_total", reason=closed.reason)
            m.set("step_analysis_seconds", time.perf_counter() - t0)
            m.observe(
                "step_close_latency_seconds",
                self.clock() - p.opened_at,
            )
        await self.release(p.handles)


def missing_workers(expected: int, seen: np.ndarray) -> tuple[list[int], int]:
    """The expected workers (ranks ``0..expected-1``) not in ``seen``: the first :data:`MAX_NAMED_MISSING`, and how many.

    In memory of the workers seen, not of the expected count (a record's claim: 10,000,000 took 700 MB): the first
    ``n`` missing ranks are all below ``len(seen) + n``."""
    seen = np.unique(seen[(seen >= 0) & (seen < expected)])
    total = expected - int(seen.size)
    candidates = np.arange(min(expected, seen.size + min(total, MAX_NAMED_MISSING)), dtype=np.int64)
    lost = candidates[~np.isin(candidates, seen)]
    return lost[:MAX_NAMED_MISSING].tolist(), total


def step_connections(p: PendingStep[RecordIn]) -> bytes:
    """The TCP connections the step's slices carry (their workers' first step: each worker's once a window), as one
    table for the window stage; empty when none does."""
    parts = [
        read_connections_ipc(x.record.connections, "StepSlice.connections") for x in p.slices if x.record.connections
    ]
    return ft.pack(pa.concat_tables(parts)) if parts else b""


def read_slice(sl: StepSlice) -> tuple[pa.Table, pa.Table]:
    """A slice's workers and their rows (values checked with the step's, :func:`step_frame`); RecordError if they
    disagree, or if its connections are not a connection table."""
    workers = ft.unpack_ipc(sl.workers)
    if not workers.schema.equals(WORKER_SCHEMA, check_metadata=False):
        raise RecordError("bad_function_table", f"slice workers table is not {WORKER_SCHEMA.names}")
    functions = ft.read_compact(sl.functions, sl.functions_codec, window=False, size=sl.functions_size)
    if sl.connections:
        read_connections_ipc(sl.connections, "StepSlice.connections")
    rows = workers.column("rows").to_numpy(zero_copy_only=False)
    if workers.column("rank").null_count or (rows < 0).any() or int(rows.sum()) != functions.num_rows:
        raise RecordError(
            "bad_function_table", f"slice workers claim {int(rows.sum())} rows, its table has {functions.num_rows}"
        )
    return workers, functions


def step_frame(
    p: PendingStep[RecordIn], peer_keys: tuple[str, ...]
) -> tuple[StepFrame | None, list[tuple[Handle[RecordIn], RecordError]]]:
    """The step's frame from its feature batches and slices (None when nothing usable came), and the records refused.

    Values are checked for the whole step at once: the batches' tables (``ft.check_tables``), the slices' rows
    (``ft.bad_owners``, a function once per worker).  A worker counts once, its first rows (a feature batch first: a
    redelivered one replaced its twin), in rank order."""
    entries = [p.batches[r] for r in sorted(p.batches)] + p.replaced
    errors = ft.check_tables([e.table for e in entries])
    refused = [(e.handle, err) for e, err in zip(entries, errors) if err is not None]
    parts_w: list[pa.Table] = []
    parts_f: list[pa.Table] = []
    good = [e for e, err in zip(entries[: len(p.batches)], errors) if err is None]
    if good:
        recs = [e.record for e in good]
        meta = worker_columns([b.worker for b in recs], peer_keys)
        parts_w.append(
            pa.table(
                {
                    **meta,
                    "step_time_us": [b.step_time_us for b in recs],
                    "hardware": [b.hardware != "none" for b in recs],
                    "rows": [e.table.num_rows for e in good],
                },
                schema=WORKER_SCHEMA,
            )
        )
        parts_f.append(ft.compact(pa.concat_tables([e.table for e in good]).combine_chunks()))
    if p.slices:
        slices = sorted(
            p.slices, key=lambda x: x.workers.column("rank")[0].as_py() if x.workers.num_rows else -1
        )  # shards: rank ranges
        t = ft.concat(
            [x.functions for x in slices]
        ).combine_chunks()  # one copy: the check and the analysis read whole columns
        rows = np.concatenate([x.workers.column("rows").to_numpy(zero_copy_only=False) for x in slices]).astype(
            np.int64
        )
        owner = np.repeat(np.repeat(np.arange(len(slices)), [x.workers.num_rows for x in slices]), rows)
        worker = np.repeat(np.arange(rows.size), rows)
        bad = ft.bad_owners(t, owner, len(slices), part=worker)
        for i in np.flatnonzero(bad):
            mine = owner == i
            refused.append(
                (
                    slices[i].handle,
                    ft.refusal(t.filter(pa.array(mine)), worker[mine])
                    or RecordError("bad_function_table", "slice refused"),
                )
            )
        if bad.any():
            t = t.filter(pa.array(~bad[owner]))
        parts_w += [x.workers for x, b in zip(slices, bad) if not b]
        parts_f.append(t)
    workers = pa.concat_tables(parts_w) if parts_w else WORKER_SCHEMA.empty_table()
    if workers.num_rows == 0:
        return None, refused
    functions = ft.complete(ft.concat(parts_f))
    ranks = workers.column("rank").to_numpy(zero_copy_only=False)
    rows = workers.column("rows").to_numpy(zero_copy_only=False).astype(np.int64)
    _, first = np.unique(ranks, return_index=True)  # each rank's first entry, in rank order
    if first.size != ranks.size or (first.size > 1 and (np.diff(ranks) <= 0).any()):
        start = np.cumsum(rows) - rows
        take = np.repeat(start[first] - (np.cumsum(rows[first]) - rows[first]), rows[first]) + np.arange(
            int(rows[first].sum())
        )
        workers, functions = workers.take(pa.array(first)), functions.take(pa.array(take))
    return StepFrame.from_parts(p.job, p.window, p.step, workers, functions.combine_chunks()), refused
