"""The hang stage in memory: a window's answers -> findings once all came or the wait passed; once per window."""

from __future__ import annotations

from lockstep.kafka import Topics
from lockstep.metrics import Metrics
from lockstep.schemas.records import Finding, HangReport, encode
from lockstep.streams.stages import MemoryOutput
from lockstep.streams.stages.hang import HangStage

TOPICS = Topics.named("t")


def answer(worker: int, frame: str = "graph.py(1): backward", window: str = "hang-1") -> HangReport:
    return HangReport(
        job="j", window=window, worker=worker, host="h", expected_workers=4, last_step=9, frame=frame, sent_at=1.0
    )


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def feed(out: MemoryOutput, stage: HangStage, reps: list[HangReport]):
    return [out.append(TOPICS.hangs, b"j", encode(r)) for r in reps]


async def test_the_windows_findings_come_once_every_worker_answered_and_the_answers_are_acknowledged():
    out, clock = MemoryOutput(), Clock()
    stage = HangStage(TOPICS, out, Metrics(), clock)
    records = feed(out, stage, [answer(0), answer(1), answer(2, "data.py(3): __getitem__"), answer(3)])
    await stage.on_records(records[:3])
    assert out.decoded(TOPICS.findings) == []
    await stage.on_records(records[3:])
    (f,) = out.decoded(TOPICS.findings)
    assert isinstance(f, Finding) and f.workers == [2] and f.cause == "hang"
    assert [r.offset for r in out.acknowledged] == [0, 1, 2, 3]
    await stage.on_records(feed(out, stage, [answer(3)]))  # a late duplicate: no second diagnosis
    assert len(out.decoded(TOPICS.findings)) == 1


async def test_missing_answers_are_waited_for_then_named():
    out, clock = MemoryOutput(), Clock()
    stage = HangStage(TOPICS, out, Metrics(), clock, wait_s=5.0)
    await stage.on_records(feed(out, stage, [answer(0), answer(1), answer(2)]))
    await stage.on_timer(clock.now + 1)
    assert out.decoded(TOPICS.findings) == []
    await stage.on_timer(clock.now + 6)
    (f,) = out.decoded(TOPICS.findings)
    assert f.workers == [3] and "did not answer" in f.summary


async def test_a_bad_record_goes_to_the_dead_letters():
    out, clock = MemoryOutput(), Clock()
    stage = HangStage(TOPICS, out, Metrics(), clock)
    await stage.on_records([out.append(TOPICS.hangs, b"j", b"{not json")])
    assert len(out.records(TOPICS.deadletter)) == 1 and len(out.acknowledged) == 1
