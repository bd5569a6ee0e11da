"""``lockstep findings`` on a real store: the windows with how each ended (``--windows``), and a line under the
findings when windows of the selection failed or have not reported."""

from __future__ import annotations

import argparse
import json

from lockstep.commands import findings
from lockstep.sinks.store import Batch, FindingsStore
from tests.sinks.test_store_window_outcomes import WHY, failed, trigger, win


def args(db, **kw) -> argparse.Namespace:
    base = dict(db=db, job=None, since=None, cause=None, tenant=None, open=False, limit=100, json=False, windows=False)
    return argparse.Namespace(**(base | kw))


def stored(tmp_path):
    db = tmp_path / "f.duckdb"
    store = FindingsStore(db)
    store.write(
        Batch(
            [],
            [win("j", "w100", 100), failed("w200", 200)],
            {},
            triggers=[trigger("w100", 100), trigger("w200", 200), trigger("w300", 300)],
        )
    )
    store.close()
    return db


def test_windows_lists_each_window_with_how_it_ended(tmp_path, capsys):
    db = stored(tmp_path)
    assert findings.run(args(db, windows=True, json=True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(w["window"], w["closed"], w["closed_reason"]) for w in rows] == [
        ("w300", "open", "triggered; the window has not reported yet"),
        ("w200", "failed", WHY),
        ("w100", "complete", ""),
    ]
    assert findings.run(args(db, windows=True)) == 0
    out = capsys.readouterr().out
    assert "failed" in out and WHY in out and "w300" in out


def test_findings_say_when_windows_failed_or_have_not_reported(tmp_path, capsys):
    db = stored(tmp_path)
    assert findings.run(args(db)) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("no findings")
        and "1 window failed and 1 trigger not reported yet: lockstep findings --windows" in out
    )
    assert findings.run(args(db, job="other")) == 0
    assert capsys.readouterr().out == "no findings\n"


def test_who_acknowledged_an_open_incident_shows_in_findings_open_and_on_the_page(tmp_path, capsys):
    from lockstep.sinks.http import query
    from lockstep.sinks.report.data import gather
    from lockstep.sinks.report.page import render
    from tests.sinks.test_store import fnd
    from tests.sinks.test_store import win as window

    db = tmp_path / "f.duckdb"
    store = FindingsStore(db)
    t0 = 1_800_000_000.0
    acked, _ = store.write(
        Batch(
            [
                fnd("a1", window_="w1", created_at=t0),
                fnd("b1", window_="w1", workers=(5,), devices=("h1/gpu5",), created_at=t0),
            ],
            [window("j", "w1", 100, findings=2)],
            {},
        )
    )
    store.acknowledge(acked.incident_id, "alice", now=t0 + 60)
    store.close()
    assert findings.run(args(db, open=True)) == 0
    out = capsys.readouterr().out
    head, *rows = [line for line in out.splitlines() if line.startswith(("job", "j "))]
    assert "acknowledged" in head
    assert [("alice, 2027-01-15 08:01 UTC" in r) for r in rows].count(True) == 1  # the other incident: "-"
    page = render(gather(lambda sql, params=None: query(db, sql, params)), title="t")
    assert "acknowledged by alice 2027-01-15 08:01:00 UTC" in page and page.count("acknowledged by") == 1
    assert findings.run(args(db)) == 0 and "acknowledged" not in capsys.readouterr().out  # every finding: no column
