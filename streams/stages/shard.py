"""The shard stage: workers' ``WindowFeatures`` (key ``job:window:shard``) -> per step, one columnar ``StepSlice``
of the shard's workers (key ``job:step``, on the features topic, where the step stage assembles the step).

A 100,000-worker job's window is 100,000 records; keyed by shard (``rank // shard_workers``, 256 by default) they
spread over the partitions, so several processors read one window.  :class:`~lockstep.streams.windows.ShardAssembler`
collects a shard's records until every member sent its own (or the shard timed out); then :func:`step_slices` checks
them all at once (one vectorised pass, :func:`~lockstep.schemas.functions.bad_owners`: the refused records go to the
dead-letter topic, the shard goes on without them) and cuts the shard's rows into one slice per step: the workers'
metadata as columns, their function rows as one Arrow table, and the members that sent nothing for the step
(``missing_ranges``, and ``missing`` when they are few), so that the step stage does not wait for them.  The step stage then reads a few hundred slices per step
instead of one record per worker.  A shard's input records are acknowledged once its slices are sent, in offset order
per partition; a replayed shard sends the same slices again, which the step stage ignores (it keeps a worker's first).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas import functions as ft
from ...schemas.events import connection_table
from ...schemas.records import (
    MAX_NAMED_MISSING,
    RecordError,
    StepSlice,
    WindowFeatures,
    decode,
    encode,
    ranks_as_ranges,
)
from ..diagnosis.frame import WORKER_SCHEMA, worker_columns
from ..windows import ClosedShard, Handle, PendingShard, ShardAssembler
from .base import RecordIn, TimedAssemblingStage

#: a slice whose encoded record passes this is cut in two (Kafka's default record limit is 1 MiB)
SLICE_MAX_BYTES = 768 << 10
#: the most workers a shard of a window may have (triggers ask for 256; the record type allows 100,000)
MAX_SHARD_WORKERS = 4096


def check_sizes(rec: WindowFeatures, max_window_steps: int) -> None:
    """Refuse a record whose declared sizes no trigger asks for: the shard builds one slice per step of the window,
    each naming the shard's members that sent nothing.  The sizes come from the policy the window was opened under,
    not from the record (a 2 KB record claiming 200 steps of 100,000-worker shards took the processor to 1.85 GB and
    had it publish 74 MB).  Raises RecordError('invalid')."""
    if rec.window_steps > max_window_steps:
        raise RecordError(
            "invalid", f"window_steps {rec.window_steps} exceeds the policy's max_window_steps ({max_window_steps})"
        )
    if rec.shard_workers > MAX_SHARD_WORKERS:
        raise RecordError("invalid", f"shard_workers {rec.shard_workers} exceeds {MAX_SHARD_WORKERS}")


class ShardStage(TimedAssemblingStage[ClosedShard[RecordIn]]):
    """``topics.windowfeatures`` -> :class:`ShardAssembler` -> :func:`step_slices` -> ``topics.features``."""

    name = "shards"
    assembler_class = ShardAssembler
    assembler: ShardAssembler[RecordIn]
    open_gauge = "open_shards"

    async def _add(self, record: RecordIn, handle: Handle[RecordIn]) -> tuple[ClosedShard[RecordIn] | None, bool]:
        rec = decode(record.value, WindowFeatures)
        check_sizes(rec, self.policies.for_ref(rec.policy).detector.max_window_steps)
        table = ft.read_compact(rec.functions, rec.functions_codec)  # values: checked per shard (_finish)
        return self.assembler.add(rec, table, len(record.value), handle, self.clock())

    async def _finish(self, closed: ClosedShard[RecordIn]) -> None:
        p = closed.pending
        try:
            keys = self.policies.for_ref(p.policy).diagnosis.peer_group_keys
            slices, errors = iter_step_slices(p, keys)
            for handle, err in errors:
                await self.dead_letter(handle.item, err)
            for step, value in slices:  # each built, encoded and sent before the next: one slice in memory at a time
                await self.send(self.topics.features, f"{p.job}:{step}", value)
        except Exception as exc:
            await self.failed([h.item for h in p.handles], exc)
            await self.release(p.handles)
            return
        self.metrics.inc("shards_closed_total", reason=closed.reason)
        await self.release(p.handles)


def step_slices(
    p: PendingShard[Any], peer_keys: tuple[str, ...]
) -> tuple[list[tuple[int, bytes]], list[tuple[Handle[Any], RecordError]]]:
    """A closed shard's slices, one per step of its window (encoded, with their step; a slice over
    :data:`SLICE_MAX_BYTES` is cut in parts), and the records refused, with their handles and reasons."""
    slices, errors = iter_step_slices(p, peer_keys)
    return list(slices), errors


def iter_step_slices(
    p: PendingShard[Any], peer_keys: tuple[str, ...]
) -> tuple[Iterator[tuple[int, bytes]], list[tuple[Handle[Any], RecordError]]]:
    """:func:`step_slices`, the slices built one at a time as they are taken (the stage sends each before the next
    is built: a window of 64 steps held 64 encoded slices at once before).

    Pure and vectorised over the shard's rows: one concatenation, one values check, one sort by (step, worker)."""
    entries = [
        p.records[r] for r in sorted(p.records)
    ] + p.replaced  # rank order; then twins, checked for the dead letters
    n, live = len(entries), len(p.records)
    recs = [e.record for e in entries]
    t = ft.concat([e.table for e in entries])
    owner = np.repeat(np.arange(n), [e.table.num_rows for e in entries])
    ws, n_steps = p.window_start, p.window_steps
    step = t.column("step").to_numpy(zero_copy_only=False).astype(np.int64) - ws
    # each record's step times by step of the window (NaN: a step it did not summarise); validate() kept them inside
    declared = np.full((n, n_steps), np.nan)
    declared[np.repeat(np.arange(n), [len(r.steps) for r in recs]), np.concatenate([r.steps for r in recs]) - ws] = (
        np.concatenate([r.step_time_us for r in recs])
    )
    part = np.clip(step, 0, n_steps - 1)
    stray = (
        np.bincount(owner, weights=~((step >= 0) & (step < n_steps) & ~np.isnan(declared[owner, part])), minlength=n)
        > 0
    )
    bad = ft.bad_owners(t, owner, n, part=part) | stray
    errors = []
    for i in np.flatnonzero(bad):
        mine = owner == i
        err = (
            RecordError("bad_function_table", "window table has rows of steps the record does not declare")
            if stray[i]
            else (
                ft.refusal(t.filter(pa.array(mine)), step[mine])
                or RecordError("bad_function_table", "window table refused")
            )
        )
        errors.append((entries[i].handle, err))
    # the members' good records: metadata once, then each step's workers and rows
    good = ~bad[:live]
    declared = declared[:live]
    meta = {
        k: np.asarray(v, dtype=np.int64 if k == "rank" else object)
        for k, v in worker_columns([r.worker for r in recs[:live]], peer_keys).items()
    }
    meta["hardware"] = np.array([r.hardware != "none" for r in recs[:live]])
    per_step_bytes = np.array([e.size / len(e.record.steps) for e in entries[:live]])
    order = np.flatnonzero((owner < live) & good[np.minimum(owner, live - 1)])
    order = order[np.argsort(step[order] * live + owner[order], kind="stable")]  # by step, then worker (rank)
    rows = ft.complete(t.take(pa.array(order)).drop_columns(["step"]), _present(t))
    bounds = np.searchsorted(step[order], np.arange(n_steps + 1))
    members = np.arange(p.members.start, p.members.stop)
    # each good member's TCP connections ride on the slice of its first step: once per window to the window stage
    first = np.array([r.steps[0] - ws for r in recs[:live]], dtype=np.int64)
    carry = good & np.array([bool(r.connections) for r in recs[:live]], dtype=bool)
    conns = {
        s: connection_table([recs[i].worker.rank for i in who], [recs[i].connections for i in who])
        for s in np.unique(first[carry]).tolist()
        for who in [np.flatnonzero(carry & (first == s))]
    }
    slices = _slices(p, n_steps, good, declared, owner, order, bounds, meta, members, rows, per_step_bytes, conns)
    return slices, errors


