"""The HTML report's pure renderer: pictures proportional to the figures, every store string escaped."""

import datetime as dt
import re

import pytest

from lockstep.schemas.records import Evidence, Finding, Impact
from lockstep.sinks.report.page import (
    CauseRow,
    HeatCell,
    IncidentRow,
    PageRow,
    Report,
    SeriesPoint,
    TriggerRow,
    WindowRow,
    evidence_bars,
    first_bad_step,
    hbars,
    heatmap,
    next_commands,
    peer_spread,
    render,
    step_chart,
    step_strip,
)

NOW = dt.datetime(2026, 11, 29, 10, 30, tzinfo=dt.UTC)


def finding(function="bwd.gemm", summary="worker 13 is slow", steps=(64, 65, 67)):
    return Finding(
        id="f1",
        job="j",
        window="w64",
        steps=list(steps),
        scope="worker",
        workers=[13],
        hosts=["node0001"],
        devices=["node0001/gpu5"],
        function=function,
        function_kind="compute",
        cause="gpu_throttle_thermal",
        confidence=0.97,
        evidence=[
            Evidence(feature="work_us", value=150.0, peer_value=100.0, deviation=10.0),
            Evidence(feature="sm_clock_mhz", value=1500.0, peer_value=2000.0, deviation=-0.25),
            Evidence(feature="healthy_windows", value=3.0, peer_value=None, deviation=None),
        ],
        impact=Impact(step_time_share=0.195, gpu_hours_per_day=293.6),
        policy="p@h",
        created_at=1_800_000_000.0,
        summary=summary,
        window_steps=8,
    )


def series(n=80, onset=40, slow=1.25):
    return [SeriesPoint(s, 200_000.0 * (slow if s >= onset else 1.0) + (s % 3) * 500, 199_000.0, 64) for s in range(n)]


def report(f=None, **kw):
    f = f or finding()
    base = dict(
        findings=[f],
        windows=[WindowRow("j", "w64", 64, 8, 0.75, 1, "timeout", "2026-11-29 10:00:00", 64, 48, 20480.0)],
        causes=[CauseRow("gpu_throttle_thermal", 2, 1, 293.6, 12.5)],
        series={"j": series()},
        triggers={
            ("j", "w64"): TriggerRow(
                "j",
                "w64",
                "slowdown",
                "slowdown: median of last 5 steps 250 ms vs baseline 200 ms",
                64,
                8,
                "2026-11-29 10:00:00",
            )
        },
        incidents={
            "inc1": IncidentRow(
                "inc1", "open", 1, "2026-11-29 10:00:00", "2026-11-29 10:00:00", None, None, 1, 293.6, 6.1
            )
        },
        pages={"inc1": [PageRow("oncall", "pagerduty", "trigger", "delivered", 1, 202, None, "2026-11-29 10:00:01")]},
        incident_of={f.id: "inc1"},
        heatmaps={
            ("j", "w64"): [
                HeatCell(13, "bwd.gemm", 0, 0, 9.5, 8, 2, 2),
                HeatCell(13, "fwd.gemm", 0, 1, None, 0, 2, 2),
                HeatCell(7, "bwd.gemm", 1, 0, None, 0, 2, 2),
                HeatCell(7, "fwd.gemm", 1, 1, -5.0, 2, 2, 2),
            ]
        },
    )
    base.update(kw)
    return Report(**base)


def widths(svg: str) -> list[float]:
    return [float(w) for w in re.findall(r'<rect [^>]*width="([\d.]+)"', svg)]


def test_bars_are_proportional_to_their_values():
    svg = hbars([("nic", 30.0, ""), ("gpu_slow", 10.0, ""), ("storage", 0.0, "")])
    big, small, none = widths(svg)
    assert small / big == pytest.approx(1 / 3, abs=1e-3) and none == 1.0  # a zero still shows as a hairline


def test_evidence_pairs_the_culprit_with_its_peers_median_and_spread_on_each_features_own_scale():
    f = finding()
    bars = evidence_bars(f)
    assert set(bars) == {0, 1}  # healthy_windows has no peer value: no pair
    work, spread, work_peers = widths(bars[0])
    clock, clock_peers = widths(bars[1])
    # work is compared by robust z: spread = |150 - 100| / 10 = 5 µs, drawn as a band from 95 to 105 µs
    assert peer_spread(f, f.evidence[0]) == 5.0 and peer_spread(f, f.evidence[1]) is None
    assert spread / work == pytest.approx(10 / 150, abs=1e-3) and work_peers / work == pytest.approx(
        100 / 150, abs=1e-3
    )
    assert clock / clock_peers == pytest.approx(1500 / 2000, abs=1e-3)


