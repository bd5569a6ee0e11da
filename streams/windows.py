"""Step and window assembly as pure state machines (no Kafka, no clock of their own).

Fed records and the current time, they say when a step or a window is complete
(or has waited too long) and which input records may now be acknowledged.
The step and window stages (:mod:`lockstep.streams.stages`) are built on them;
the tests drive them entirely in memory.

Crash safety rests on :class:`InOrderAcks`: a record is acknowledged only when
every earlier record of its partition is done, so the committed offset never
passes a record whose step or window is still open.  After a crash the
processor replays from the committed offset and rebuilds what was open.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import pyarrow as pa

from ..schemas.records import FeatureBatch, StepReport, StepSlice, WindowExpected, WindowFeatures
from .diagnosis.step import StepResult

T = TypeVar("T")
#: why an assembler closed a step, a shard or a window: all of it came (``complete``), its time ran out
#: (``timeout``), or it was closed early because the stage held more than its memory budget (``budget``)
CloseReason = Literal["complete", "timeout", "budget", "refused"]


class Handle(Generic[T]):
    """One held input record; ``item`` is what the caller acknowledges (the stages: a ``RecordIn``).
    The assemblers below are generic in it too: they only keep the handles of what they collect."""

    __slots__ = ("done", "item", "offset", "partition")

    def __init__(self, partition: Hashable, offset: int, item: T):
        self.partition = partition
        self.offset = offset
        self.item = item
        self.done = False


class InOrderAcks(Generic[T]):
    """Releases held records for acknowledgement strictly in offset order per partition."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[Handle[T]]] = {}

    def hold(self, partition: Hashable, offset: int, item: T) -> Handle[T]:
        h = Handle(partition, offset, item)
        self._queues.setdefault(partition, deque()).append(h)
        return h

    def release(self, handles: Iterable[Handle[T]]) -> list[T]:
        """Mark handles done; return the items that can be acknowledged now, in order."""
        touched = set()
        for h in handles:
            h.done = True
            touched.add(h.partition)
        out = []
        for p in touched:
            q = self._queues.get(p)
            while q and q[0].done:
                out.append(q.popleft().item)
        return out

    def drop(self, partitions: Collection[Hashable]) -> None:
        """Partitions revoked: forget them (the new owner replays from the committed offset)."""
        for p in partitions:
            self._queues.pop(p, None)

    def held(self) -> int:
        return sum(len(q) for q in self._queues.values())


# --------------------------------------------------------------------------- what the assemblers share


class _Pending(Protocol):
    partition: Hashable
    opened_at: float
    held: int  # bytes of the tables it holds


K = TypeVar("K", bound=Hashable)
P = TypeVar("P", bound=_Pending)
C = TypeVar("C")


class _Assembler(Generic[K, P, C]):
    """What the step, shard and window assemblers share: the open entries by key and the bytes they hold, the keys
    closed lately (``remember`` of them: a record for one is late), closing one (the largest, for the memory
    budget) and forgetting a revoked partition's.  A subclass says how a closed entry is returned (:meth:`_closed_as`)."""

    def __init__(self, timeout_s: float, remember: int = 100_000):
        self.timeout_s = timeout_s
        self._open: dict[K, P] = {}
        self._closed: OrderedDict[K, None] = OrderedDict()
        self._remember = remember
        self.held_bytes = 0  # the open entries' tables

    def _closed_as(self, pending: P, reason: CloseReason) -> C:
        raise NotImplementedError

    def _hold(self, p: P, nbytes: int) -> None:
        p.held += nbytes
        self.held_bytes += nbytes

    def _close(self, key: K, reason: CloseReason) -> C:
        p = self._open.pop(key)
        self.held_bytes -= p.held
        self._closed[key] = None
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
        return self._closed_as(p, reason)

    def _largest(self) -> K | None:
        return max(self._open, key=lambda k: self._open[k].held) if self._open else None

    def close_largest(self) -> C | None:
        """The open entry holding the most bytes, closed as it is (reason ``budget``); None when none is open."""
        key = self._largest()
        return None if key is None else self._close(key, "budget")

    def drop(self, partitions: Collection[Hashable]) -> None:
        for k in [k for k, p in self._open.items() if p.partition in partitions]:
            self.held_bytes -= self._open.pop(k).held

    def __len__(self) -> int:
        """The open entries."""
        return len(self._open)


