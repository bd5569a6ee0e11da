"""Heartbeats as real agents send them, through the heartbeat and detect stages: each rank batches its own heartbeats
every flush interval, and the batches of different hosts arrive in any order, late by up to a few flush intervals.
Every step of every shard goes out once, with every worker, never closed because another worker's later step came
first (no heartbeat is late); the detector counts the job's membership, not the newest step's workers."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.kafka import heartbeat_key
from lockstep.schemas.records import HeartbeatBatch, StepPartial
from tests.streams.stages.conftest import TOPICS, Pair
from tests.tiers import examples

T0 = 1.8e9


def rank_batches(
    job: str, world: int, shard_workers: int, steps: int, interval: float, flush: float, seed: int, report_world: bool
) -> list[tuple[float, bytes, HeartbeatBatch]]:
    """(arrival on the processor's clock, key, batch): each rank's heartbeats since its last flush, one batch per flush
    (at its own phase), delivered 0..2 flush intervals later."""
    rng = random.Random(seed)
    out = []
    for rank in range(world):
        phase = rng.uniform(0, flush)
        ends = [T0 + (s + 1) * interval for s in range(steps)]  # step s ends at ends[s] on every rank (lockstep)
        t = T0 + phase
        s = 0
        while s < steps:
            t += flush
            mine = [i for i in range(s, steps) if ends[i] <= t]
            if not mine:
                continue
            s = mine[-1] + 1
            batch = HeartbeatBatch(
                job=job,
                shard=rank // shard_workers,
                shard_workers=shard_workers,
                host=f"h{rank}",
                worker=[rank] * len(mine),
                step=mine,
                step_time_s=[interval * (1 + 0.01 * rank)] * len(mine),
                sent_at=[ends[i] for i in mine],
                world_size=world if report_world else 0,
            )
            out.append((t + rng.uniform(0, 2 * flush), heartbeat_key(job, rank // shard_workers), batch))
    return sorted(out, key=lambda x: x[0])


async def deliver(p: Pair, arrivals, tick: float = 0.1) -> None:
    """Batches to the heartbeat stage at their arrival, the stage's timer every ``tick``, partials to the detector."""
    clock = arrivals[0][0]
    for at, key, batch in arrivals:
        while clock + tick < at:  # the timer runs between arrivals
            clock += tick
            p.clock.t = clock
            await p.proc.heartbeats.on_timer(clock)
            await p.proc.detect.on_timer(clock)
            await p.pump()
        p.clock.t = at
        await p.feed([p.out.append(TOPICS.heartbeats, key, _encode(batch))])
        await p.pump()
    for _ in range(100):  # the last steps wait at most both lateness bounds (2 s, then the detector's 4 s)
        clock += tick
        p.clock.t = clock
        await p.proc.heartbeats.on_timer(clock)
        await p.proc.detect.on_timer(clock)
        await p.pump()


def _encode(batch: HeartbeatBatch) -> bytes:
    from lockstep.schemas.records import encode

    return encode(batch)


@settings(max_examples=examples(60), deadline=None)
@given(
    world=st.integers(1, 6),
    per_shard=st.sampled_from([0, 2]),  # 0: one shard of every worker
    interval=st.sampled_from([0.01, 0.09, 0.3]),
    flush=st.sampled_from([0.05, 0.2, 0.5]),
    report_world=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_per_rank_batches_in_any_order_assemble_every_step_with_every_worker(
    world, per_shard, interval, flush, report_world, seed
):
    shard_workers = per_shard or world
    steps = 40
    arrivals = rank_batches("j", world, shard_workers, steps, interval, flush, seed, report_world)
    p = Pair()
    asyncio.run(deliver(p, arrivals))
    assert p.proc.heartbeats.shards.late == 0  # not one heartbeat counted late
    partials = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial) and r.workers]
    shards = {r // shard_workers for r in range(world)}
    size = {s: len([r for r in range(world) if r // shard_workers == s]) for s in shards}
    assert sorted((q.shard, q.step) for q in partials) == sorted((s, i) for s in shards for i in range(steps))
    for q in partials:  # each with all of its shard's workers, as soon as they were in
        assert (q.workers, q.members, q.closed, q.missing) == (size[q.shard], size[q.shard], "complete", [])
        assert q.world_size == (world if report_world else 0)
    det = p.proc.detect.detector
    job = det.jobs["j"]
    assert job.last_complete == steps - 1 and not job.steps
    assert det.active_workers(job) == world  # what a trigger would expect


async def _two_ranks(p: Pair, rank1_steps: int, world_size: int = 2) -> None:
    """Rank 0 reports steps 0..9 in one batch, rank 1 ``rank1_steps`` of them a second later."""
    for rank, n, at in ((0, 10, T0 + 1.0), (1, rank1_steps, T0 + 2.0)):
        if not n:
            continue
        p.clock.t = at
        batch = HeartbeatBatch(
            job="j",
            shard=0,
            worker=[rank] * n,
            step=list(range(n)),
            step_time_s=[0.1] * n,
            sent_at=[T0 + 0.1 * (s + 1) for s in range(n)],
            world_size=world_size,
        )
        await p.feed([p.out.append(TOPICS.heartbeats, heartbeat_key("j", 0), _encode(batch))])
        await p.pump()


async def test_a_later_step_of_one_rank_does_not_close_the_steps_the_other_has_not_sent_yet():
    p = Pair()
    await _two_ranks(p, 0)
    assert [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)] == []  # rank 1 is a member: waited for
    await _two_ranks(p, 10)
    partials = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)]
    assert [(q.step, q.workers, q.closed) for q in partials] == [(s, 2, "complete") for s in range(10)]
    assert p.proc.heartbeats.shards.late == 0


async def test_a_missing_rank_is_waited_for_until_the_lateness_bound_and_named():
    p = Pair()
    await _two_ranks(p, 6)  # rank 1 stopped after step 5
    partials = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)]
    assert [q.step for q in partials] == list(range(6))
    wait = p.proc.heartbeats.shards.wait_s(next(iter(p.proc.heartbeats.shards.shards.values())))
    p.clock.t = T0 + 1.0 + wait - 0.01
    await p.proc.heartbeats.on_timer(p.clock.t)
    assert len([r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)]) == 6  # still waiting
    p.clock.t = T0 + 1.0 + wait
    await p.proc.heartbeats.on_timer(p.clock.t)
    late = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)][6:]
    assert [(q.step, q.workers, q.members, q.missing, q.closed) for q in late] == [
        (s, 1, 2, [1], "timeout") for s in range(6, 10)
    ]


async def test_a_world_size_names_members_that_never_reported_and_a_final_heartbeat_ends_one():
    p = Pair()
    await _two_ranks(p, 10, world_size=3)  # rank 2 never reports: its steps wait for it
    assert [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)] == []
    p.clock.t = T0 + 4.0
    await p.proc.heartbeats.on_timer(p.clock.t)
    await p.pump()
    partials = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)]
    assert {(q.workers, q.members, tuple(q.missing), q.closed) for q in partials} == {(2, 3, (2,), "timeout")}
    assert p.proc.detect.detector.active_workers(p.proc.detect.detector.jobs["j"]) == 3
    # rank 1 ends (its final heartbeat): the next steps wait for rank 0 only ... and rank 2, still a member
    final = HeartbeatBatch(
        job="j", shard=0, worker=[1], step=[9], step_time_s=[0.1], sent_at=[T0 + 1.0], final=[0], world_size=3
    )
    await p.feed([p.out.append(TOPICS.heartbeats, heartbeat_key("j", 0), _encode(final))])
    await p.pump()
    (news,) = [r for r in p.sent(TOPICS.partials) if isinstance(r, StepPartial)][10:]
    assert (news.closed, news.final, news.members) == ("news", 1, 2)
