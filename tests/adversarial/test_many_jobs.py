"""Heartbeats of 100,000 job ids must not make every tick of the detect stage's timer visit every job.

Before: the detect stage's 0.5 s timer visited each job on every tick (its hang and lateness checks, endings, idle
jobs, the step-time series, the open windows, the agents' counters): 16.1 s a tick at 100,000 jobs.  Now a tick visits
the jobs with something due (each check keeps its jobs in a heap by due time) and, once, those whose state changed.
The assertions count the jobs the checks visited (``SlowdownDetector.visited``) and what the indexes hold, never time."""

from __future__ import annotations

import asyncio

import pytest

from lockstep.kafka import Topics
from lockstep.metrics import Metrics
from lockstep.schemas.records import DetectorTick, StepPartial, encode
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput
from lockstep.streams.stages.base import Partition, RecordIn
from lockstep.streams.stages.detect import DetectStage

TOPICS = Topics.named("t")
T0 = 1.8e9
JOBS = 100_000


def _partial(job: str, step: int) -> StepPartial:
    sent = T0 + step
    return StepPartial(
        job=job,
        step=step,
        shard=0,
        partition=0,
        workers=8,
        slowest_s=0.2,
        median_s=0.19,
        clock_worker=0,
        clock_sent_at=sent,
        newest_sent_at=sent,
        highest=step,
        members=8,
        world_size=8,
    )


@pytest.mark.slow
def test_a_tick_visits_the_jobs_with_something_due_not_all_100000():
    clock = [T0]
    out = MemoryOutput(1)
    stage = DetectStage(TOPICS, out, {}, Policy(), Metrics(), clock=lambda: clock[0])
    det = stage.detector
    source = Partition(TOPICS.partials, 0)

    async def go():
        for step in range(3):  # three steps a second apart: each job has a pace, so a hang check is scheduled
            clock[0] = T0 + step + 0.05
            for j in range(JOBS):
                det.observe_partial(_partial(f"j{j}", step), clock[0])  # the stage's path, without 300,000 decodes
                stage.job_partition[f"j{j}"] = source
        assert len(det.jobs) == JOBS and not any(st.steps for st in det.jobs.values())

        now = T0 + 3.0
        before = det.visited
        await stage.on_timer(now)  # the heartbeats changed every job: each is rescheduled, once
        assert det.visited - before == JOBS
        assert det.scheduled == (JOBS, 0, JOBS)  # a hang check and an idle time each; no ending

        for _ in range(10):  # nothing new, nothing due: no job visited
            now += 0.5
            before = det.visited
            await stage.on_timer(now)
            assert det.visited == before
        assert out.records(TOPICS.partials) == []  # no tick sent

        # ten jobs go on; the others stay silent
        clock[0] = now
        for j in range(10):
            rec = out.append(TOPICS.partials, f"j{j}".encode(), encode(_partial(f"j{j}", 3)))
            await stage.on_records([RecordIn(rec.source, rec.offset, rec.key, rec.value)])
        before = det.visited
        await stage.on_timer(now + 0.5)
        assert det.visited - before == 10  # only the ten that changed

        # the silent jobs' hang bound (30 s, the policy's hang_min_s) passes: each gets its tick, once
        hang = T0 + 2.05 + Policy().detector.hang_min_s
        before = det.visited
        await stage.on_timer(hang + 0.01)
        ticks = [r.key for r in out.records(TOPICS.partials)]
        assert len(ticks) == JOBS - 10 and len(set(ticks)) == JOBS - 10
        assert det.visited - before <= 2 * JOBS  # popped, then rescheduled once
        before = det.visited
        await stage.on_timer(hang + 0.51)
        assert det.visited - before <= JOBS  # the ticked jobs' next hang check rescheduled; none due
        before = det.visited
        await stage.on_timer(hang + 1.01)
        assert det.visited == before
        assert all(isinstance(d, DetectorTick) for d in out.decoded(TOPICS.partials))

    asyncio.run(go())
    # the heaps hold at most about two entries a job (stale ones are dropped when they outnumber the live ones)
    for d in (det._ticks, det._endings, det._idle):
        assert d.entries <= 2 * len(d) + 64


def test_idle_jobs_are_forgotten_without_visiting_the_others():
    det = DetectStage(TOPICS, MemoryOutput(1), {}, Policy(), Metrics(), clock=lambda: T0).detector
    for j in range(1000):
        det.observe_partial(_partial(f"j{j}", 0), T0 + j)  # job j last heard at T0 + j
    det.forget_idle(T0)
    before = det.visited
    gone = det.forget_idle(T0 + 3600.0 + 9.5)  # jobs 0..9 silent longer than FORGET_AFTER_S
    assert sorted(gone) == [f"j{j}" for j in range(10)] and len(det.jobs) == 990
    assert det.visited - before == 10
    assert det.forget_idle(T0 + 3600.0 + 9.5) == [] and det.scheduled[2] == 990