class _TimedAssembler(_Assembler[K, P, C]):
    """An assembler whose entries time out ``timeout_s`` after they opened."""

    def expire(self, now: float) -> list[C]:
        due = [k for k, p in self._open.items() if now - p.opened_at >= self.timeout_s]
        return [self._close(k, "timeout") for k in due]


class HeldBatch(NamedTuple, Generic[T]):
    """One worker's FeatureBatch held by its step: the record, its function table, its handle."""

    record: FeatureBatch
    table: pa.Table
    handle: Handle[T]


class HeldSlice(NamedTuple, Generic[T]):
    """A shard's StepSlice held by its step: the record, its per-worker and per-function tables, its handle."""

    record: StepSlice
    workers: pa.Table
    functions: pa.Table
    handle: Handle[T]


class HeldFeatures(NamedTuple, Generic[T]):
    """One worker's WindowFeatures held by its shard: the record, its table, its size on the wire, its handle."""

    record: WindowFeatures
    table: pa.Table
    size: int
    handle: Handle[T]


@dataclass
class _Opened:
    """What a pending step, shard or window knows from the record that opened it."""

    job: str
    window: str
    window_start: int
    window_steps: int
    expected_workers: int
    policy: str
    tenant: str
    partition: Hashable
    opened_at: float


def _opening(rec: FeatureBatch | StepSlice | WindowFeatures, handle: Handle[T], now: float) -> dict[str, Any]:
    """The :class:`_Opened` fields of a pending step or shard, from the record that opens it."""
    return dict(
        job=rec.job,
        window=rec.window,
        window_start=rec.window_start,
        window_steps=rec.window_steps,
        expected_workers=rec.expected_workers,
        policy=rec.policy,
        tenant=rec.tenant,
        partition=handle.partition,
        opened_at=now,
    )


# --------------------------------------------------------------------------- steps


@dataclass
class PendingStep(_Opened, Generic[T]):
    step: int
    batches: dict[int, HeldBatch[T]] = field(default_factory=dict)  # by rank
    replaced: list[HeldBatch[T]] = field(default_factory=list)  # twins a later record of the rank replaced
    slices: list[HeldSlice[T]] = field(default_factory=list)
    accounted: set[int] = field(default_factory=set)  # ranks seen, or declared missing by their shard
    handles: list[Handle[T]] = field(default_factory=list)
    bytes_in: int = 0
    held: int = 0  # bytes of the tables it holds (decompressed)


@dataclass
class ClosedStep(Generic[T]):
    pending: PendingStep[T]
    reason: CloseReason


class StepAssembler(_TimedAssembler[tuple[str, int], PendingStep[T], ClosedStep[T]]):
    """Collects a step's workers: one FeatureBatch per worker, or StepSlices of many (a shard's); closes when every
    expected worker is accounted for (seen, or declared missing by its shard) or on a timeout."""

    def __init__(self, timeout_s: float, remember: int = 100_000):
        super().__init__(timeout_s, remember)
        self.late = 0  # records for steps already closed

    def _closed_as(self, pending: PendingStep[T], reason: CloseReason) -> ClosedStep[T]:
        return ClosedStep(pending, reason)

    def add(
        self, batch: FeatureBatch, table: pa.Table, size: int, handle: Handle[T], now: float
    ) -> tuple[ClosedStep[T] | None, bool]:
        """A worker's FeatureBatch.  Returns (the step if this record completed it, whether the record was late)."""
        p = self._pending(batch, handle, now)
        if p is None:
            return None, True
        twin = p.batches.get(batch.worker.rank)
        if twin is not None:
            p.replaced.append(twin)
        p.batches[batch.worker.rank] = HeldBatch(batch, table, handle)  # a redelivered record replaces its twin
        p.accounted.add(batch.worker.rank)
        p.bytes_in += size
        self._hold(p, table.nbytes)
        return self._complete(p), False

    def add_slice(
        self, sl: StepSlice, workers: pa.Table, functions: pa.Table, handle: Handle[T], now: float
    ) -> tuple[ClosedStep[T] | None, bool]:
        """A shard's slice of the step (``workers``: its per-worker table; a replayed slice adds nothing new)."""
        p = self._pending(sl, handle, now)
        if p is None:
            return None, True
        p.slices.append(HeldSlice(sl, workers, functions, handle))
        p.accounted.update(workers.column("rank").to_pylist())
        p.accounted.update(sl.missing_workers())
        p.bytes_in += sl.bytes_in
        self._hold(p, workers.nbytes + functions.nbytes)
        return self._complete(p), False

    def _pending(self, rec: FeatureBatch | StepSlice, handle: Handle[T], now: float) -> PendingStep[T] | None:
        """The open step of a record (opened by it if need be); None if the step closed already (the record is late)."""
        key = (rec.job, rec.step)
        if key in self._closed:
            self.late += 1
            return None
        p = self._open.get(key)
        if p is None:
            p = self._open[key] = PendingStep(**_opening(rec, handle, now), step=rec.step)
        p.handles.append(handle)
        return p

    def _complete(self, p: PendingStep[T]) -> ClosedStep[T] | None:
        if len(p.accounted) >= p.expected_workers:
            return self._close((p.job, p.step), "complete")
        return None


