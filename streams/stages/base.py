"""What every stage is made of: the records it is fed, the Output it writes to, the shared guards.

A stage is a plain object fed records (:class:`RecordIn`, one or a batch), timer ticks and
partition changes; everything it does to the world goes through an :class:`Output` (send a record,
acknowledge input records).  Nothing here knows faust or Kafka clients: the adapter
(:mod:`lockstep.streams.app`) translates faust's events into ``RecordIn`` and implements ``Output``;
:class:`lockstep.streams.stages.memory.MemoryOutput` does it in memory for the tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import Record, RecordError, dead_letter, encode
from ..policy import Policy
from ..windows import Handle, InOrderAcks

log = logging.getLogger("lockstep.processor")

#: the stages' clock (seconds since the epoch); tests pass their own
Clock = Callable[[], float]
#: the most bytes a stage's open units (steps, shards, windows, heartbeat steps) may hold together by default (the
#: processor's ``stage_budget_mib`` setting); past it the largest closes as it is, counted in ``budget_closes_total``
STAGE_BUDGET_BYTES = 512 << 20


class Partition(NamedTuple):
    """One partition of one topic (equal to aiokafka's and confluent-kafka's ``(topic, partition)``)."""

    topic: str
    partition: int


@dataclass(slots=True)
class RecordIn:
    """One input record as a stage sees it (treat it as immutable); acknowledging it is the Output's business.

    Its partition is one shared :class:`Partition` object (the adapter keeps one per partition): a
    stage keys what it holds by it, per record, without building a new one."""

    source: Partition
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float | None = None  # the producer's CreateTime, seconds

    @property
    def topic(self) -> str:
        return self.source.topic

    @property
    def partition(self) -> int:
        return self.source.partition


class Output(Protocol):
    """Everything a stage does to the world."""

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[object]:
        """Queue a record; the awaitable returned resolves once Kafka acknowledged it."""
        ...

    async def acknowledge(self, records: Sequence[RecordIn]) -> None:
        """Input records done with (the offsets may be committed past them); given in offset order per partition."""
        ...


class Policies:
    """The policy in force (new windows, the detector) and every policy loaded, by ``id@hash``: a window is
    judged under the policy its trigger named, even after a reload."""

    def __init__(self, policy: Policy, metrics: Metrics):
        self.metrics = metrics
        self.current = policy
        self._by_ref: dict[str, Policy] = {}
        self.set(policy)

    def set(self, policy: Policy) -> None:
        self.current = policy
        self._by_ref[policy.ref] = policy
        for ref in self._by_ref:
            self.metrics.set("policy_info", float(ref == policy.ref), policy=ref)

    def for_ref(self, ref: str) -> Policy:
        """The policy a window was opened under (its trigger's ``id@hash``), else the one in force."""
        return self._by_ref.get(ref, self.current)


class Stage:
    """The interface the adapter drives, and the guards every stage shares.

    ``on_records`` takes records of one input topic in offset order per partition (a batch, or one:
    ``on_record``); the stage acknowledges each of them through the Output once what it contributed to
    has been published (in offset order per partition).  ``on_timer`` runs outside the input stream:
    it may send, never write a table (a faust table is written only while a record is processed; a
    stage that needs that sends a record into its own partition instead).  ``on_assigned`` /
    ``on_revoked``: the consumer's partitions changed; a stage forgets what it held of revoked
    partitions (their new owner replays them from the committed offset).
    """

    name = "stage"

    def __init__(self, topics: Topics, out: Output, metrics: Metrics, clock: Clock = time.time):
        self.topics = topics
        self.out = out
        self.metrics = metrics
        self.clock = clock

    async def on_record(self, record: RecordIn) -> None:
        await self.on_records((record,))

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        raise NotImplementedError

    async def on_timer(self, now: float) -> None:
        """Nothing is due by default."""

    def on_assigned(self, partitions: Collection[Partition]) -> None:
        """Nothing to do: what a partition held is rebuilt by replaying it."""

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared by the stages

    async def send(self, topic: str, key: str, record: Record | bytes) -> Awaitable[object]:
        """Publish a record keyed ``key``; the awaitable resolves once Kafka acknowledged it."""
        value = record if isinstance(record, bytes) else encode(record)
        delivered = await self.out.send(topic, key.encode(), value)
        self.metrics.inc("records_out_total", topic=topic)
        self.metrics.inc("bytes_out_total", len(value), topic=topic)
        return delivered

    async def dead_letter(self, record: RecordIn, err: RecordError) -> None:
        """The record goes to the dead-letter topic with the reason, under its own key (not acknowledged here)."""
        dl = dead_letter(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            error=err,
            stage=self.name,
            payload=record.value,
        )
        log.warning("dead letter from %s[%d]@%d: %s", record.topic, record.partition, record.offset, err)
        await self.out.send(self.topics.deadletter, record.key, encode(dl))
        self.metrics.inc(
            "dead_letters_total",
            reason=err.reason,
            stage=self.name,
        )

    async def failed(self, records: Iterable[RecordIn], exc: Exception) -> None:
        """A bug, not bad input (that is caught on the way in): the stage goes on, and the records it could
        not process go to the dead-letter topic, to be replayed once the bug is fixed."""
        records = list(records)
        log.error(
            "%s: processing failed; %d input record(s) go to the dead-letter topic",
            self.name,
            len(records),
            exc_info=exc,
        )
        err = RecordError("processing_failed", f"{type(exc).__name__}: {exc}")
        for record in records:
            await self.dead_letter(record, err)


class HoldingStage(Stage):
    """A stage that holds its input records until what they fed is published: released in offset order
    per partition (:class:`InOrderAcks`), so the committed offset never passes an open step or window."""

    #: the most bytes the open units (steps, shards, windows, heartbeat steps) may hold together; past it the largest
    #: closes as it is (``budget``, counted in ``budget_closes_total``); the processor sets it (``stage_budget_mib``)
    budget_bytes: int = STAGE_BUDGET_BYTES

    def __init__(self, topics: Topics, out: Output, metrics: Metrics, clock: Clock = time.time):
        super().__init__(topics, out, metrics, clock)
        self.acks: InOrderAcks[RecordIn] = InOrderAcks()

    def hold(self, record: RecordIn) -> Handle[RecordIn]:
        return self.acks.hold(record.source, record.offset, record)

    async def release(self, handles: Iterable[Handle[RecordIn]]) -> None:
        done = self.acks.release(handles)
        if done:
            await self.out.acknowledge(done)


C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)


