"""Every window the window stage hears of ends in a report with a terminal state: a 2-worker step where one worker
ran a function the other did not (which once gave an infinite z and lost every window of the job), a step report
whose tables cannot be read among good ones, a triggered window whose step reports never come, a bug in the
diagnosis."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pyarrow as pa

from lockstep.kafka import Topics
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    FeatureBatch,
    Finding,
    StepReport,
    TriggerRequest,
    WindowExpected,
    WindowReport,
    WindowTimeout,
    WorkerMeta,
    decode,
    encode,
)
from lockstep.streams.stages import window as window_module

TOPICS = Topics.named("t")  # the pair's
STEP_US = 100_000.0


def batch(step: int, rank: int, functions: dict[str, float], *, workers: int = 2, start: int = 10, steps: int = 4):
    names = list(functions)
    table = ft.make_table(
        {
            "function": names,
            "kind": ["compute"] * len(names),
            "calls": [1] * len(names),
            "total_us": [functions[n] for n in names],
            "critical_us": [functions[n] for n in names],
        }
    )
    return FeatureBatch(
        job="j",
        window=f"w{start}",
        step=step,
        window_start=start,
        window_steps=steps,
        expected_workers=workers,
        worker=WorkerMeta(rank=rank, host=f"h{rank}"),
        step_time_us=STEP_US,
        functions=ft.pack(table),
    )


def two_ranks(step: int) -> list[FeatureBatch]:
    """Rank 0 runs a function rank 1 never runs (rank-specific code, 5% of the step)."""
    return [batch(step, 0, {"fwd": 60_000.0, "only_rank0": 5_000.0}), batch(step, 1, {"fwd": 60_000.0})]


def features(p, batches) -> list:
    return [p.produce(TOPICS.features, f"{b.job}:{b.step}", b) for b in batches]


def window_reports(p) -> list[WindowReport]:
    return [r for r in p.sent(TOPICS.windows) if isinstance(r, WindowReport)]


def findings(p) -> list[Finding]:
    return [f for f in p.sent(TOPICS.findings) if isinstance(f, Finding)]


async def test_a_function_only_one_of_two_workers_ran_gives_valid_step_reports_and_a_finding(pair):
    p = pair()
    for step in range(10, 14):
        await p.feed(features(p, two_ranks(step)))
    await p.pump()
    assert p.dead() == {}
    for r in p.sent(TOPICS.stepreports):
        assert isinstance(r, StepReport)
        z = window_module.step_result(r).outliers.column("z").to_numpy()
        assert z.size and np.isfinite(z).all()
    (report,) = window_reports(p)
    assert (report.closed, report.closed_reason, report.steps_seen) == ("complete", "", 4)
    assert [(f.workers, f.function) for f in findings(p)] == [([0], "only_rank0")]
    assert "not run by" in findings(p)[0].summary


def corrupt(report: StepReport) -> StepReport:
    """The step report as the old arithmetic made it: an infinite z in its outliers."""
    t = ft.unpack_ipc(report.outliers)
    i = t.schema.get_field_index("z")
    t = t.set_column(i, "z", pa.array([math.inf] * t.num_rows, pa.float64()))
    return msgspec.structs.replace(report, outliers=ft.pack(t))


async def test_an_unreadable_step_report_fails_its_window_with_the_reason_and_the_other_steps_still_give_findings(pair):
    steps = pair()
    for step in range(10, 14):
        await steps.feed(features(steps, two_ranks(step)))
    good = [r for r in steps.sent(TOPICS.stepreports) if isinstance(r, StepReport)]
    p = pair()
    bad = [corrupt(good[1])]
    await p.feed([p.produce(TOPICS.stepreports, "j", r) for r in good[:1] + bad + good[2:]])
    assert p.dead() == {("windows", "invalid"): 1}
    (report,) = window_reports(p)
    assert report.closed == "failed" and report.steps_seen == 3
    assert report.closed_reason.startswith("1 of 4 step reports unreadable (step 11: invalid: StepReport.outliers.z")
    assert report.closed_reason.endswith("findings from the 3 others")
    assert [(f.workers, f.function) for f in findings(p)] == [([0], "only_rank0")]
    assert p.acked(TOPICS.stepreports) == [0, 1, 2, 3] and len(p.proc.windows.assembler) == 0
    assert p.proc.metrics.get("windows_closed_total", reason="failed") == 1
    assert list(p.tables.closed_windows) == ["j:w10"]


def expected(deadline: float) -> WindowExpected:
    return WindowExpected(
        job="j", window="w10", start_step=10, steps=4, expected_workers=2, created_at=deadline - 60, deadline=deadline
    )


async def test_a_triggered_window_whose_step_reports_never_come_closes_failed_after_its_deadline(pair):
    p = pair(window_timeout_s=30.0)
    t0 = p.clock.t
    await p.feed([p.produce(TOPICS.stepreports, "j", expected(t0 + 60))])
    assert len(p.proc.windows.assembler) == 1 and p.acked(TOPICS.stepreports) == []
    await p.proc.windows.on_timer(t0 + 89)  # the deadline, plus the window timeout: not yet
    assert p.sent(TOPICS.stepreports) == []
    await p.proc.windows.on_timer(t0 + 90)
    await p.proc.windows.on_timer(t0 + 91)  # asked once
    assert p.sent(TOPICS.stepreports) == [WindowTimeout(job="j", window="w10")]
    await p.pump()
    (report,) = window_reports(p)
    assert (report.closed, report.steps_seen, report.findings, report.coverage) == ("failed", 0, 0, 0.0)
    assert report.closed_reason.startswith("no step report by the trigger's deadline")
    assert p.acked(TOPICS.stepreports) == [0, 1] and len(p.proc.windows.assembler) == 0
    assert p.proc.metrics.get("windows_closed_total", reason="failed") == 1
    await p.feed(features(p, two_ranks(10)))  # the first step, far too late
    await p.pump()
    assert len(window_reports(p)) == 1 and p.proc.metrics.get("late_records_total", stage="windows") == 1


async def test_an_announced_window_times_out_from_its_first_step_report_not_its_deadline(pair):
    p = pair(window_timeout_s=30.0)
    t0 = p.clock.t
    await p.feed([p.produce(TOPICS.stepreports, "j", expected(t0 + 60))])
    p.clock.t = t0 + 80  # the job was slower than the detector thought: its first step comes just before the deadline
    await p.feed(features(p, two_ranks(10)))
    await p.pump()
    await p.proc.windows.on_timer(t0 + 100)  # past the deadline (90), but 20 s after the first report: still open
    assert not [r for r in p.sent(TOPICS.stepreports) if isinstance(r, WindowTimeout)]
    for step in range(11, 14):
        await p.feed(features(p, two_ranks(step)))
    await p.pump()
    (report,) = window_reports(p)
    assert (report.closed, report.steps_seen) == ("complete", 4)
    assert p.acked(TOPICS.stepreports) == [0, 1, 2, 3, 4]  # the notice too, with its window


async def test_a_window_missing_steps_closes_timeout_and_says_how_many_came(pair):
    p = pair(window_timeout_s=30.0)
    await p.feed(features(p, two_ranks(10)))
    await p.pump()
    await p.proc.windows.on_timer(p.clock.t + 30)
    await p.pump()
    (report,) = window_reports(p)
    assert (report.closed, report.closed_reason) == ("timeout", "1 of 4 steps reported within 30 s of the first")


async def test_the_detect_stage_announces_every_trigger_to_the_window_stage(pair):
    """An operator's request for a job the detector knows: the trigger on control, its notice on step reports (the
    window's own partition), with a deadline no earlier than the trigger."""
    from tests.streams.stages.test_detect_stage import T0, heartbeats, run

    p = pair()
    await run(p, heartbeats(p, range(20)))
    await p.feed([p.produce(TOPICS.partials, "j", TriggerRequest(job="j", request="r1", steps=4))])
    (trigger,) = [r for r in p.sent(TOPICS.control) if r.window]
    (notice,) = p.sent(TOPICS.stepreports)
    assert isinstance(notice, WindowExpected)
    assert (notice.job, notice.window, notice.start_step, notice.steps, notice.kind) == (
        "j",
        trigger.window,
        trigger.start_step,
        4,
        "manual",
    )
    assert notice.policy == trigger.policy_ref and notice.deadline >= trigger.created_at >= T0
    (rec,) = p.out.records(TOPICS.stepreports)
    assert rec.key == b"j"
    await p.pump()
    assert len(p.proc.windows.assembler) == 1