# --------------------------------------------------------------------------- shards


@dataclass
class PendingShard(_Opened, Generic[T]):
    shard: int
    shard_workers: int
    members: range  # the ranks the shard expects
    records: dict[int, HeldFeatures[T]] = field(default_factory=dict)  # by rank
    replaced: list[HeldFeatures[T]] = field(default_factory=list)  # twins a later record replaced
    present: int = 0  # members that sent their record
    handles: list[Handle[T]] = field(default_factory=list)
    held: int = 0  # bytes of the tables it holds (decompressed)


@dataclass
class ClosedShard(Generic[T]):
    pending: PendingShard[T]
    reason: CloseReason


class ShardAssembler(_TimedAssembler[tuple[str, str, int, int], PendingShard[T], ClosedShard[T]]):
    """Collects the WindowFeatures of one shard of a window (ranks ``shard * shard_workers`` onwards); closes when every
    member's record is in, or on a timeout."""

    def _closed_as(self, pending: PendingShard[T], reason: CloseReason) -> ClosedShard[T]:
        return ClosedShard(pending, reason)

    def add(
        self, rec: WindowFeatures, table: pa.Table, size: int, handle: Handle[T], now: float
    ) -> tuple[ClosedShard[T] | None, bool]:
        """Returns (the shard if this record completed it, whether the record was late)."""
        key = (rec.job, rec.window, rec.shard, rec.shard_workers)
        if key in self._closed:
            return None, True
        p = self._open.get(key)
        if p is None:
            lo = rec.shard * rec.shard_workers
            p = self._open[key] = PendingShard(
                **_opening(rec, handle, now),
                shard=rec.shard,
                shard_workers=rec.shard_workers,
                members=range(lo, max(lo, min(lo + rec.shard_workers, rec.expected_workers))),
            )
        rank = rec.worker.rank
        twin = p.records.get(rank)
        if twin is not None:
            p.replaced.append(twin)
        elif rank in p.members:
            p.present += 1
        p.records[rank] = HeldFeatures(rec, table, size, handle)  # a redelivered record replaces its twin
        p.handles.append(handle)
        self._hold(p, table.nbytes)
        if p.present >= len(p.members):
            return self._close(key, "complete"), False
        return None, False


# --------------------------------------------------------------------------- windows


@dataclass
class PendingWindow(_Opened, Generic[T]):
    results: dict[int, StepResult] = field(default_factory=dict)  # step -> result (first wins)
    handles: list[Handle[T]] = field(default_factory=list)
    bytes_in: int = 0
    timeout_requested: bool = False
    #: when its first step report came (valid or not); None while only its trigger's notice is in
    first_report_at: float | None = None
    #: no step report by then (the trigger's deadline, plus the timeout): close it ``failed``; None: not announced
    deadline: float | None = None
    #: steps whose report could not be read, with why (first wins): the window closes ``failed``, the others count
    invalid: dict[int, str] = field(default_factory=dict)
    missing: set[int] = field(default_factory=set)  # expected workers a step report named missing ...
    missing_total: int = 0  # ... and the most any step missed (more than it could name)
    held: int = 0  # bytes of the step results' tables it holds
    refused: dict[str, int] = field(default_factory=dict)  # every expected worker refused the trigger: why -> how many

    @property
    def steps_reported(self) -> int:
        return len(self.results) + len(self.invalid.keys() - self.results.keys())


@dataclass
class ClosedWindow(Generic[T]):
    pending: PendingWindow[T]
    reason: CloseReason


