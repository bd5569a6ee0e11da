"""Records whose declared or implied sizes would make a stage hold memory without bound: refused with a reason.

Before: a 959 KB HeartbeatBatch of 40,000 workers x 40,000 distinct steps took the processor from 119 MB to 1.74 GB,
and it stayed there (one open step per distinct step, each with a flag per worker of the shard: quadratic)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lockstep.kafka import Topics, features_key, heartbeat_key
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import (
    MAX_BATCH_STEP_SPAN,
    DeadLetter,
    HeartbeatBatch,
    RecordError,
    StepPartial,
    WindowReport,
    decode,
    encode,
)
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Partition, Processor, RecordIn, Tables

TOPICS = Topics.named("t")


def _batch(workers: int, steps: int) -> HeartbeatBatch:
    return HeartbeatBatch(
        job="j",
        shard=0,
        shard_workers=100_000,
        worker=list(range(workers)),
        step=(np.arange(workers) % steps).tolist(),
        step_time_s=[0.1] * workers,
        sent_at=[1.8e9] * workers,
    )


def test_a_heartbatch_spanning_more_steps_than_a_flush_covers_is_refused():
    with pytest.raises(RecordError, match=f"over the {MAX_BATCH_STEP_SPAN}"):
        decode(encode(_batch(40_000, 40_000)), HeartbeatBatch)
    decode(encode(_batch(40_000, MAX_BATCH_STEP_SPAN)), HeartbeatBatch)  # the most a batch may span


def test_the_heartbeat_stage_dead_letters_it_and_opens_no_step():
    out = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=lambda: 1.8e9)

    async def go():
        await proc.heartbeats.on_record(
            out.append(TOPICS.heartbeats, heartbeat_key("j", 0), encode(_batch(40_000, 40_000)))
        )

    asyncio.run(go())
    dead = [d for d in out.decoded(TOPICS.deadletter) if isinstance(d, DeadLetter)]
    assert [d.reason for d in dead] == ["invalid"] and proc.heartbeats.open_steps == 0


def test_the_heartbeat_stage_past_its_memory_budget_sends_its_largest_shards_steps_and_holds_no_more():
    """Before: the heartbeat stage held its shards' open steps (a flag per member and step, the step times, the records)
    without a budget: batches of many workers that each open steps no one completes grew it until the lateness bound.
    Now past ``budget_bytes`` (``stage_budget_mib``) the shard holding most sends its open steps as they are."""
    out = MemoryOutput(1, True)
    proc = Processor(
        Policy(),
        TOPICS,
        out,
        Tables(),
        step_timeout_s=5.0,
        window_timeout_s=30.0,
        stage_budget_bytes=256 << 10,
        clock=lambda: 1.8e9,
    )
    assert proc.heartbeats.budget_bytes == 256 << 10

    def batch(job: str, step0: int) -> HeartbeatBatch:  # 20,000 members named by the world size; 500 report 64 steps
        return HeartbeatBatch(
            job=job,
            shard=0,
            shard_workers=20_000,
            world_size=20_000,
            worker=list(range(500)),
            step=[step0 + i % 64 for i in range(500)],
            step_time_s=[0.1] * 500,
            sent_at=[1.8e9] * 500,
        )

    async def go():
        for i in range(6):
            await proc.heartbeats.on_record(
                out.append(TOPICS.heartbeats, heartbeat_key(f"j{i}", 0), encode(batch(f"j{i}", 0)))
            )
            assert proc.heartbeats.shards.held_bytes <= proc.heartbeats.budget_bytes

    asyncio.run(go())
    assert proc.metrics.get("budget_closes_total", stage="heartbeats") >= 1
    partials = [p for p in out.decoded(TOPICS.partials) if isinstance(p, StepPartial)]
    assert partials and {p.closed for p in partials} == {"timeout"}  # sent without their missing workers
    assert out.decoded(TOPICS.deadletter) == []


def test_the_window_stage_past_its_memory_budget_closes_its_largest_window_with_what_it_has():
    """Before: the window stage held every open window's step results (their outlier and group tables) until the
    window completed or timed out, with no budget: windows whose last steps never come held them all.  Now past
    ``budget_bytes`` the window holding most closes ``timeout`` with the reason, and is diagnosed with what it has."""
    out = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=lambda: 1.8e9)
    jobs = [f"j{i}" for i in range(4)]
    reports = []
    for job in jobs:  # windows of 8 steps of which 2 report: they never complete on their own
        sim = FleetSimulator(Scenario(job=job, topology=Topology(workers=4, gpus_per_host=4)))
        trigger = sim.trigger(Window(60, 8))
        for s in (60, 61):
            for b in sim.feature_batches(sim.step(s), trigger, sent_at=1.8e9):
                reports.append(b)

    async def go():
        for b in reports:
            await proc.steps.on_record(out.append(TOPICS.features, features_key(b.job, b.step), encode(b)))
        step_reports = out.records(TOPICS.stepreports)
        assert len(step_reports) == 2 * len(jobs)
        one = step_reports[0]
        await proc.windows.on_record(RecordIn(Partition(one.topic, one.partition), one.offset, one.key, one.value))
        proc.windows.budget_bytes = 3 * proc.windows.assembler.held_bytes  # three step results' worth
        for r in step_reports[1:]:
            await proc.windows.on_record(RecordIn(Partition(r.topic, r.partition), r.offset, r.key, r.value))
            assert proc.windows.assembler.held_bytes <= proc.windows.budget_bytes

    asyncio.run(go())
    assert proc.metrics.get("budget_closes_total", stage="windows") >= 1
    closed = [r for r in out.decoded(TOPICS.windows) if isinstance(r, WindowReport)]
    assert closed and all(r.closed == "timeout" and "stage budget" in r.closed_reason for r in closed)
    assert len(proc.windows.assembler) == len(jobs) - len(closed)
