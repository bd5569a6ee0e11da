"""The detect stage in memory, fed by the heartbeat stage's partials: triggers and the table that carries a job's
last window across restarts, hang checks through a tick in the job's own partition, the step-time series, records
from the future, revoked partitions; every heartbeat acknowledged once its partial was sent."""

from __future__ import annotations

from lockstep.kafka import Topics
from lockstep.schemas.records import (
    DetectorTick,
    JobChange,
    ProfileTrigger,
    StepHeartbeat,
    StepSeries,
    TriggerRefused,
    TriggerRequest,
)
from lockstep.streams.stages import Partition

TOPICS = Topics.named("t")  # the pair's
T0 = 1.8e9


def heartbeats(p, steps, step_time_s=0.2, workers=8, interval=0.2) -> list:
    """Each step's heartbeats, the pair's clock at their arrival (50 ms after they were sent)."""
    out = []
    for step in steps:
        sent = T0 + step * interval
        out.append(
            (
                sent + 0.05,
                [
                    p.produce(
                        TOPICS.heartbeats,
                        "j",
                        StepHeartbeat(
                            job="j",
                            worker=w,
                            step=step,
                            step_time_s=step_time_s * (1 + 0.001 * w),
                            host=f"h{w}",
                            sent_at=sent,
                        ),
                    )
                    for w in range(workers)
                ],
            )
        )
    return out


async def run(p, beats, batch=False) -> None:
    """Each step's heartbeats to the heartbeat stage, its partials (and what it forwarded) to the detect stage."""
    for now, records in beats:
        p.clock.t = now
        await p.feed(records, batch=batch)
        await p.pump()


def control(p) -> list:
    return p.sent(TOPICS.control)


async def slowed_down(p) -> ProfileTrigger:
    await run(p, heartbeats(p, range(40)))
    assert control(p) == []
    await run(p, heartbeats(p, range(40, 60), step_time_s=0.3))
    (trigger,) = control(p)
    assert isinstance(trigger, ProfileTrigger) and trigger.kind == "slowdown"
    return trigger


async def test_a_slowdown_triggers_a_window_and_the_table_keeps_it(pair):
    p = pair()
    t = await slowed_down(p)
    assert p.out.records(TOPICS.control)[0].key == b"j"
    assert p.tables.detector == {"j": f"{t.start_step},{t.start_step + t.steps}"}
    assert p.proc.metrics.get("triggers_total", kind="slowdown") == 1
    assert p.acked(TOPICS.heartbeats) == list(range(60 * 8))  # each heartbeat once, in order


async def test_a_batch_of_heartbeats_decides_as_one_at_a_time(pair):
    one, many = pair(), pair()
    for p, batch in ((one, False), (many, True)):
        await run(p, heartbeats(p, range(40)), batch)
        await run(p, heartbeats(p, range(40, 60), step_time_s=0.3), batch)
    assert control(one) == control(many) and len(control(one)) == 1
    assert one.acked(TOPICS.heartbeats) == many.acked(TOPICS.heartbeats)


async def test_a_restarted_processor_keeps_the_jobs_cooldown_from_the_table(pair):
    p = pair()
    t = await slowed_down(p)
    after = range(t.start_step + t.steps, t.start_step + t.steps + 10)
    request = TriggerRequest(job="j", request="r1")
    answers = []
    for restarted in (pair(tables=p.tables), pair()):  # with the old table, and without it
        await run(restarted, heartbeats(restarted, after, step_time_s=0.3))
        await restarted.feed([restarted.produce(TOPICS.heartbeats, "j", request)])  # forwarded to the partials topic
        await restarted.pump()
        answers += control(restarted)
    refused, accepted = answers
    assert isinstance(refused, TriggerRefused) and refused.code == "cooldown" and refused.request == "r1"
    assert isinstance(accepted, ProfileTrigger) and accepted.kind == "manual"


