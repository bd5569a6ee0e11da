"""The stages wired to one in-memory log: what a stage sends can be fed to the next one, as Kafka would
(h11's connection pair).  ``async def`` tests run on a fresh event loop each."""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter

import msgspec
import pytest

from lockstep.kafka import Topics
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import FeatureBatch, Record, WindowFeatures, encode
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Processor, RecordIn, Tables

TOPICS = Topics.named("t")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        asyncio.run(pyfuncitem.obj(**{a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}))
        return True
    return None


class Clock:
    def __init__(self, t: float = 1.8e9):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Pair:
    """One processor's stages over a :class:`MemoryOutput`; :meth:`pump` hands what they sent to the stage that reads it."""

    def __init__(
        self,
        *,
        partitions: int = 1,
        deliver: bool = True,
        tables: Tables | None = None,
        out: MemoryOutput | None = None,
        policy: Policy | None = None,
        step_timeout_s: float = 5.0,
        window_timeout_s: float = 30.0,
    ):
        self.clock = Clock()
        self.out = out or MemoryOutput(partitions, deliver)
        self.tables = tables or Tables()
        self.proc = Processor(
            policy or Policy(),
            TOPICS,
            self.out,
            self.tables,
            step_timeout_s=step_timeout_s,
            window_timeout_s=window_timeout_s,
            clock=self.clock,
        )
        self.stage_of = {
            TOPICS.heartbeats: self.proc.heartbeats,
            TOPICS.partials: self.proc.detect,
            TOPICS.windowfeatures: self.proc.shards,
            TOPICS.features: self.proc.steps,
            TOPICS.stepreports: self.proc.windows,
        }
        self._pumped = 0

    def produce(self, topic: str, key: str, record: Record | bytes) -> RecordIn:
        """A producer's record in the log, as the stage reading ``topic`` will get it."""
        return self.out.append(topic, key.encode(), record if isinstance(record, bytes) else encode(record))

    async def feed(self, records: list[RecordIn], batch: bool = False) -> None:
        """Records to the stage of their topic, one at a time or as one batch."""
        if batch:
            await self.stage_of[records[0].topic].on_records(records)
            return
        for r in records:
            await self.stage_of[r.topic].on_record(r)

    async def pump(self) -> int:
        """Everything sent to a stage's topic since the last pump, to that stage, until nothing new; returns how many."""
        n = 0
        while self._pumped < len(self.out.sent):
            r = self.out.sent[self._pumped].record
            self._pumped += 1
            if r.topic in self.stage_of:
                await self.stage_of[r.topic].on_record(r)
                n += 1
        return n

    def acked(self, topic: str) -> list[int]:
        return [r.offset for r in self.out.acknowledged if r.topic == topic]

    def sent(self, topic: str) -> list[Record]:
        return self.out.decoded(topic)

    def dead(self) -> Counter:
        """Dead letters by (stage, reason)."""
        return Counter((d.stage, d.reason) for d in self.sent(TOPICS.deadletter))


@pytest.fixture
def pair():
    return Pair


SIM = FleetSimulator(
    Scenario(
        job="j",
        topology=Topology(workers=8, gpus_per_host=8),
        faults=(Fault(type="gpu_slow", workers=(3,), severity=0.4),),
    )
)
WINDOW = Window(60, 2)


@pytest.fixture(scope="session")
def batches() -> dict[int, list[FeatureBatch]]:
    """Step -> the 8 workers' feature batches of window w60 (2 steps) of job j, worker 3's GPU slow."""
    trigger = SIM.trigger(WINDOW)
    return {s: SIM.feature_batches(SIM.step(s), trigger, sent_at=1.8e9) for s in WINDOW.range}


@pytest.fixture(scope="session")
def healthy_batches() -> dict[int, list[FeatureBatch]]:
    """The same window of a job without a fault (its diagnosis leaves the job's history)."""
    sim = FleetSimulator(Scenario(job="j", topology=Topology(workers=8, gpus_per_host=8)))
    trigger = sim.trigger(WINDOW)
    return {s: sim.feature_batches(sim.step(s), trigger, sent_at=1.8e9) for s in WINDOW.range}


@pytest.fixture(scope="session")
def window_features() -> list[WindowFeatures]:
    """The same window as ``batches``, as agents send it since issue 13: one record per worker, shards of 4 workers."""
    trigger = msgspec.structs.replace(SIM.trigger(WINDOW), shard_workers=4)
    return SIM.window_features([SIM.step(s) for s in WINDOW.range], trigger, sent_at=1.8e9)