def _slices(
    p: PendingShard[Any],
    n_steps: int,
    good: np.ndarray,
    declared: np.ndarray,
    owner: np.ndarray,
    order: np.ndarray,
    bounds: np.ndarray,
    meta: dict[str, np.ndarray],
    members: np.ndarray,
    rows: pa.Table,
    per_step_bytes: np.ndarray,
    connections: dict[int, pa.Table],
) -> Iterator[tuple[int, bytes]]:
    ws, live = p.window_start, len(p.records)
    for s in range(n_steps):  # one slice per step of the window: a handful per shard
        who = np.flatnonzero(good & ~np.isnan(declared[:, s]))
        counts = np.bincount(owner[order[bounds[s] : bounds[s + 1]]], minlength=live)[who]
        workers = pa.table(
            {**{k: v[who] for k, v in meta.items()}, "step_time_us": declared[who, s], "rows": counts.astype(np.int32)},
            schema=WORKER_SCHEMA,
        )
        missing = np.setdiff1d(members, meta["rank"][who])  # members that sent nothing for the step
        base = StepSlice(
            job=p.job,
            window=p.window,
            step=ws + s,
            window_start=ws,
            window_steps=n_steps,
            expected_workers=p.expected_workers,
            shard=p.shard,
            missing=missing.tolist() if missing.size <= MAX_NAMED_MISSING else [],  # what older readers see
            missing_ranges=ranks_as_ranges(missing),
            workers=b"",
            functions=b"",
            policy=p.policy,
            tenant=p.tenant,
            connections=ft.pack(connections[s]) if s in connections else b"",
        )
        functions = rows.slice(int(bounds[s]), int(bounds[s + 1] - bounds[s]))
        for value in _encoded(base, workers, functions, per_step_bytes[who]):
            yield ws + s, value