async def test_a_hang_is_checked_by_a_tick_the_timer_sends_into_the_jobs_partition(pair):
    p = pair(partitions=3)
    beats = heartbeats(p, range(40))
    await run(p, beats)
    last = p.clock.t
    await p.proc.detect.on_timer(last + 29.0)
    assert [
        r for r in p.sent(TOPICS.partials) if isinstance(r, DetectorTick)
    ] == []  # not silent long enough (hang_min_s 30)
    p.clock.t = last + 31.0
    await p.proc.detect.on_timer(p.clock.t)
    (tick,) = [r for r in p.out.records(TOPICS.partials) if r.value.startswith(b'{"schema":"DetectorTick"')]
    assert tick.key == b"j" and tick.partition == beats[0][1][0].partition  # into the job's own partition
    assert (
        p.tables.detector == {} and control(p) == []
    )  # the timer only sent it: the check and the table write happen in the stream
    await p.pump()
    (trigger,) = control(p)
    assert (
        trigger.kind == "hang"
        and trigger.start_step >= 41
        and p.tables.detector["j"].startswith(f"{trigger.start_step},")
    )
    assert p.acked(TOPICS.partials)[-1] == tick.offset


async def test_the_timer_publishes_the_jobs_step_times_and_the_gauges(pair):
    p = pair()
    await run(p, heartbeats(p, range(10)))
    await p.proc.detect.on_timer(p.clock.t)
    (series,) = [r for r in p.sent(TOPICS.series) if isinstance(r, StepSeries)]
    assert series.job == "j" and series.steps == list(range(8)) and series.workers == [8] * 8  # steps 8, 9 still open
    m = p.proc.metrics
    assert (
        m.get("step_series_points_total") == 8 and m.get("detector_jobs") == 1 and m.get("detector_open_windows") == 0
    )


async def test_the_detectors_news_of_a_slowdown_and_of_the_jobs_end_goes_to_the_series_topic(pair):
    p = pair()
    trigger = await slowed_down(p)
    (news,) = [r for r in p.sent(TOPICS.series) if isinstance(r, JobChange)]
    assert (news.change, news.window, news.job) == ("slowdown", trigger.window, "j")
    assert [r.key for r in p.out.records(TOPICS.series)] == [b"j"]
    # every worker's final heartbeat (of its last step, as an agent's close sends it)
    sent = T0 + 59 * 0.2
    p.clock.t = sent + 0.05
    for w in range(8):
        hb = StepHeartbeat(job="j", worker=w, step=59, step_time_s=0.3, host=f"h{w}", sent_at=sent, final=True)
        await p.feed([p.produce(TOPICS.heartbeats, "j", hb)])
    await p.pump()
    await p.proc.detect.on_timer(p.clock.t)  # the heartbeat stage's news goes out with its next partial
    await p.pump()
    ended = [r for r in p.sent(TOPICS.series) if isinstance(r, JobChange) and r.change == "ended"]
    assert [(e.end, e.step) for e in ended] == [("final", 59)]
    assert p.proc.metrics.get("job_changes_total", change="ended") == 1


async def test_a_heartbeat_from_the_future_is_dead_lettered_and_changes_nothing(pair):
    p = pair()
    await run(p, heartbeats(p, range(40)))
    far = p.produce(
        TOPICS.heartbeats,
        "j",
        StepHeartbeat(job="j", worker=0, step=10**9, step_time_s=0.2, host="h0", sent_at=p.clock.t),
    )
    await p.feed([far])
    assert p.dead() == {
        ("heartbeats", "from_the_future"): 1
    }  # refused by the stage that aggregates the job's heartbeats
    assert p.proc.detect.detector.jobs["j"].max_step == 39 and p.acked(TOPICS.heartbeats)[-1] == far.offset


async def test_a_revoked_partition_takes_its_jobs_with_it(pair):
    p = pair()
    await run(p, heartbeats(p, range(10)))
    p.proc.detect.on_revoked({Partition(TOPICS.partials, 1)})  # not the job's
    assert "j" in p.proc.detect.detector.jobs
    p.proc.detect.on_revoked({Partition(TOPICS.partials, 0)})
    assert p.proc.detect.detector.jobs == {} and p.proc.detect.series.jobs == {} and p.proc.detect.job_partition == {}