async def test_a_bug_in_the_diagnosis_still_ends_the_window_failed_with_the_exception(pair, monkeypatch):
    p = pair()

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(window_module, "diagnose_window", broken)
    for step in range(10, 14):
        await p.feed(features(p, two_ranks(step)))
    await p.pump()
    (report,) = window_reports(p)
    assert report.closed == "failed" and "the diagnosis failed (KeyError: 'a bug')" in report.closed_reason
    assert p.dead() == {("windows", "processing_failed"): 4} and p.tables.closed_windows == {}
    assert p.proc.metrics.get("windows_closed_total", reason="failed") == 1


def test_a_window_report_of_an_older_sink_reads_without_a_reason():
    old = b'{"schema":"WindowReport","v":1,"job":"j","window":"w1","start_step":1,"steps":2,"steps_seen":2,'
    old += b'"expected_workers":2,"workers_seen":2,"coverage":1.0,"bytes_per_worker":1.0,"findings":0,'
    old += b'"actionable":false,"reached_device":false,"closed":"complete","closed_at":1.8e9}'
    r = decode(old, WindowReport)
    assert r.closed_reason == "" and decode(encode(r), WindowReport) == r


async def test_a_good_twin_of_an_unreadable_step_report_supersedes_it(pair):
    """The step stage's report of step 11 published again (a replay) after a corrupt copy: the window has every
    step and closes complete; the corrupt copy is still in the dead letters."""
    steps = pair()
    for step in range(10, 14):
        await steps.feed(features(steps, two_ranks(step)))
    good = [r for r in steps.sent(TOPICS.stepreports) if isinstance(r, StepReport)]
    p = pair()
    await p.feed([p.produce(TOPICS.stepreports, "j", r) for r in [good[0], corrupt(good[1]), good[1], *good[2:3]]])
    assert window_reports(p) == []  # step 13 is still missing: a corrupt copy and its twin are one step
    await p.feed([p.produce(TOPICS.stepreports, "j", good[3])])
    (report,) = window_reports(p)
    assert (report.closed, report.closed_reason, report.steps_seen) == ("complete", "", 4)
    assert p.dead() == {("windows", "invalid"): 1}