def test_the_step_strip_fills_the_steps_the_deviation_held_in():
    svg = step_strip([64, 65, 67], 64, 8)
    fills = re.findall(r'fill="(#[0-9a-f]+)"', svg)
    assert len(fills) == 8 and [f == "#c0392b" for f in fills] == [True, True, False, True, False, False, False, False]


def test_the_onset_of_a_slowdown_is_the_first_step_of_the_slow_run_before_the_window():
    assert first_bad_step(series(onset=40), 64)[0] == 40
    assert first_bad_step(series(onset=25), 64)[0] == 25
    assert first_bad_step(series(slow=1.0), 64) is None  # never slower: nothing to mark
    assert first_bad_step(series(onset=60), 40) is None  # the slowdown came after the window


def test_the_step_chart_draws_both_series_the_window_and_the_onset():
    r = report()
    svg = step_chart("j", r.series["j"], r.windows, r.triggers, r.findings)
    assert svg.count("<polyline") == 2 and 'class="window"' in svg and "slower from step 40" in svg
    (onset,) = re.findall(r'class="onset" x1="([\d.]+)"', svg)
    (band,) = re.findall(r'class="window" x="([\d.]+)"', svg)
    assert float(onset) < float(band)  # step 40 lies left of window w64


def test_the_heatmap_colours_slower_red_faster_blue_and_leaves_unflagged_cells_pale():
    svg = heatmap("j", "w64", report().heatmaps[("j", "w64")])
    fills = re.findall(r'class="cell" [^>]*fill="([^"]+)"', svg)
    assert (
        fills[0].startswith("rgba(192,57,43")
        and fills[3].startswith("rgba(36,113,163")
        and fills[1] == fills[2] == "#f4f6f7"
    )
    assert svg.index("worker 13") < svg.index("worker 7")  # the worst row first
    assert "+10" in svg and "-5" in svg


def test_a_finding_says_why_the_window_opened_its_incident_pages_and_what_to_run_next():
    page = render(report(), generated_at=NOW)
    assert "slowdown: median of last 5 steps 250 ms vs baseline 200 ms" in page
    assert "inc1" in page and "oncall (pagerduty): trigger delivered, HTTP 202" in page
    assert "6.1 GPU-h lost so far" in page and "294 GPU-h per day while it lasts" in page
    assert "lockstep raw j --workers 13 --window w64" in page and "nvidia-smi" in page
    assert "150 µs" in page and "1,500 MHz" in page and "± 5 µs" in page  # values in their units, the peers' spread
    assert [c for c, _ in next_commands(finding())][1] == "lockstep findings --job j --open"


def test_the_page_escapes_what_comes_from_the_store_and_says_when_it_is_empty():
    evil = finding(function="<script>alert(1)</script>", summary='"><img src=x onerror=alert(1)>')
    r = report(evil, heatmaps={("j", "w64"): [HeatCell(13, "<b>x</b>", 0, 0, 9.0, 8, 1, 1)]})
    page = render(r, generated_at=NOW)
    assert "<script>" not in page and "<img" not in page and "<b>x" not in page and "&lt;script&gt;" in page
    assert "19.5% of every step" in page and "75%" in page and "3 of 8 steps" in page
    assert "No findings." in render(Report([], [], []))
    assert not re.search(r"<[^>]*\b(src|href)=|url\(|@import", page)  # self-contained: nothing fetched


def test_only_the_live_page_has_a_script_and_it_refreshes_in_place():
    assert "<script" not in render(report(), generated_at=NOW)
    live = render(report(), generated_at=NOW, refresh_s=5)
    assert (
        live.count("<script>") == 1 and "var every = 5000," in live and 'id="content"' in live and 'id="live"' in live
    )


def test_an_undetermined_cause_says_what_was_not_measured():
    f = finding(summary="worker 13: bwd.gemm 30% slower; no sm_clock_mhz samples")
    f.cause = "undetermined"
    f.evidence = [f.evidence[0], Evidence(feature="sm_clock_mhz", value=None, peer_value=None, deviation=None)]
    page = render(report(f), generated_at=NOW)
    assert "<b>not measured</b> sm_clock_mhz" in page and "the samples that would tell" in page
    assert "<b>not measured</b>" not in render(report(), generated_at=NOW)
