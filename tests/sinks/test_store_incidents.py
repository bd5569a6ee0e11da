"""The store applies the detector's news (``JobChange``) to incidents: an incident keeps its slowdown's onset and step
times, resolves as ``recovered`` or ``job_ended`` whichever of the news and its finding comes first, and the views
give time to diagnose, time to recover, GPU-hours lost and GPU-hours per day recovered."""

from __future__ import annotations

import pytest

from lockstep.schemas.records import JobChange, ProfileTrigger
from lockstep.sinks.report.data import gather
from lockstep.sinks.store import Batch, FindingsStore
from tests.sinks.test_store import fnd

T0 = 1_800_000_000.0


def trigger(job: str, window: str, start: int, at: float) -> ProfileTrigger:
    return ProfileTrigger(
        job=job, window=window, start_step=start, steps=8, expected_workers=8, created_at=at, tenant="acme"
    )


def change(job: str, kind: str, step: int, at: float, **kw) -> JobChange:
    return JobChange(job=job, tenant="acme", change=kind, step=step, at=at, **kw)


SLOWDOWN = dict(window="w100", onset_step=90, onset_at=T0, before_s=0.2, during_s=0.26)


def test_a_recovered_slowdown_and_an_ended_job_resolve_their_incidents_in_either_order(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    q = lambda sql: store.con.execute(sql).fetchall()  # noqa: E731
    # job j: its slowdown's news and trigger, then the finding of the window opened for it
    events = store.write(
        Batch.of(
            [trigger("j", "w100", 100, T0 + 10), change("j", "slowdown", 95, T0 + 10, **SLOWDOWN)],
            {},
        )
    )
    assert events == []
    (ev,) = store.write(Batch([fnd("a1", window_="w100", steps=(100, 101), created_at=T0 + 30)], [], {}))
    assert ev.action == "trigger"
    assert q(
        "SELECT first_window, first_step, epoch(first_trigger_at), onset_step, epoch(onset_at), before_s, during_s FROM incidents"
    ) == [("w100", 100, T0 + 10, 90, T0, 0.2, 0.26)]
    # the fault removed: the detector says the step time is back
    recovered = change("j", "recovered", 300, T0 + 100, after_s=0.201, steps=30, **SLOWDOWN)
    (ev,) = store.write(Batch.of([recovered], {}))
    assert (ev.action, ev.reason, ev.incident_id) == ("resolve", "recovered", q("SELECT id FROM incidents")[0][0])
    assert store.write(Batch.of([recovered], {})) == []  # a replay of the news: nothing more

    # job k: it ended (every final heartbeat) before the finding of its last window reached the sink
    store.write(
        Batch.of([trigger("k", "w40", 40, T0 + 20), change("k", "ended", 60, T0 + 50, end="final", after_s=0.3)], {})
    )
    events = store.write(
        Batch([fnd("b1", job="k", window_="w40", steps=(40, 41), created_at=T0 + 60, cause="nic")], [], {})
    )
    assert [(e.action, e.reason) for e in events] == [("trigger", "w40"), ("resolve", "job_ended")]

    rows = q(
        "SELECT job, status, resolved_reason, resolved_step, time_to_diagnose_s, time_to_recover_s, before_s, during_s, "
        "after_s, round(gpu_hours_lost, 9) FROM incident_timeline ORDER BY job"
    )
    assert rows == [
        # onset T0, finding T0+30, recovered T0+100; 24 GPU-h/day from the onset to the recovery
        ("j", "resolved", "recovered", 301, 30.0, 100.0, 0.2, 0.26, 0.201, round(24.0 * 100 / 86400, 9)),
        # no slowdown news for k's window: diagnosed 40 s after its trigger; lost from its finding until the end
        # (which came first: nothing), never recovered
        ("k", "resolved", "job_ended", 61, 40.0, None, None, None, None, 0.0),
    ]
    assert q(
        "SELECT cause, resolution, incidents, median_time_to_diagnose_s, median_time_to_recover_s, gpu_hours_per_day_recovered "
        "FROM incident_outcomes ORDER BY cause"
    ) == [("gpu_slow", "recovered", 1, 30.0, 100.0, 24.0), ("nic", "job_ended", 1, 40.0, None, 0.0)]
    # nothing is being lost any more, and what was lost does not grow
    assert q("SELECT sum(gpu_hours_per_day), round(sum(gpu_hours_lost), 9) FROM gpu_hours_lost_by_cause") == [
        (0.0, pytest.approx(round(24.0 * 70 / 86400, 9)))
    ]


def test_news_of_another_run_or_before_the_onset_leaves_an_incident_open(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    # the job of the same name ended before (a run earlier that day), then this run's window found a problem
    store.write(Batch.of([change("j", "ended", 900, T0 - 3600, end="final")], {}))
    store.write(Batch.of([trigger("j", "w100", 100, T0 + 10)], {}))
    (ev,) = store.write(Batch([fnd("a1", window_="w100", steps=(100, 101), created_at=T0 + 30)], [], {}))
    assert ev.action == "trigger"
    # a slowdown that began after the incident was first seen recovers: not this incident's
    assert store.write(Batch.of([change("j", "recovered", 400, T0 + 200, onset_step=300, window="w310")], {})) == []
    assert store.con.execute("SELECT status FROM incidents").fetchall() == [("open",)]
    (ev,) = store.write(Batch.of([change("j", "ended", 500, T0 + 300, end="silent")], {}))
    assert (ev.action, ev.reason) == ("resolve", "job_ended")
    assert store.con.execute("SELECT count(*) FROM job_changes").fetchone()[0] == 3


def test_an_incident_first_seen_in_a_window_asked_again_keeps_the_onset_of_its_slowdown(tmp_path):
    """Every worker refused the slowdown's window w100; the detector asked again (w110) without a second ``slowdown``
    news: the incident found in w110 keeps the onset the news of w100 gave, and the report's trigger of w110 too."""
    store = FindingsStore(tmp_path / "f.duckdb")
    q = lambda sql: store.con.execute(sql).fetchall()  # noqa: E731
    store.write(Batch.of([trigger("j", "w100", 100, T0 + 10), change("j", "slowdown", 95, T0 + 10, **SLOWDOWN)], {}))
    store.write(Batch.of([trigger("j", "w110", 110, T0 + 12)], {}))
    # another job's slowdown news and an earlier run's recovered slowdown lend k's retried window nothing
    store.write(
        Batch.of(
            [
                change("k", "slowdown", 10, T0 - 100, **SLOWDOWN),
                change("k", "recovered", 50, T0 - 50, after_s=0.2, steps=30, **SLOWDOWN),
                trigger("k", "w70", 70, T0 + 12),
            ],
            {},
        )
    )
    (opened,) = store.write(Batch([fnd("a1", window_="w110", steps=(110, 111), created_at=T0 + 30)], [], {}))
    assert opened.action == "trigger"
    store.write(Batch([fnd("b1", job="k", window_="w70", steps=(70, 71), created_at=T0 + 30)], [], {}))
    assert q(
        "SELECT job, first_window, onset_step, epoch(onset_at), before_s, during_s FROM incidents ORDER BY job"
    ) == [
        ("j", "w110", 90, T0, 0.2, 0.26),
        ("k", "w70", None, None, None, None),
    ]
    assert q("SELECT count(*) FROM job_changes WHERE job = 'j'") == [(1,)]
    report = gather(lambda sql, params=None: store.query(sql, params))
    onsets = {k: t.onset_step for k, t in report.triggers.items()}
    assert (onsets[("j", "w100")], onsets[("j", "w110")], onsets[("k", "w70")]) == (90, 90, None)
