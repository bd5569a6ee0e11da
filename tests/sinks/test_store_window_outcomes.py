"""How each window ended, in the store: a failed window's reason, triggers whose window has not reported
(``trigger_outcomes``, the report's window rows), and a failed window never clearing an incident."""

from __future__ import annotations

import msgspec

from lockstep.schemas.records import ProfileTrigger
from lockstep.sinks.report.data import fetch_windows, gather
from lockstep.sinks.report.page import render
from lockstep.sinks.store import Batch, FindingsStore

from .test_store import fnd, win

WHY = "no step report by the trigger's deadline (+30 s)"


def trigger(window: str, start: int) -> ProfileTrigger:
    return ProfileTrigger(
        job="j",
        window=window,
        start_step=start,
        steps=2,
        expected_workers=8,
        reason="slowdown: step time +25%",
        created_at=1_800_000_000.0 + start,
        tenant="acme",
    )


def failed(window: str, start: int, coverage: float = 0.0, why: str = WHY):
    return msgspec.structs.replace(win("j", window, start, coverage=coverage), closed="failed", closed_reason=why)


def store_of(tmp_path) -> FindingsStore:
    store = FindingsStore(tmp_path / "f.duckdb")
    triggers = [trigger("w100", 100), trigger("w200", 200), trigger("w300", 300)]
    store.write(Batch([], [win("j", "w100", 100), failed("w200", 200)], {}, triggers=triggers))
    return store


def test_every_trigger_has_an_outcome_and_a_failed_window_keeps_its_reason(tmp_path):
    store = store_of(tmp_path)
    rows = store.con.execute(
        "SELECT window_id, closed, closed_reason, kind FROM trigger_outcomes ORDER BY start_step"
    ).fetchall()
    assert rows == [
        ("w100", "complete", "", "slowdown"),
        ("w200", "failed", WHY, "slowdown"),
        ("w300", "open", None, "slowdown"),
    ]
    assert store.con.execute("SELECT windows, timed_out, failed FROM coverage_by_job").fetchall() == [(2, 0, 1)]


def test_the_reports_windows_hold_the_failed_one_with_its_reason_and_the_open_trigger(tmp_path):
    store = store_of(tmp_path)

    def run(sql, params=None):
        cur = store.con.execute(sql, params or [])
        return [d[0] for d in cur.description], cur.fetchall()

    rows = fetch_windows(run)
    assert [(w.window, w.closed, w.closed_reason) for w in rows] == [
        ("w300", "open", "triggered; the window has not reported yet"),
        ("w200", "failed", WHY),
        ("w100", "complete", ""),
    ]
    assert [w.window for w in fetch_windows(run, job="other")] == []
    assert [w.window for w in fetch_windows(run, job="j", since="1d")] == ["w300", "w200", "w100"]  # stored in 2027
    assert [w.window for w in fetch_windows(run, since="2027-01-15T08:02:00")] == ["w300", "w200"]
    page = render(gather(run))
    assert "3 windows · 1 failed · 1 open" in page
    assert f"No findings. 1 window failed (below), the latest: j / w200, {WHY}" in page.replace("&#x27;", "'")


def test_a_failed_window_does_not_resolve_an_open_incident(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([fnd("a1", window_="w1")], [win("j", "w1", 100, findings=1)], {}))
    # every step but one came, yet one step report was unreadable: what it lost may be what it would have seen
    assert store.write(Batch([], [failed("w2", 200, coverage=0.95, why="1 of 16 step reports unreadable")], {})) == []
    assert store.con.execute("SELECT status FROM incidents").fetchall() == [("open",)]
    events = store.write(Batch([], [win("j", "w3", 300)], {}))
    assert [(e.action, e.reason) for e in events] == [("resolve", "w3")]