class Assembler(Protocol[C_co]):
    """What :class:`AssemblingStage` needs of its assembler (``StepAssembler``, ``ShardAssembler``,
    ``WindowAssembler``)."""

    held_bytes: int  # what the open units' tables hold

    def __len__(self) -> int: ...  # the open units

    def close_largest(self) -> C_co | None: ...

    def drop(self, partitions: Collection[Partition]) -> None: ...


class TimedAssembler(Assembler[C_co], Protocol[C_co]):
    """An assembler whose units time out on their own (``StepAssembler``, ``ShardAssembler``)."""

    def expire(self, now: float) -> Sequence[C_co]: ...


class AssemblingStage(HoldingStage, Generic[C]):
    """A holding stage whose records go into an assembler until a unit (a step, a shard, a window) is complete or
    timed out.

    Subclasses name their assembler (:attr:`assembler_class`, made with the stage's timeout) and the gauge of its
    open units (:attr:`open_gauge`), and say how a record is added (:meth:`_add`: the unit it closed, if any, and
    whether it came too late) and what a closed unit becomes (:meth:`_finish`); the handling of bad records, bugs,
    late records, the memory budget, timeouts and revoked partitions is this class's.
    """

    assembler_class: Callable[[float], Assembler[C]]
    assembler: Assembler[C]
    #: the gauge of the open units, set after every batch of records
    open_gauge: str

    def __init__(
        self,
        topics: Topics,
        out: Output,
        policies: Policies,
        metrics: Metrics,
        timeout_s: float,
        clock: Clock = time.time,
    ):
        super().__init__(topics, out, metrics, clock)
        self.policies = policies
        self.assembler = self.assembler_class(timeout_s)

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        for record in records:
            await self._one(record)
        self.metrics.set(self.open_gauge, len(self.assembler))

    async def _add(self, record: RecordIn, handle: Handle[RecordIn]) -> tuple[C | None, bool]:
        raise NotImplementedError

    async def _finish(self, closed: C) -> None:
        raise NotImplementedError

    async def _one(self, record: RecordIn) -> None:
        h = self.hold(record)
        try:
            closed, late = await self._add(record, h)
        except RecordError as err:
            await self.dead_letter(record, err)
            await self.release([h])
            return
        except Exception as exc:  # a bug, not bad input: the record must not stop the stage (again after every restart)
            await self.failed([record], exc)
            await self.release([h])
            return
        if late:
            self.metrics.inc("late_records_total", stage=self.name)
            await self.release([h])
        elif closed is not None:
            await self._finish(closed)
        while self.assembler.held_bytes > self.budget_bytes and (largest := self.assembler.close_largest()):
            self.metrics.inc("budget_closes_total", stage=self.name)
            await self._finish(largest)

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        self.assembler.drop(partitions)
        self.acks.drop(partitions)


class TimedAssemblingStage(AssemblingStage[C]):
    """An assembling stage whose units close on the assembler's own timeout (the step and shard stages)."""

    assembler: TimedAssembler[C]

    async def on_timer(self, now: float) -> None:
        """Units that waited the assembler's timeout for their last workers close without them."""
        for closed in self.assembler.expire(now):
            await self._finish(closed)