async def test_a_window_every_worker_refused_closes_failed_at_once_and_its_slowdown_gets_another(pair):
    """The processor in memory: a slowdown's trigger reaches the agents after the window's first step; each echoes
    its refusal (``past``) on its next heartbeat.  The window closes ``failed`` with the reasons as soon as the last
    refusal is counted, with no timer run (before: at its deadline, ~70 s), and the slowdown gets a new window at once
    (before: after the cool-down, 200 steps)."""
    from lockstep.schemas.records import StepHeartbeat, WindowRefused
    from tests.streams.stages.test_detect_stage import T0, control, run, slowed_down

    p = pair(window_timeout_s=30.0)
    first = await slowed_down(p)
    await p.pump()
    assert len(p.proc.windows.assembler) == 1  # announced by its notice
    step, sent = 60, T0 + 60 * 0.2
    beats = [
        p.produce(
            TOPICS.heartbeats,
            "j",
            StepHeartbeat(
                job="j",
                worker=w,
                step=step,
                step_time_s=0.3,
                host=f"h{w}",
                sent_at=sent,
                world_size=8,
                trigger_window=first.window,
                trigger_latency_s=2.0,
                trigger_refused="past",
            ),
        )
        for w in range(8)
    ]
    await run(p, [(sent + 0.05, beats)])
    await p.pump()
    refused = [r for r in p.sent(TOPICS.stepreports) if isinstance(r, WindowRefused)]
    assert [(r.window, r.reasons, r.retry) for r in refused] == [(first.window, {"past": 8}, True)]
    (report,) = window_reports(p)
    assert (report.window, report.closed, report.steps_seen) == (first.window, "failed", 0)
    assert report.closed_reason.startswith("every one of the 8 expected workers refused the trigger: 8 past")
    assert not [r for r in p.sent(TOPICS.stepreports) if isinstance(r, WindowTimeout)]  # no deadline waited for
    assert p.proc.metrics.get("windows_refused_total", retry="yes") == 1
    assert p.proc.metrics.get("windows_closed_total", reason="failed") == 1
    second = [t for t in control(p) if t.window != first.window]
    assert len(second) == 1 and second[0].kind == "slowdown"
    assert second[0].start_step < first.start_step + first.steps + 200  # inside what was the cool-down