class WindowAssembler(_Assembler[tuple[str, str], PendingWindow[T], ClosedWindow[T]]):
    """Collects the step reports of a window; closes when every step reported (an unreadable report counts as
    reported, and is remembered), or on request.  A window announced by its trigger (:meth:`expect`) is open before
    any step report comes, so that it closes even if none ever does."""

    def __init__(self, timeout_s: float):
        super().__init__(timeout_s, remember=0)  # a step report for a closed window opens it again

    def _closed_as(self, pending: PendingWindow[T], reason: CloseReason) -> ClosedWindow[T]:
        return ClosedWindow(pending, reason)

    def _window(
        self, rec: StepReport | WindowExpected, handle: Handle[T], now: float
    ) -> tuple[tuple[str, str], PendingWindow[T]]:
        key = (rec.job, rec.window)
        w = self._open.get(key)
        if w is None:
            if isinstance(rec, WindowExpected):
                start, steps, policy = rec.start_step, rec.steps, rec.policy
            else:
                start, steps, policy = rec.window_start, rec.window_steps, rec.policy
            w = self._open[key] = PendingWindow(
                job=rec.job,
                window=rec.window,
                window_start=start,
                window_steps=steps,
                expected_workers=rec.expected_workers,
                policy=policy,
                tenant=rec.tenant,
                partition=handle.partition,
                opened_at=now,
            )
        w.handles.append(handle)
        return key, w

    def expect(self, notice: WindowExpected, handle: Handle[T], now: float) -> None:
        """The trigger's notice: the window is open from now on, and fails if no step report came by its deadline."""
        _, w = self._window(notice, handle, now)
        w.deadline = max(notice.deadline, now) + self.timeout_s

    def add(self, report: StepReport, result: StepResult, handle: Handle[T], now: float) -> ClosedWindow[T] | None:
        key, w = self._window(report, handle, now)
        if w.first_report_at is None:
            w.first_report_at = now
        if report.step not in w.results:  # a replayed duplicate never replaces the first report
            w.results[report.step] = result
            self._hold(w, result.outliers.nbytes + result.groups.nbytes)
            w.bytes_in += report.bytes_in
            # an expected worker missing from a step (it refused the trigger, was late, failed): the window is not
            # complete (the window stage closes it as a timeout that names them)
            w.missing.update(report.missing)
            short = max(report.missing_total, report.expected_workers - report.workers_seen)
            w.missing_total = max(w.missing_total, short, len(w.missing))
        return self._complete(key, w)

    def add_invalid(self, report: StepReport, why: str, handle: Handle[T], now: float) -> ClosedWindow[T] | None:
        """A step report whose tables could not be read: the step counts as reported (the window does not wait for
        it) and the window will say why it failed; the other steps still count."""
        key, w = self._window(report, handle, now)
        if w.first_report_at is None:
            w.first_report_at = now
        w.invalid.setdefault(report.step, why)
        return self._complete(key, w)

    def _complete(self, key: tuple[str, str], w: PendingWindow[T]) -> ClosedWindow[T] | None:
        if w.steps_reported >= w.window_steps:
            return self.close(key, "complete")
        return None

    def hold(self, key: tuple[str, str], handle: Handle[T]) -> bool:
        """Attach a record (e.g. a timeout request) to an open window; False if none is open."""
        w = self._open.get(key)
        if w is None:
            return False
        w.handles.append(handle)
        return True

    def refuse(self, key: tuple[str, str], reasons: dict[str, int]) -> ClosedWindow[T] | None:
        """Every expected worker refused the window's trigger (the detector counted their agents' echoes): it closes
        now with their reasons, unless a step report came (someone profiled it after all: it waits for the rest, or
        its timeout); None when it is not open or waits."""
        w = self._open.get(key)
        if w is None or w.first_report_at is not None:
            return None
        w.refused = dict(reasons)
        return self._close(key, "refused")

    def due(self, now: float) -> list[tuple[str, str]]:
        """Windows past their timeout (from their first step report) or, with no step report yet, past their
        deadline, for which no close was requested yet (marks them requested)."""
        out = []
        for k, w in self._open.items():
            if w.timeout_requested:
                continue
            if w.first_report_at is not None:
                late = now - w.first_report_at >= self.timeout_s
            else:
                late = now >= (w.deadline if w.deadline is not None else w.opened_at + self.timeout_s)
            if late:
                w.timeout_requested = True
                out.append(k)
        return out

    def close(self, key: tuple[str, str], reason: CloseReason) -> ClosedWindow[T] | None:
        """The open window ``key`` closed; None when none is open."""
        return self._close(key, reason) if key in self._open else None

    def close_largest(self) -> ClosedWindow[T] | None:
        """The open window holding the most bytes, closed as it is (reason ``budget``); None when none holds any."""
        key = self._largest()
        return self._close(key, "budget") if key is not None and self._open[key].held else None
