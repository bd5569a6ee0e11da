"""The window stage in memory, fed by the step stage: findings, the window closed only once Kafka acknowledged
them, replays of closed windows, timeouts through the window's own partition, the job's history, a bug, a
revoked partition."""

from __future__ import annotations

import asyncio

from lockstep.kafka import Topics
from lockstep.schemas.records import DeviationMap, Finding, WindowReport, WindowTimeout
from lockstep.streams.diagnosis import JobHistory
from lockstep.streams.stages import Partition
from lockstep.streams.stages import window as window_module

TOPICS = Topics.named("t")  # the pair's


def features(p, batches) -> list:
    return [p.produce(TOPICS.features, f"{b.job}:{b.step}", b) for b in batches]


def findings(p) -> list[Finding]:
    return [f for f in p.sent(TOPICS.findings) if isinstance(f, Finding)]


def window_reports(p) -> list[WindowReport]:
    return [r for r in p.sent(TOPICS.windows) if isinstance(r, WindowReport)]


async def run_window(p, batches) -> None:
    for step in sorted(batches):
        await p.feed(features(p, batches[step]))
    await p.pump()


async def test_a_window_is_diagnosed_from_the_step_stages_reports(pair, batches):
    p = pair()
    await run_window(p, batches)
    assert [(f.workers, f.cause, f.window) for f in findings(p)] == [([3], "gpu_slow", "w60")]
    (report,) = window_reports(p)
    assert (report.closed, report.steps_seen, report.findings, report.coverage) == ("complete", 2, 1, 1.0)
    (dmap,) = [r for r in p.sent(TOPICS.series) if isinstance(r, DeviationMap)]
    assert dmap.window == "w60" and 3 in dmap.workers
    assert p.tables.closed_windows == {"j:w60": p.clock.t}
    assert p.acked(TOPICS.stepreports) == [0, 1] and len(p.proc.windows.assembler) == 0
    m = p.proc.metrics
    assert m.get("windows_closed_total", reason="complete") == 1 and m.get("findings_total", cause="gpu_slow") == 1
    assert m.get("window_close_latency_seconds") == 1 and m.get("open_windows") == 0


async def test_a_window_is_marked_closed_only_once_kafka_acknowledged_its_findings(pair, healthy_batches):
    """Until then a crash must leave it open: the replay then diagnoses it again, with the same finding ids."""
    p = pair(deliver=False)
    for step in sorted(healthy_batches):
        await p.feed(features(p, healthy_batches[step]))
    closing = asyncio.ensure_future(p.pump())
    while not window_reports(p):  # noqa: ASYNC110 - the stage sent the window's report and waits for Kafka's acknowledgement
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not closing.done()
    assert p.tables.closed_windows == {} and p.tables.job_history == {} and p.acked(TOPICS.stepreports) == []
    p.out.deliver()
    await closing
    assert list(p.tables.closed_windows) == ["j:w60"] and p.acked(TOPICS.stepreports) == [0, 1]
    assert JobHistory.decode(p.tables.job_history["j"]).windows == 1  # a healthy window: the job's baseline


async def test_a_crash_before_kafka_acknowledged_replays_the_window_with_the_same_findings(pair, batches):
    first = pair(deliver=False)
    for step in sorted(batches):
        await first.feed(features(first, batches[step]))
    closing = asyncio.ensure_future(first.pump())
    while not window_reports(first):  # noqa: ASYNC110 - the stage runs in the task above: let it
        await asyncio.sleep(0)
    closing.cancel()  # the processor dies here
    assert first.tables.closed_windows == {} and first.acked(TOPICS.stepreports) == []
    ids = [f.id for f in findings(first)]
    assert ids
    again = pair(tables=first.tables)  # restarted: same tables, replays the step reports from the committed offset
    await again.feed(first.out.records(TOPICS.stepreports))
    assert [f.id for f in findings(again)] == ids
    assert list(again.tables.closed_windows) == ["j:w60"]


async def test_a_replay_of_part_of_a_closed_window_is_dropped(pair, batches):
    p = pair()
    await run_window(p, batches)
    restarted = pair(tables=p.tables, out=p.out)
    first_report = p.out.records(TOPICS.stepreports)[0]
    await restarted.feed([first_report])  # one step report of the closed window, replayed after a restart
    assert len(findings(p)) == 1 and len(window_reports(p)) == 1 and len(restarted.proc.windows.assembler) == 0
    assert restarted.acked(TOPICS.stepreports)[-1] == first_report.offset
    assert restarted.proc.metrics.get("late_records_total", stage="windows") == 1


async def test_a_duplicate_step_report_does_not_replace_the_first(pair, batches):
    p = pair()
    await p.feed(features(p, batches[60]))
    await p.pump()
    (r60,) = p.out.records(TOPICS.stepreports)
    await p.feed([p.out.append(TOPICS.stepreports, r60.key, r60.value)])  # the step stage's report, published twice
    await p.feed(features(p, batches[61]))
    await p.pump()
    (report,) = window_reports(p)
    assert report.steps_seen == 2 and p.acked(TOPICS.stepreports) == [0, 1, 2]