def _present(t: pa.Table) -> pa.Schema:
    """The compact schema restricted to the columns ``t`` has (what the slice carries: nothing nobody sent)."""
    names = set(t.column_names)
    return pa.schema([f for f in ft.COMPACT_SCHEMA if f.name in names], metadata=ft.COMPACT_SCHEMA.metadata)


def _encoded(base: StepSlice, workers: pa.Table, functions: pa.Table, sizes: np.ndarray) -> list[bytes]:
    """The slice as records, cut in halves by workers (their rows and connections with them) until each fits
    :data:`SLICE_MAX_BYTES`."""
    value = encode(_with(base, workers, functions, sizes))
    if len(value) <= SLICE_MAX_BYTES or workers.num_rows < 2:
        return [value]
    half = workers.num_rows // 2
    split = int(np.asarray(workers.column("rows"))[:half].sum())
    first, rest = base, base
    if base.connections:
        conns = ft.unpack_ipc(base.connections)
        mine = pc.is_in(conns.column("worker"), value_set=workers.column("rank").slice(0, half))
        first = msgspec.structs.replace(base, connections=ft.pack(conns.filter(mine)))
        rest = msgspec.structs.replace(base, connections=ft.pack(conns.filter(pc.invert(mine))))
    return _encoded(first, workers.slice(0, half), functions.slice(0, split), sizes[:half]) + _encoded(
        rest, workers.slice(half), functions.slice(split), sizes[half:]
    )


def _with(base: StepSlice, workers: pa.Table, functions: pa.Table, sizes: np.ndarray) -> StepSlice:
    packed, size = ft.pack_lz4(functions)
    return msgspec.structs.replace(
        base,
        workers=ft.pack(workers),
        functions=packed,
        functions_codec="lz4",
        functions_size=size,
        bytes_in=int(sizes.sum()),
    )
