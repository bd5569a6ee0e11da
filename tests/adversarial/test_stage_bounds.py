"""Records whose declared or implied sizes would make a stage hold memory without bound: refused with a reason.

Before: a 959 KB HeartbeatBatch of 40,000 workers x 40,000 distinct steps took the processor from 119 MB to 1.74 GB,
and it stayed there (one open step per distinct step, each with a flag per worker of the shard: quadratic)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lockstep.kafka import Topics, heartbeat_key
from lockstep.schemas.records import MAX_BATCH_STEP_SPAN, DeadLetter, HeartbeatBatch, RecordError, decode, encode
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Processor, Tables

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
