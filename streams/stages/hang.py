"""The hang stage: agents' answers to a hang trigger (``HangReport``) -> the findings of who holds the job.

A hang window's answers meet in the job's partition of the hangs topic.  Once every expected worker answered,
or :data:`ANSWER_WAIT_S` after the first answer (a worker that does not answer is part of the diagnosis), the
answers go to :func:`~lockstep.streams.diagnosis.hang.diagnose_hang` and its findings to the findings topic (the
sink stores and pages them like any).  Each window is diagnosed once per processor; a replay after a restart gives
the same findings (deterministic ids; the sink upserts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import HangReport, RecordError, decode
from ..diagnosis.hang import diagnose_hang
from ..windows import Handle
from .base import Clock, HoldingStage, Output, Partition, RecordIn

log = logging.getLogger("lockstep.processor")

#: how long a hang window waits for its last answers after the first came
ANSWER_WAIT_S = 5.0
#: windows diagnosed, remembered so that a late answer does not diagnose again (per processor)
DONE_MEMORY = 4096


@dataclass
class _Pending:
    job: str
    expected: int
    first_at: float
    source: Partition
    reports: list[HangReport] = field(default_factory=list)
    handles: list[Handle[RecordIn]] = field(default_factory=list)


class HangStage(HoldingStage):
    """``topics.hangs`` -> hang diagnosis -> ``topics.findings``."""

    name = "hangs"

    def __init__(
        self, topics: Topics, out: Output, metrics: Metrics, clock: Clock = time.time, wait_s: float = ANSWER_WAIT_S
    ):
        super().__init__(topics, out, metrics, clock)
        self.wait_s = wait_s
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.done: dict[tuple[str, str], float] = {}

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        for record in records:
            await self._one(record)

    async def _one(self, record: RecordIn) -> None:
        h = self.hold(record)
        try:
            rep = decode(record.value, HangReport)
        except RecordError as err:
            await self.dead_letter(record, err)
            await self.release([h])
            return
        key = (rep.job, rep.window)
        self.metrics.inc("hang_reports_total")
        if key in self.done:
            await self.release([h])
            return
        p = self.pending.get(key)
        if p is None:
            p = self.pending[key] = _Pending(rep.job, rep.expected_workers, self.clock(), record.source)
        p.reports.append(rep)
        p.handles.append(h)
        if len({r.worker for r in p.reports}) >= p.expected:
            await self._finish(key)

    async def on_timer(self, now: float) -> None:
        for key in [k for k, p in self.pending.items() if now - p.first_at >= self.wait_s]:
            await self._finish(key)

    async def _finish(self, key: tuple[str, str]) -> None:
        p = self.pending.pop(key)
        self.done[key] = self.clock()
        while len(self.done) > DONE_MEMORY:
            self.done.pop(next(iter(self.done)))
        try:
            found = diagnose_hang(key[0], key[1], p.reports, p.expected, now=self.clock())
        except Exception as exc:  # a bug: the answers go to the dead-letter topic, the stage goes on
            await self.failed([h.item for h in p.handles], exc)
            await self.release(p.handles)
            return
        delivered = [await self.send(self.topics.findings, p.job, f) for f in found]
        for d in delivered:
            await d
        log.info(
            "hang window %s of %s: %d answer(s) of %d, %d finding(s): %s",
            key[1],
            key[0],
            len({r.worker for r in p.reports}),
            p.expected,
            len(found),
            "; ".join(f.summary for f in found)[:500],
        )
        for f in found:
            self.metrics.inc("findings_total", cause=f.cause)
        await self.release(p.handles)

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        gone = set(partitions)
        for key in [k for k, p in self.pending.items() if p.source in gone]:
            del self.pending[key]
        self.acks.drop(partitions)
