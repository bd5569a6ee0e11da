"""The HTML report's pure renderer: pictures proportional to the figures, every store string escaped."""

import datetime as dt
import re

import pytest

from lockstep.schemas.records import Evidence, Finding, Impact
from lockstep.sinks.report import CauseRow, WindowRow, evidence_bars, hbars, render, step_strip


def finding(function="bwd.gemm", summary="worker 13 is slow", steps=(64, 65, 67)):
    return Finding(id="f1", job="j", window="w64", steps=list(steps), scope="worker", workers=[13], hosts=["node0001"], devices=["node0001/gpu5"],
                   function=function, function_kind="compute", cause="gpu_throttle_thermal", confidence=0.97,
                   evidence=[Evidence(feature="work_us", value=150.0, peer_value=100.0, deviation=9.0),
                             Evidence(feature="sm_clock_mhz", value=1500.0, peer_value=2000.0, deviation=-0.25),
                             Evidence(feature="healthy_windows", value=3.0, peer_value=None, deviation=None)],
                   impact=Impact(step_time_share=0.195, gpu_hours_per_day=293.6), policy="p@h", created_at=1_800_000_000.0, summary=summary,
                   window_steps=8)  # fmt: skip


def widths(svg: str) -> list[float]:
    return [float(w) for w in re.findall(r'<rect [^>]*width="([\d.]+)"', svg)]


def test_bars_are_proportional_to_their_values():
    svg = hbars([("nic", 30.0, ""), ("gpu_slow", 10.0, ""), ("storage", 0.0, "")])
    big, small, none = widths(svg)
    assert small / big == pytest.approx(1 / 3, abs=1e-3) and none == 1.0  # a zero still shows as a hairline


def test_evidence_pairs_the_culprit_with_its_peers_on_each_features_own_scale():
    svg = evidence_bars(finding())
    work, work_peers, clock, clock_peers = widths(svg)  # healthy_windows has no peer value: no pair
    assert work_peers / work == pytest.approx(100 / 150, abs=1e-3) and clock / clock_peers == pytest.approx(1500 / 2000, abs=1e-3)
    assert work == clock_peers  # each pair is scaled to its own larger value
    assert "×1.50" in svg and "×0.75" in svg


def test_the_step_strip_fills_the_steps_the_deviation_held_in():
    svg = step_strip([64, 65, 67], 64, 8)
    fills = re.findall(r'fill="(#[0-9a-f]+)"', svg)
    assert len(fills) == 8 and [f == "#c0392b" for f in fills] == [True, True, False, True, False, False, False, False]


def test_the_page_escapes_what_comes_from_the_store_and_says_when_it_is_empty():
    evil = finding(function="<script>alert(1)</script>", summary='"><img src=x onerror=alert(1)>')
    page = render([evil], [WindowRow("j", "w64", 64, 8, 0.75, 1, "timeout", "2026-11-29 10:00:00")],
                  [CauseRow("gpu_throttle_thermal", 2, 1, 293.6, 12.5)], generated_at=dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc))  # fmt: skip
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert page.count("<svg") == 4  # lost by cause, evidence, steps, windows
    assert "19.5% of the step" in page and "75%" in page and "3 of 8 steps" in page
    assert "No findings." in render([], [], [])


def test_an_undetermined_cause_says_what_was_not_measured():
    f = finding(summary="worker 13: bwd.gemm 30% slower; no sm_clock_mhz samples")
    f.cause = "undetermined"
    f.evidence = [f.evidence[0], Evidence(feature="sm_clock_mhz", value=None, peer_value=None, deviation=None)]
    page = render([f], [], [CauseRow("undetermined", 1, 1, 293.6, 12.5)])
    assert "<b>not measured</b> sm_clock_mhz" in page and page.count("<svg") == 3  # lost by cause, evidence (work only), steps
