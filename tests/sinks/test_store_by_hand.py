"""Incidents acknowledged and resolved by hand, and retention (``prune``), on a real findings file: who and when are
kept, the events the pager reads are appended once, a resolved incident reopens as its next occurrence, and prune
deletes what is old except what open incidents and the pager still need."""

from __future__ import annotations

import pytest

from lockstep.schemas.records import StepSeries
from lockstep.sinks.paging.incidents import IncidentStateError
from lockstep.sinks.store import Batch, FindingsStore
from lockstep.sinks.store.findings import UnknownIncident
from tests.sinks.test_store import fnd, win

T0 = 1_800_000_000.0
DAY = 86400.0


def one_incident(tmp_path) -> tuple[FindingsStore, str]:
    store = FindingsStore(tmp_path / "f.duckdb")
    (ev,) = store.write(Batch([fnd("a1", window_="w1", created_at=T0)], [win("j", "w1", 100, findings=1)], {}))
    return store, ev.incident_id


def test_acknowledge_keeps_who_and_when_once_and_the_incident_stays_open(tmp_path):
    store, iid = one_incident(tmp_path)
    inc, events = store.acknowledge(iid, "alice", now=T0 + 60)
    assert (inc.status, inc.acked_by, inc.acked_at) == ("open", "alice", T0 + 60)
    assert [(e.action, e.reason, e.finding_id) for e in events] == [("acknowledge", "manual", "a1")]
    again, events = store.acknowledge(iid, "bob", now=T0 + 120)
    assert events == [] and again.acked_by == "alice"  # the first acknowledgement stands
    # a later finding of the same problem updates the incident; the acknowledgement is kept
    (ev,) = store.write(Batch([fnd("a2", window_="w2", steps=(200, 201), created_at=T0 + 300)], [], {}))
    assert ev.action == "update"
    assert store.con.execute(
        "SELECT status, acked_by, epoch(acked_at), windows FROM incidents WHERE id = ?", [iid]
    ).fetchall() == [("open", "alice", T0 + 60, 2)]
    assert store.con.execute("SELECT action FROM incident_events ORDER BY seq").fetchall() == [
        ("trigger",),
        ("acknowledge",),
        ("update",),
    ]


def test_resolve_by_hand_ends_it_and_the_problem_seen_again_reopens_it(tmp_path):
    store, iid = one_incident(tmp_path)
    inc, events = store.resolve(iid, "carol", now=T0 + 60)
    assert (inc.status, inc.resolved_reason, inc.resolved_by, inc.resolved_at) == (
        "resolved",
        "manual",
        "carol",
        T0 + 60,
    )
    assert [(e.action, e.reason) for e in events] == [("resolve", "manual")]
    assert store.resolve(iid, "dave", now=T0 + 90)[1] == []  # resolved already: nothing changes
    with pytest.raises(IncidentStateError):
        store.acknowledge(iid, "dave")
    # a replayed finding of the window it was resolved after changes nothing; a later window's opens occurrence 2
    assert store.write(Batch([fnd("a0", window_="w0", steps=(90, 91), created_at=T0 - 10)], [], {})) == []
    (ev,) = store.write(Batch([fnd("a3", window_="w3", steps=(300, 301), created_at=T0 + 400)], [], {}))
    assert (ev.action, ev.incident_id) == ("trigger", iid[: -len("-1")] + "-2")
    assert store.con.execute("SELECT status FROM incident_timeline ORDER BY id").fetchall() == [
        ("resolved",),
        ("open",),
    ]


def test_an_unknown_incident_or_another_tenants_is_refused(tmp_path):
    store, iid = one_incident(tmp_path)
    with pytest.raises(UnknownIncident):
        store.acknowledge("nosuch-1", "alice")
    with pytest.raises(UnknownIncident):
        store.resolve(iid, "alice", tenant="othertenant")
    assert store.resolve(iid, "alice", tenant="acme")[0].status == "resolved"


def series(job: str, steps: range, at: float) -> StepSeries:
    n = len(steps)
    return StepSeries(
        job=job,
        tenant="acme",
        steps=list(steps),
        step_time_us=[1e5] * n,
        median_us=[1e5] * n,
        workers=[8] * n,
        sent_at=at,
    )


