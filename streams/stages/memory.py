"""An :class:`Output` in memory: the stages without Kafka (tests, and anything that replays records offline).

:class:`MemoryOutput` is a log of topics: what a stage sends gets a partition (from its key) and
the next offset there, so it can be fed to the next stage as it would be read from Kafka (h11's
"connection pair": the two ends wired to each other in memory).  Deliveries resolve at once, or,
with ``deliver=False``, only when :meth:`MemoryOutput.deliver` says Kafka acknowledged them.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from ...schemas.records import Record, decode
from .base import Partition, RecordIn


@dataclass
class Sent:
    record: RecordIn
    delivered: asyncio.Future[None]


class MemoryOutput:
    def __init__(self, partitions: int = 1, deliver: bool = True):
        self.partitions = partitions
        self.auto_deliver = deliver
        self.sent: list[Sent] = []
        self.acknowledged: list[RecordIn] = []
        self._next: Counter[tuple[str, int]] = Counter()

    def append(self, topic: str, key: bytes | None, value: bytes) -> RecordIn:
        """Write a record to the log (what a producer does) and return it as a consumer reads it."""
        partition = zlib.crc32(key or b"") % self.partitions
        offset = self._next[(topic, partition)]
        self._next[(topic, partition)] += 1
        return RecordIn(Partition(topic, partition), offset, key, value)

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[object]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.auto_deliver:
            done.set_result(None)
        self.sent.append(Sent(self.append(topic, key, value), done))
        return done

    async def acknowledge(self, records: Sequence[RecordIn]) -> None:
        self.acknowledged.extend(records)

    def deliver(self) -> None:
        """Kafka acknowledged everything sent so far."""
        for s in self.sent:
            if not s.delivered.done():
                s.delivered.set_result(None)

    def records(self, topic: str) -> list[RecordIn]:
        """Everything sent to ``topic``, in the order sent."""
        return [s.record for s in self.sent if s.record.topic == topic]

    def decoded(self, topic: str) -> list[Record]:
        return [decode(r.value) for r in self.records(topic)]
