"""The heartbeat stage: heartbeats (key ``job/shard``, or ``job``) -> one ``StepPartial`` per shard and step (key ``job``).

One job's ``HeartbeatBatch`` records spread over partitions by worker shard, so several processors share a job's
heartbeats; each reduces its shards' heartbeats of a step to a partial (:class:`~lockstep.streams.heartbeats.HeartbeatShards`),
and the detect stage, which owns the job (its partials' partition), combines them.  ``StepHeartbeat`` records (key
``job``) are one more shard of their partition.  A batch of records is decoded record by record (msgspec) and
aggregated shard by shard in columns (numpy).  The input records are acknowledged once every partial they fed is
sent, in offset order per partition: a replay after a crash rebuilds the open steps, and sends again partials the
detector already has (it keeps the first of each shard).

Operators' ``TriggerRequest``s (and ``DetectorTick``s of older processors) travel on the heartbeats topic
keyed ``job``: they are forwarded as they are to the partials topic, where the job's detector reads them.  This stage
writes no table, so the adapter may hand it batches that cross partitions.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import numpy as np

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import (
    DetectorTick,
    Echo,
    HeartbeatBatch,
    RecordError,
    StepHeartbeat,
    StepPartial,
    TriggerRequest,
    WorkerCounters,
    decode,
)
from ..heartbeats import LATENESS_S, LATENESS_STEPS, HeartbeatShards, Held, Rows, ShardKey
from ..windows import Handle
from .base import Clock, HoldingStage, Output, Partition, RecordIn

#: the shard of ``StepHeartbeat`` records (key ``job``: all of a job's in one partition)
RECORDS_SHARD = -1


class _Group:
    """One shard's rows and news in one batch."""

    __slots__ = (
        "helds",
        "holder",
        "news",
        "sent_at",
        "shard_workers",
        "step",
        "step_time_s",
        "tenant",
        "worker",
        "world_size",
    )

    def __init__(self, tenant: str):
        self.tenant = tenant
        self.world_size = 0  # the largest the records reported (0: none did)
        self.shard_workers = 0  # of the HeartbeatBatch records (0: StepHeartbeat records, one shard of every worker)
        self.worker: list[int] = []
        self.step: list[int] = []
        self.step_time_s: list[float] = []
        self.sent_at: list[float] = []
        self.holder: list[int] = []
        self.helds: list[Held[Handle[RecordIn]]] = []
        self.news: dict[
            int, tuple[list[int], list[Echo], list[WorkerCounters]]
        ] = {}  # held -> (workers of final heartbeats, echoes, counters)

    def batch(self, rec: HeartbeatBatch, held: Held[Handle[RecordIn]]) -> None:
        i = len(self.helds)
        self.helds.append(held)
        self.world_size = max(self.world_size, rec.world_size)
        self.shard_workers = rec.shard_workers
        worker, step, step_time_s, sent_at = rec.worker, rec.step, rec.step_time_s, rec.sent_at
        ended = [worker[j] for j in rec.final]
        if rec.final:  # a worker's last heartbeat says it shuts down: news, not a step
            final = set(rec.final)
            keep = [j for j in range(len(worker)) if j not in final]
            worker, step = [worker[j] for j in keep], [step[j] for j in keep]
            step_time_s, sent_at = [step_time_s[j] for j in keep], [sent_at[j] for j in keep]
        self.worker += worker
        self.step += step
        self.step_time_s += step_time_s
        self.sent_at += sent_at
        self.holder += [i] * len(worker)
        if rec.final or rec.echoes or rec.agents:
            self.news[i] = (ended, rec.echoes, rec.agents)

    def beat(self, hb: StepHeartbeat, held: Held[Handle[RecordIn]]) -> None:
        i = len(self.helds)
        self.helds.append(held)
        if isinstance(hb.world_size, int):
            self.world_size = max(self.world_size, hb.world_size)
        final = hb.final is True
        if not final:
            self.worker.append(hb.worker)
            self.step.append(hb.step)
            self.step_time_s.append(hb.step_time_s)
            self.sent_at.append(hb.sent_at)
            self.holder.append(i)
        echo = hb.echo()
        echoes = [echo] if echo is not None else []
        agents = [WorkerCounters(worker=hb.worker, counters=hb.agent)] if hb.agent else []
        if final or echoes or agents:
            self.news[i] = ([hb.worker] if final else [], echoes, agents)

    def rows(self) -> Rows:
        return Rows(
            np.asarray(self.worker, dtype=np.int64),
            np.asarray(self.step, dtype=np.int64),
            np.asarray(self.step_time_s, dtype=np.float64),
            np.asarray(self.sent_at, dtype=np.float64),
            np.asarray(self.holder, dtype=np.int64),
        )