async def test_a_window_missing_a_step_closes_through_a_timeout_record_in_its_own_partition(pair, batches):
    p = pair(window_timeout_s=30.0)
    await p.feed(features(p, batches[60]))
    await p.pump()
    await p.proc.windows.on_timer(p.clock.t + 29.0)
    assert len(p.out.records(TOPICS.stepreports)) == 1  # the step report; no timeout yet
    await p.proc.windows.on_timer(p.clock.t + 30.0)
    await p.proc.windows.on_timer(p.clock.t + 31.0)  # asked once
    assert p.sent(TOPICS.stepreports)[1:] == [WindowTimeout(job="j", window="w60")]
    timeout = p.out.records(TOPICS.stepreports)[1]
    assert timeout.key == b"j" and p.tables.closed_windows == {}  # the timer sends; the close happens in the stream
    await p.pump()
    (report,) = window_reports(p)
    assert (report.closed, report.steps_seen) == ("timeout", 1)
    assert p.acked(TOPICS.stepreports) == [0, 1] and p.proc.metrics.get("windows_closed_total", reason="timeout") == 1
    await p.feed([p.out.append(TOPICS.stepreports, b"j", timeout.value)])  # a second one, for a closed window
    await p.feed(features(p, batches[61]))  # the missing step, too late
    await p.pump()
    assert len(window_reports(p)) == 1 and p.acked(TOPICS.stepreports) == [0, 1, 2, 3]


async def test_a_timeout_for_a_window_not_open_here_is_acknowledged_and_changes_nothing(pair):
    p = pair()
    await p.feed([p.produce(TOPICS.stepreports, "j", WindowTimeout(job="j", window="w99"))])
    assert p.acked(TOPICS.stepreports) == [0] and p.sent(TOPICS.findings) == [] and p.tables.closed_windows == {}


async def test_a_stored_history_that_does_not_decode_is_dropped_and_the_window_diagnosed(pair, batches, caplog):
    p = pair()
    p.tables.job_history["j"] = "{not json"
    with caplog.at_level("WARNING", logger="lockstep.processor"):
        await run_window(p, batches)
    assert [f.workers for f in findings(p)] == [[3]]
    assert any("dropping its stored history" in r.getMessage() for r in caplog.records)


async def test_a_bug_in_the_diagnosis_dead_letters_the_windows_records_and_leaves_it_open_to_a_replay(
    pair, batches, monkeypatch
):
    p = pair()

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(window_module, "diagnose_window", broken)
    await run_window(p, batches)
    assert p.dead() == {("windows", "processing_failed"): 2}
    assert p.sent(TOPICS.findings) == [] and p.tables.closed_windows == {} and p.acked(TOPICS.stepreports) == [0, 1]


async def test_a_bad_step_report_is_dead_lettered(pair):
    p = pair()
    await p.feed([p.produce(TOPICS.stepreports, "j", b'{"schema": "StepReport", "v": 1}')])
    assert sum(n for (stage, _), n in p.dead().items() if stage == "windows") == 1 and p.acked(TOPICS.stepreports) == [
        0
    ]


async def test_a_revoked_partition_is_forgotten_and_its_new_owner_closes_the_window_once(pair, batches):
    old = pair()
    await old.feed(features(old, batches[60]))
    await old.pump()
    assert len(old.proc.windows.assembler) == 1
    old.proc.windows.on_revoked({Partition(TOPICS.stepreports, 0), Partition(TOPICS.features, 0)})
    assert len(old.proc.windows.assembler) == 0 and old.acked(TOPICS.stepreports) == []
    await old.proc.windows.on_timer(old.clock.t + 3600)  # nothing of the revoked window is left to time out
    assert len(old.out.records(TOPICS.stepreports)) == 1
    new = pair(out=old.out, tables=old.tables)
    await new.feed(old.out.records(TOPICS.stepreports))  # replayed from the committed offset
    await new.feed(features(new, batches[61]))
    await new.pump()
    assert [(f.workers, f.cause) for f in findings(new)] == [([3], "gpu_slow")] and len(window_reports(new)) == 1


async def test_a_window_missing_a_worker_that_refused_the_trigger_is_not_complete_and_names_it(pair, window_features):
    """Worker 6 refused the trigger (its start step had begun): it sends nothing.  Its shard waits for it, then goes
    without it; every step reports, but the window misses an expected worker: it closes as a timeout, naming it."""
    from lockstep.kafka import window_features_key

    p = pair(step_timeout_s=5.0)
    sent = [w for w in window_features if w.worker.rank != 6]
    await p.feed(
        [p.produce(TOPICS.windowfeatures, window_features_key(r.job, r.window, r.shard).decode(), r) for r in sent]
    )
    await p.pump()
    p.clock.t += 5.0
    await p.proc.shards.on_timer(p.clock.t)
    await p.pump()
    (report,) = window_reports(p)
    assert (report.closed, report.steps_seen, report.expected_workers, report.workers_seen) == ("timeout", 2, 8, 7)
    assert (report.missing_workers, report.missing_total, report.coverage) == ([6], 1, 0.875)
    assert "1 of 8 expected workers delivered nothing for some steps (6)" in report.closed_reason
    assert [(f.workers, f.cause) for f in findings(p)] == [([3], "gpu_slow")]  # the others still give findings
    assert p.proc.metrics.get("windows_closed_total", reason="timeout") == 1
