"""``lockstep diagnose --report``'s page: the offline window drawn as the live page draws a window."""

from __future__ import annotations

import re

import pytest

from lockstep.app.offline import diagnose, load_inputs
from lockstep.app.offlinereport import ReportError, offline_report, write_report
from lockstep.commands.cli import main
from lockstep.streams.policy import Policy
from tests.paths import DATA

TRACES = sorted((DATA / "traces").glob("sampled_rank-*.json.gz"))


def test_the_offline_window_has_the_live_pages_pictures():
    inputs = load_inputs(TRACES, None, None)
    results: list = []
    d = diagnose(inputs, Policy(), "offline", now=1_800_000_000.0, keep=results)
    assert len(results) == len({s.step for s in inputs.summaries})  # every step's result, for the deviation map
    r = offline_report(inputs, d, results, "offline", 1_800_000_000.0)
    (w,) = r.windows
    assert (w.window, w.findings, w.closed) == (d.report.window, len(d.findings), d.report.closed)
    pts = r.series["offline"]
    assert [p.step for p in pts] == sorted({s.step for s in inputs.summaries})
    for p in pts:  # the slowest rank's step time and the median of the ranks', per step
        times = sorted(s.step_time_us for s in inputs.summaries if s.step == p.step)
        assert p.step_time_us == times[-1] and p.workers == len(times)
    assert sorted(r.rank_series["offline"]) == sorted(inputs.workers)
    (cells,) = r.heatmaps.values()
    (f,) = d.findings
    assert any(c.worker in f.workers and c.function == f.function and c.flagged_steps for c in cells)


def test_diagnose_writes_the_report_and_says_so_on_a_bad_path(tmp_path, capsys):
    page = tmp_path / "r.html"
    assert main(["diagnose", *map(str, TRACES), "--report", str(page)]) == 0
    html = page.read_text()
    assert html.count('<svg class="steps"') == 1 and html.count('<svg class="heatmap"') == 1
    assert 'class="card finding"' in html and html.count('class="rank"') == 2 and "<script" not in html
    assert "open incident" not in html  # an offline window has no incidents to count
    out = capsys.readouterr().out
    assert "input_imbalance" in out  # the findings table is printed as without --report
    with pytest.raises(ReportError, match=r"--report: cannot write .*missing"):
        write_report(tmp_path / "missing" / "r.html", offline_report_of_nothing(), 1)
    assert re.search(r"Lockstep diagnose: offline", html)


def offline_report_of_nothing():
    from lockstep.sinks.report.page import Report

    return Report([], [], [])