class HeartbeatStage(HoldingStage):
    """``topics.heartbeats`` -> :class:`HeartbeatShards` -> ``StepPartial``s on ``topics.partials``."""

    name = "heartbeats"

    def __init__(
        self,
        topics: Topics,
        out: Output,
        metrics: Metrics,
        clock: Clock = time.time,
        lateness_s: float = LATENESS_S,
        lateness_steps: int = LATENESS_STEPS,
    ):
        super().__init__(topics, out, metrics, clock)
        self.shards: HeartbeatShards[Handle[RecordIn]] = HeartbeatShards(lateness_s, lateness_steps)

    @property
    def open_steps(self) -> int:
        return self.shards.open_steps

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        now = self.clock()
        groups: dict[ShardKey, _Group] = {}
        for record in records:
            h = self.hold(record)
            try:
                rec = decode(record.value, (HeartbeatBatch, StepHeartbeat, TriggerRequest, DetectorTick))
            except RecordError as err:
                await self.dead_letter(record, err)
                await self.release([h])
                continue
            if isinstance(rec, (TriggerRequest, DetectorTick)):  # for the job's detector
                await self.send(self.topics.partials, rec.job, record.value)
                await self.release([h])
                continue
            shard = rec.shard if isinstance(rec, HeartbeatBatch) else RECORDS_SHARD
            key = (rec.job, shard, record.partition)
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(rec.tenant)
            if isinstance(rec, HeartbeatBatch):
                group.batch(rec, Held(h))
            else:
                group.beat(rec, Held(h))
        late = self.shards.late
        sent: list[tuple[StepPartial, list[Handle[RecordIn]]]] = []
        for key, group in groups.items():
            try:
                sent += await self._aggregate(key, group, now)
            except Exception as exc:  # a bug, not bad input: the records go to the dead-letter topic, the stage goes on
                await self.failed([held.item.item for held in group.helds], exc)
                for held in group.helds:
                    held.refs = 0
        await self.release(
            [held.item for group in groups.values() for held in group.helds if held.refs == 0]
        )  # fed nothing open
        sent += self.shards.ready(groups.keys(), now)
        while self.shards.held_bytes > self.budget_bytes and (closed := self.shards.close_largest(now)):
            self.metrics.inc("budget_closes_total", stage=self.name)
            sent += closed
        await self._send(sent)
        if self.shards.late > late:  # heartbeats of steps already sent (rows, not records, for this stage)
            self.metrics.inc("late_records_total", self.shards.late - late, stage=self.name)

    async def _aggregate(
        self, key: ShardKey, group: _Group, now: float
    ) -> list[tuple[StepPartial, list[Handle[RecordIn]]]]:
        rows = group.rows()
        bad = self.shards.future(key, rows.step, rows.sent_at, now)
        refused: set[int] = set()
        if bad.any():  # a record that would poison the shard is refused whole
            refused = set(np.unique(rows.holder[bad]).tolist())
            for i in refused:
                mine = rows.holder == i
                err = RecordError(
                    "from_the_future", self.shards.future_detail(key, rows.step[mine], rows.sent_at[mine], now)
                )
                await self.dead_letter(group.helds[i].item.item, err)
            rows = rows.where(~np.isin(rows.holder, list(refused)))
        self.metrics.inc("heartbeats_total", len(rows))
        out = self.shards.add(key, group.tenant, rows, group.helds, now, group.world_size, group.shard_workers)
        for i, (ended, echoes, agents) in group.news.items():
            if i not in refused:
                self.shards.news(key, group.tenant, group.helds[i], len(ended), echoes, agents, ended)
        return out

    async def _send(self, sent: list[tuple[StepPartial, list[Handle[RecordIn]]]]) -> None:
        for partial, done in sent:
            await self.send(self.topics.partials, partial.job, partial)
            self.metrics.inc("step_partials_total", closed=partial.closed)
            await self.release(done)
        self.metrics.set("open_heartbeat_steps", self.shards.open_steps)

    async def on_timer(self, now: float) -> None:
        """Shards' steps that waited too long for their last workers (a hang) go out without them."""
        await self._send(self.shards.expire(now))

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        self.shards.drop({p.partition for p in partitions if p.topic == self.topics.heartbeats})
        self.acks.drop(partitions)
