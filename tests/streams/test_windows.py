"""The step/window state machines, driven entirely in memory."""

from lockstep.schemas import functions as ft
from lockstep.schemas.records import FeatureBatch, StepReport, WorkerMeta
from lockstep.streams.diagnosis.step import GROUP_SCHEMA, OUTLIER_SCHEMA, StepResult
from lockstep.streams.windows import InOrderAcks, StepAssembler, WindowAssembler

TABLE = ft.make_table({"function": ["f"], "kind": ["compute"], "calls": [1], "total_us": [1.0], "critical_us": [1.0]})


def batch(rank, step=10, expected=3, job="j"):
    return FeatureBatch(
        job=job,
        window="w10",
        step=step,
        window_start=10,
        window_steps=2,
        expected_workers=expected,
        worker=WorkerMeta(rank=rank, host="h"),
        step_time_us=100.0,
        functions=b"",
    )


def test_acks_are_released_in_offset_order_only():
    acks = InOrderAcks()
    h = [acks.hold("p0", i, f"e{i}") for i in range(4)]
    assert acks.release([h[1], h[3]]) == []  # offset 0 still open: nothing may be committed
    assert acks.release([h[0]]) == ["e0", "e1"]
    assert acks.release([h[2]]) == ["e2", "e3"]
    assert acks.held() == 0


def test_acks_are_independent_per_partition_and_dropped_on_revoke():
    acks = InOrderAcks()
    a = acks.hold("p0", 0, "a")
    b = acks.hold("p1", 0, "b")
    assert acks.release([b]) == ["b"]
    acks.drop({"p0"})
    assert acks.release([a]) == []


def test_step_closes_when_every_expected_worker_reported():
    acks = InOrderAcks()
    sa = StepAssembler(timeout_s=5)
    for r in range(2):
        closed, late = sa.add(batch(r), TABLE, 10, acks.hold("p", r, r), now=0.0)
        assert closed is None and not late
    closed, _ = sa.add(batch(2), TABLE, 10, acks.hold("p", 2, 2), now=0.1)
    assert closed.reason == "complete"
    assert sorted(closed.pending.batches) == [0, 1, 2]
    assert closed.pending.bytes_in == 30
    assert len(closed.pending.handles) == 3


def test_redelivered_record_replaces_its_twin_and_keeps_both_handles():
    sa = StepAssembler(timeout_s=5)
    acks = InOrderAcks()
    sa.add(batch(0), TABLE, 10, acks.hold("p", 0, 0), 0.0)
    sa.add(batch(0), TABLE, 10, acks.hold("p", 1, 1), 0.0)
    closed = sa.expire(now=6.0)[0]
    assert list(closed.pending.batches) == [0]
    assert len(closed.pending.handles) == 2  # both offsets are acked when the step closes


def test_missing_worker_closes_the_step_on_timeout_and_late_records_are_recognised():
    sa = StepAssembler(timeout_s=5)
    acks = InOrderAcks()
    sa.add(batch(0), TABLE, 10, acks.hold("p", 0, 0), now=0.0)
    assert sa.expire(now=4.9) == []
    closed = sa.expire(now=5.0)
    assert [c.reason for c in closed] == ["timeout"]
    _, late = sa.add(batch(2), TABLE, 10, acks.hold("p", 1, 1), now=6.0)
    assert late and sa.late == 1


def test_revoked_partitions_drop_open_steps():
    sa = StepAssembler(timeout_s=5)
    sa.add(batch(0), TABLE, 10, InOrderAcks().hold("p7", 0, 0), 0.0)
    sa.drop({"p7"})
    assert len(sa) == 0


def _report(step, job="j", window="w10", steps=2):
    return StepReport(
        job=job,
        window=window,
        step=step,
        window_start=10,
        window_steps=steps,
        expected_workers=3,
        workers_seen=3,
        bytes_in=100,
        step_time_us=1.0,
        step_time_median_us=1.0,
        work_max_us=1.0,
        healthy_work_max_us=1.0,
        outliers=b"",
        groups=b"",
    )


def _result(step):
    return StepResult(
        job="j",
        window="w10",
        step=step,
        workers_seen=3,
        step_time_us=1.0,
        step_time_median_us=1.0,
        work_max_us=1.0,
        healthy_work_max_us=1.0,
        outliers=OUTLIER_SCHEMA.empty_table(),
        groups=GROUP_SCHEMA.empty_table(),
    )


def test_window_closes_when_all_steps_reported_and_first_report_wins():
    wa = WindowAssembler(timeout_s=30)
    acks = InOrderAcks()
    first = _result(10)
    assert wa.add(_report(10), first, acks.hold("p", 0, 0), 0.0) is None
    dup = _result(10)
    assert wa.add(_report(10), dup, acks.hold("p", 1, 1), 0.1) is None  # a replayed duplicate
    closed = wa.add(_report(11), _result(11), acks.hold("p", 2, 2), 0.2)
    assert closed.reason == "complete"
    assert closed.pending.results[10] is first
    assert closed.pending.bytes_in == 200
    assert len(closed.pending.handles) == 3


def test_window_timeout_is_requested_once_then_closed_on_request():
    wa = WindowAssembler(timeout_s=30)
    acks = InOrderAcks()
    wa.add(_report(10), _result(10), acks.hold("p", 0, 0), 0.0)
    assert wa.due(29.0) == []
    assert wa.due(30.0) == [("j", "w10")]
    assert wa.due(31.0) == []  # already requested
    assert wa.hold(("j", "w10"), acks.hold("p", 1, 1))
    closed = wa.close(("j", "w10"), "timeout")
    assert closed.reason == "timeout" and len(closed.pending.handles) == 2
    assert wa.close(("j", "w10"), "timeout") is None