def count(store: FindingsStore, table: str) -> int:
    return store.con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_prune_deletes_what_is_old_and_keeps_what_open_incidents_and_the_pager_need(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    # job old: a problem 40 days ago, resolved then by a window; its series and windows are as old
    store.write(
        Batch([fnd("o1", job="old", window_="w1", created_at=T0 - 40 * DAY)], [win("old", "w1", 100, findings=1)], {}),
        now=T0 - 40 * DAY,
    )
    store.write(Batch.of([series("old", range(100, 110), T0 - 40 * DAY)], {}), now=T0 - 40 * DAY)
    store.resolve(store.con.execute("SELECT id FROM incidents").fetchone()[0], "ops", now=T0 - 39 * DAY)
    # job slow: a problem first seen 40 days ago and still open (a finding of it yesterday)
    store.write(Batch([fnd("s1", job="slow", window_="v1", created_at=T0 - 40 * DAY, cause="nic")], [], {}))
    store.write(
        Batch(
            [fnd("s2", job="slow", window_="v2", steps=(500, 501), created_at=T0 - 40 * DAY + 60, cause="nic")], [], {}
        )
    )
    store.write(
        Batch([fnd("s3", job="slow", window_="v3", steps=(900, 901), created_at=T0 - DAY, cause="nic")], [], {})
    )
    # job new: today
    store.write(Batch([fnd("n1", job="new", window_="x1", created_at=T0, cause="pcie")], [], {}), now=T0)
    store.write(Batch.of([series("new", range(10), T0)], {}), now=T0)
    # the windows' closed_at (win(): T0 + start) made old
    store.con.execute(
        "UPDATE windows SET closed_at = make_timestamp(?::BIGINT) WHERE job = 'old'", [int((T0 - 40 * DAY) * 1e6)]
    )
    last_seq = store.con.execute("SELECT max(seq) FROM incident_events").fetchone()[0]
    offsets = {("lockstep.findings", 0): 42}
    store.write(Batch([], [], offsets))

    pruned = store.prune(30 * DAY, now=T0)

    assert sorted(r[0] for r in store.con.execute("SELECT id FROM findings").fetchall()) == ["n1", "s1", "s2", "s3"]
    assert (pruned.findings, pruned.windows, pruned.incidents, pruned.step_series) == (1, 1, 1, 10)
    # the open incident of job slow keeps its findings, however old, and its events
    assert store.con.execute("SELECT job, status FROM incidents ORDER BY job").fetchall() == [
        ("new", "open"),
        ("slow", "open"),
    ]
    assert store.con.execute("SELECT DISTINCT job FROM incident_events ORDER BY job").fetchall() == [
        ("new",),
        ("slow",),
    ]
    assert store.con.execute("SELECT max(seq) FROM incident_events").fetchone()[0] == last_seq
    assert store.con.execute("SELECT DISTINCT job FROM step_series").fetchall() == [("new",)]
    assert store.offsets() == offsets  # never pruned
    # the next event numbers on from the last one, whatever was pruned
    (ev,) = store.write(Batch([fnd("n2", job="new2", window_="y1", created_at=T0, cause="pcie")], [], {}))
    assert (
        store.con.execute("SELECT seq FROM incident_events WHERE incident_id = ?", [ev.incident_id]).fetchone()[0]
        == last_seq + 1
    )
    assert store.prune(30 * DAY, now=T0).total == 0  # nothing more is that old
    with pytest.raises(Exception, match="positive"):
        store.prune(0)


def test_the_report_says_who_resolved_an_incident_by_hand(tmp_path):
    from lockstep.sinks.report.data import gather
    from lockstep.sinks.report.page import render, resolved_why

    store, iid = one_incident(tmp_path)
    store.resolve(iid, "carol", now=T0 + 60)
    page = render(gather(lambda sql, params=None: store.query(sql, params)), title="t")
    assert "resolved by hand by carol" in page and "window carol" not in page
    assert resolved_why("stale") == "nothing saw it for long" and resolved_why("w9") == "window w9 did not see it"
