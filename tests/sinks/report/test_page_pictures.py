"""The page's pictures read right at a glance: a robust step-time axis with outliers marked, labels that never
overlap, a heatmap of significance where the demo job's culprit is the hottest cell, evidence that leads with what
decided the cause, and figures in the job's own units."""

from __future__ import annotations

import itertools
import re
import time

import pytest

from lockstep.app.demo import default_scenario
from lockstep.app.output import evidence_line
from lockstep.producers.simulator.fleet import FleetSimulator
from lockstep.schemas import functions as ft
from lockstep.schemas.records import Evidence, ProfileTrigger, to_builtins
from lockstep.sinks.report.page import (
    BAD,
    HeatCell,
    Report,
    SeriesPoint,
    TriggerRow,
    WindowRow,
    coverage_colour,
    device_kind,
    device_rows,
    evidence_table,
    first_bad_step,
    heatmap,
    jobs_by_cost,
    render,
    robust_range,
    significance,
    step_chart,
)
from lockstep.streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window
from lockstep.streams.pictures import deviation_map
from lockstep.streams.policy import Policy
from lockstep.units import hours, number, unit_label
from tests.sinks.report.test_page import finding


def demo_window(start: int = 64, steps: int = 8, before: int = 0):
    """The demo's job (``lockstep demo``: 64 workers, worker 13's GPU throttles from step 40), one window of it through
    the step and window stages as the processor runs them: (findings, heatmap cells, window row, step series of the
    window and the ``before`` steps before it)."""
    sc, policy = default_scenario(), Policy()
    sim, n = FleetSimulator(sc), sc.topology.workers
    trig = ProfileTrigger(job=sc.job, window=f"w{start}", start_step=start, steps=steps, expected_workers=n)
    results, series = [], []
    for s in range(start - before, start + steps):
        batches = list(sim.feature_batches(sim.step(s), trig))
        times = sorted(b.step_time_us for b in batches)
        series.append(SeriesPoint(s, times[-1], times[len(times) // 2], len(times)))
        if s < start:
            continue
        frame = StepFrame.from_tables(
            sc.job,
            trig.window,
            s,
            [b.worker for b in batches],
            [b.step_time_us for b in batches],
            [ft.unpack(b.functions) for b in batches],
            policy.diagnosis.peer_group_keys,
            [b.hardware for b in batches],
        )
        results.append(analyze_step(frame, policy.diagnosis))
    d = diagnose_window(WindowInfo(sc.job, trig.window, start, steps, n), results, policy, now=time.time())
    m = deviation_map(sc.job, trig.window, "", start, steps, results, now=time.time())
    cells = [
        HeatCell(w, fn, i, j, m.z[i][j], m.flagged[i][j], m.workers_total, m.functions_total)
        for i, w in enumerate(m.workers)
        for j, fn in enumerate(m.functions)
    ]
    window = WindowRow(sc.job, trig.window, start, steps, 1.0, len(d.findings), "complete", "2026-12-01 10:00:00", n, n)
    return d.findings, cells, window, series


@pytest.fixture(scope="module")
def demo():
    return demo_window()


def test_the_demo_jobs_culprit_is_the_hottest_cell_of_the_heatmap(demo):
    findings, cells, window, _ = demo
    (f,) = findings
    assert (f.workers, f.function, f.cause) == ([13], "bwd.gemm", "gpu_throttle_thermal")
    heat = sorted(
        ((significance(c.z, c.flagged_steps, window.steps), c.worker, c.function) for c in cells), reverse=True
    )
    assert heat[0][1:] == (13, "bwd.gemm") and heat[0][0] > heat[1][0]
    # a one-step spike far beyond the culprit's deviation (the simulator's noise has them) is paler than the culprit
    spikes = [c for c in cells if c.z is not None and abs(c.z) > 20 and c.flagged_steps == 1]
    assert all(significance(c.z, 1, window.steps) < heat[0][0] / 2 for c in spikes)
    svg = heatmap(f.job, f.window, cells, findings, window.steps)
    (outlined,) = re.findall(r'<rect class="cell finding"[^>]*><title>([^<]*)</title>', svg)
    assert outlined.startswith("worker 13 · bwd.gemm") and "held in 8 of 8 steps" in outlined
    alpha = {
        t: float(a)
        for a, t in re.findall(r'class="cell[^"]*"[^>]*fill="rgba\([\d,]+,([\d.]+)\)"[^>]*><title>([^<]*)', svg)
    }
    hottest = max(alpha, key=alpha.get)
    assert hottest.startswith("worker 13 · bwd.gemm")
    assert (
        "\N{GREEK SMALL LETTER SIGMA}</text>" in svg and ">8/8</text>" in svg
    )  # deviations in spreads, and the steps they held


def test_significance_weighs_the_deviation_by_the_steps_it_held():
    assert significance(14.0, 8, 8) > significance(300.0, 1, 8) > 0
    assert significance(None, 8, 8) == significance(9.0, 0, 8) == 0.0
    assert significance(1e6, 8, 8) == 1.0 and significance(-14.0, 8, 8) == significance(14.0, 8, 8)


def test_links_and_devices_get_rows_of_their_own_and_a_link_cell_does_not_read_zero():
    nic = finding(function="nccl:all_reduce[dp]", steps=range(64, 72))
    nic.cause, nic.workers, nic.devices = "nic", [28, 29], ["node0003/bond1"]
    nic.evidence = [
        Evidence(feature="work_us", value=7000.0, peer_value=7000.0, deviation=0.0),
        Evidence(feature="nic_gbps", value=11.0, peer_value=11.2, deviation=-0.02),
        Evidence(feature="nic_gbps_sd", value=0.5, peer_value=4.0, deviation=-0.875),
    ]
    cells = [HeatCell(w, "nccl:all_reduce[dp]", i, 0, 0.0, 8, 2, 1) for i, w in enumerate((28, 29))]
    (row,) = device_rows([nic])
    assert (row.device, row.label, row.held) == ("node0003/bond1", "NIC spread -88%", 8)  # what decided: the spread
    svg = heatmap("j", "w64", cells, [nic], 8)
    assert "node0003/bond1" in svg and "-88%" in svg and 'class="cell device finding"' in svg
    assert ">link</text>" in svg and ">+0" not in svg
    assert len(re.findall(r'class="cell finding"', svg)) == 2  # both workers' cells outlined


def test_evidence_leads_with_what_decided_the_cause_and_is_never_cut_mid_figure():
    f = finding()  # thermal throttling: work, SM clock, healthy windows as the diagnosis gives them
    f.evidence.append(Evidence(feature="clock_events", value=96.0, peer_value=0.0, deviation=96.0))
    rows = re.findall(r"<tr[^>]*><td><abbr[^>]*>([^<]*)</abbr>", evidence_table(f))
    assert rows[:3] == ["clock events", "SM clock", "work"]
    assert "decided the cause" in evidence_table(f)
    ev = [to_builtins(e) for e in f.evidence]
    line = evidence_line(f.cause, ev, width=110)
    assert line.startswith("clock events 0x60 (SW thermal slowdown, HW thermal slowdown) vs none; SM clock")
    assert len(line) <= 110 and line.endswith(" (+2)")  # whole items, then how many more
    for item in line.rsplit(" (+", 1)[0].split("; "):
        assert re.fullmatch(r"[\w ]+ .+ vs .+|healthy windows 3", item), item  # each one whole: value vs peers
    assert evidence_line(f.cause, ev, width=1000).count("; ") == 3  # room for all: all


def steady(n=120, level=110_000.0, onset=None, after=144_000.0, first=None):
    pts = []
    for s in range(n):
        v = (after if onset is not None and s >= onset else level) + (s % 3) * 150
        pts.append(SeriesPoint(s, first if (first and s == 0) else v, v * 0.99, 4))
    return pts


def window(job="j", start=100, steps=8, name=None, findings=1):
    return WindowRow(job, name or f"w{start}", start, steps, 1.0, findings, "complete", "2026-12-01 10:00:00", 4, 4)


def ys(svg: str, cls: str) -> list[float]:
    pts = re.search(rf'class="{cls}" points="([^"]+)"', svg).group(1)
    return [float(p.split(",")[1]) for p in pts.split()]


def test_a_first_step_of_seconds_is_clipped_and_marked_and_the_slowdown_fills_the_chart():
    pts = steady(onset=60, first=2_840_000.0)
    yr = robust_range(pts)
    assert [p.step for p in yr.clipped] == [0] and yr.hi < 200_000 and yr.lo > 50_000
    svg = step_chart("j", pts, [window()], {}, [finding()])
    slow = ys(svg, "slowest")
    assert slow[30] - slow[80] > 80  # 110 -> 144 ms spans most of the plot's height (pixels grow downwards)
    assert 'class="clipped"' in svg and "off the scale: 1 step, up to 2.84 s (step 0)" in svg
    assert "slower from step 60" in svg


def test_a_2_percent_slowdown_is_visible_and_gets_an_onset_marker():
    pts = steady(level=200_000.0, onset=50, after=204_000.0)
    assert first_bad_step(pts, 100)[0] == 50
    assert first_bad_step(steady(level=200_000.0), 100) is None  # its jitter alone marks nothing
    svg = step_chart("j", pts, [window()], {}, [finding()])
    slow = ys(svg, "slowest")
    assert slow[20] - slow[70] > 40 and 'class="onset"' in svg
    noisy = [SeriesPoint(s, 200_000.0 * (1 + 0.05 * ((s * 7919) % 11 - 5) / 5), 200_000.0, 4) for s in range(100)]
    assert first_bad_step(noisy, 100) is None  # a noisy job's jitter is no slowdown


def test_a_slowdown_long_before_its_window_is_marked_where_the_detector_found_it_began():
    # a processor that caught up late (or windows that found nothing) opened the first finding's window 1,500 steps
    # into the slowdown: the series alone then has the slow level as its baseline and marks nothing at the onset
    pts = steady(n=1700, onset=120)
    late = window(start=1615)
    assert first_bad_step(pts, 1615) is None or first_bad_step(pts, 1615)[0] > 1000
    trig = {("j", "w1615"): TriggerRow("j", "w1615", "slowdown", "slowdown", 1615, 8, "2026-12-01 10:00:00", 120)}
    svg = step_chart("j", pts, [late], trig, [finding()])
    assert "slower from step 120 (110.2 ms → 144.2 ms, +31%)" in svg
    assert "slower from step 120" not in step_chart("j", pts, [late], {}, [finding()])  # without the detector's onset


def test_labels_live_in_strips_of_their_own_and_never_overlap():
    pts = steady(n=400, onset=250)
    wins = [window(start=s, name=f"w{s}") for s in (300, 305, 310, 360)]  # close windows: their labels would collide
    trig = {("j", "w300"): TriggerRow("j", "w300", "slowdown", "slowdown: +30%", 300, 8, "2026-12-01 10:00:00")}
    svg = step_chart("j", pts, wins, trig, [finding()])
    top = min(float(y) for y in re.findall(r'class="window" x="[\d.]+" y="([\d.]+)"', svg))
    labels = [(float(x), t) for x, t in re.findall(r'class="label window-label" x="([\d.]+)"[^>]*>(w\d+)', svg)]
    assert labels and all(
        float(y) < top for y in re.findall(r'class="label window-label" x="[\d.]+" y="([\d.]+)"', svg)
    )
    spans = sorted((x - 3.1 * len(t), x + 3.1 * len(t)) for x, t in labels)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))  # no two window labels overlap
    assert len(re.findall(r'class="window-mark"', svg)) == 4  # every window is marked, labelled or not
    onset_y = float(re.search(r'class="label onset-label" x="[\d.]+" y="([\d.]+)"', svg).group(1))
    label_y = float(re.search(r'class="label window-label" x="[\d.]+" y="([\d.]+)"', svg).group(1))
    legend_y = float(re.search(r'class="axis legend" x="[\d.]+" y="([\d.]+)"', svg).group(1))
    plot_bottom = max(
        float(y) + float(h) for y, h in re.findall(r'class="window" [^>]*y="([\d.]+)" [^>]*height="([\d.]+)"', svg)
    )
    assert onset_y < label_y < top < plot_bottom < legend_y  # onset, windows, plot, legend: each its own band


def test_figures_in_the_jobs_units_jobs_by_cost_and_coverage_red_only_when_low():
    assert number(4.1e-06) == "< 0.0001" and "e-" not in number(-3e-9)
    assert hours(285.0) == "285 GPU-h" and hours(0.05, "CPU") == "3 CPU-min" and hours(4.1e-06) == "0.0148 GPU-s"
    assert unit_label("us") == "µs"
    cpu = finding()
    cpu.devices = ["worker0/cpu"]
    host = finding(function="dataloader.next")
    host.devices = ["node0003"]  # a host's finding says nothing of the job's devices
    assert device_kind([finding()]) == device_kind([host]) == device_kind([]) == "GPU" and device_kind([cpu]) == "CPU"
    page = render(Report([cpu], [window(findings=1)], []), generated_at=None)
    assert "CPU-h per day" in page and "GPU-h" not in page and ">µs<" in page and ">us<" not in page
    # a real CPU-only job's finding names the host, not a worker's CPU: its workers' kind, carried from their agents'
    # devices, decides (it said GPU-h before)
    cpu_host = finding(function="preprocess")
    cpu_host.devices, cpu_host.device_kind = ["vm"], "cpu"
    assert device_kind([cpu_host]) == "CPU"
    page = render(Report([cpu_host], [window(findings=1)], []), generated_at=None)
    assert "CPU-h per day" in page and "GPU-h" not in page
    gpu_host = finding(function="dataloader.next")
    gpu_host.devices, gpu_host.device_kind = ["worker0/cpu"], "gpu"  # the workers' kind wins over a name
    assert device_kind([gpu_host]) == device_kind([gpu_host, cpu_host]) == "GPU"
    cheap, dear = finding(), finding()
    cheap.job, dear.job = "a-cheap", "z-dear"
    cheap.impact.gpu_hours_per_day, dear.impact.gpu_hours_per_day = 1.0, 500.0
    assert jobs_by_cost(Report([cheap, dear], [], [], series={"m-idle": steady(n=3)})) == [
        "z-dear",
        "a-cheap",
        "m-idle",
    ]
    assert coverage_colour(1.0) != BAD and coverage_colour(0.2) == BAD
