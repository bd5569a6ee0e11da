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
from typing import Generic, TypeVar

import pyarrow as pa

from ..schemas.records import FeatureBatch, StepReport
from .diagnosis.step import StepResult

T = TypeVar("T")


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


# --------------------------------------------------------------------------- steps


@dataclass
class PendingStep(Generic[T]):
    job: str
    window: str
    step: int
    window_start: int
    window_steps: int
    expected_workers: int
    policy: str
    tenant: str
    partition: Hashable
    opened_at: float
    batches: dict[int, tuple[FeatureBatch, pa.Table, Handle[T]]] = field(
        default_factory=dict
    )  # rank -> (record, table, its handle)
    replaced: list[tuple[FeatureBatch, pa.Table, Handle[T]]] = field(
        default_factory=list
    )  # twins a later record of the rank replaced
    handles: list[Handle[T]] = field(default_factory=list)
    bytes_in: int = 0


@dataclass
class ClosedStep(Generic[T]):
    pending: PendingStep[T]
    reason: str  # complete | timeout


class StepAssembler(Generic[T]):
    """Collects one FeatureBatch per worker of a step; closes on the expected count or a timeout."""

    def __init__(self, timeout_s: float, remember: int = 100_000):
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, int], PendingStep[T]] = {}
        self._closed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._remember = remember
        self.late = 0  # records for steps already closed

    def add(
        self, batch: FeatureBatch, table: pa.Table, size: int, handle: Handle[T], now: float
    ) -> tuple[ClosedStep[T] | None, bool]:
        """Returns (the step if this record completed it, whether the record was late)."""
        key = (batch.job, batch.step)
        if key in self._closed:
            self.late += 1
            return None, True
        p = self._open.get(key)
        if p is None:
            p = self._open[key] = PendingStep(
                job=batch.job,
                window=batch.window,
                step=batch.step,
                window_start=batch.window_start,
                window_steps=batch.window_steps,
                expected_workers=batch.expected_workers,
                policy=batch.policy,
                tenant=batch.tenant,
                partition=handle.partition,
                opened_at=now,
            )
        twin = p.batches.get(batch.worker.rank)
        if twin is not None:
            p.replaced.append(twin)
        p.batches[batch.worker.rank] = (batch, table, handle)  # a redelivered record replaces its twin
        p.handles.append(handle)
        p.bytes_in += size
        if len(p.batches) >= p.expected_workers:
            return self._close(key, "complete"), False
        return None, False

    def expire(self, now: float) -> list[ClosedStep[T]]:
        due = [k for k, p in self._open.items() if now - p.opened_at >= self.timeout_s]
        return [self._close(k, "timeout") for k in due]

    def _close(self, key: tuple[str, int], reason: str) -> ClosedStep[T]:
        p = self._open.pop(key)
        self._closed[key] = None
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
        return ClosedStep(p, reason)

    def drop(self, partitions: Collection[Hashable]) -> None:
        for k in [k for k, p in self._open.items() if p.partition in partitions]:
            del self._open[k]

    @property
    def open_steps(self) -> int:
        return len(self._open)


# --------------------------------------------------------------------------- windows


@dataclass
class PendingWindow(Generic[T]):
    job: str
    window: str
    window_start: int
    window_steps: int
    expected_workers: int
    policy: str
    tenant: str
    partition: Hashable
    opened_at: float
    results: dict[int, StepResult] = field(default_factory=dict)  # step -> result (first wins)
    handles: list[Handle[T]] = field(default_factory=list)
    bytes_in: int = 0
    timeout_requested: bool = False


@dataclass
class ClosedWindow(Generic[T]):
    pending: PendingWindow[T]
    reason: str  # complete | timeout


class WindowAssembler(Generic[T]):
    """Collects the step reports of a window; closes when every step reported, or on request."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, str], PendingWindow[T]] = {}

    def add(self, report: StepReport, result: StepResult, handle: Handle[T], now: float) -> ClosedWindow[T] | None:
        key = (report.job, report.window)
        w = self._open.get(key)
        if w is None:
            w = self._open[key] = PendingWindow(
                job=report.job,
                window=report.window,
                window_start=report.window_start,
                window_steps=report.window_steps,
                expected_workers=report.expected_workers,
                policy=report.policy,
                tenant=report.tenant,
                partition=handle.partition,
                opened_at=now,
            )
        w.handles.append(handle)
        if report.step not in w.results:  # a replayed duplicate never replaces the first report
            w.results[report.step] = result
            w.bytes_in += report.bytes_in
        if len(w.results) >= w.window_steps:
            return self.close(key, "complete")
        return None

    def hold(self, key: tuple[str, str], handle: Handle[T]) -> bool:
        """Attach a record (e.g. a timeout request) to an open window; False if none is open."""
        w = self._open.get(key)
        if w is None:
            return False
        w.handles.append(handle)
        return True

    def due(self, now: float) -> list[tuple[str, str]]:
        """Windows past their timeout for which no close was requested yet (marks them requested)."""
        out = []
        for k, w in self._open.items():
            if not w.timeout_requested and now - w.opened_at >= self.timeout_s:
                w.timeout_requested = True
                out.append(k)
        return out

    def close(self, key: tuple[str, str], reason: str) -> ClosedWindow[T] | None:
        w = self._open.pop(key, None)
        return ClosedWindow(w, reason) if w else None

    def drop(self, partitions: Collection[Hashable]) -> None:
        for k in [k for k, w in self._open.items() if w.partition in partitions]:
            del self._open[k]

    @property
    def open_windows(self) -> int:
        return len(self._open)
