"""The report and the sink's live page in a real browser (headless Chromium): what is on screen, no script
errors, the live page refreshing itself; screenshots kept as test artifacts (LOCKSTEP_ARTIFACTS, default
.artifacts/ in the repository)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.commands.report import live_url
from lockstep.schemas.records import DeviationMap, Evidence, Finding, Impact, ProfileTrigger, StepSeries, WindowReport
from lockstep.sinks.http import query
from lockstep.sinks.report.data import gather
from lockstep.sinks.report.page import Report, render
from lockstep.sinks.store import Batch, FindingsStore

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
EVIL = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"

needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs Debian's chromium)"
)


def artifacts() -> Path:
    out = Path(os.environ.get("LOCKSTEP_ARTIFACTS", ROOT / ".artifacts")) / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One headless Chromium run, with a profile of its own (removed after it): two runs at once never share one."""
    with tempfile.TemporaryDirectory(prefix="lockstep-chromium-", ignore_cleanup_errors=True) as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--window-size=1280,2400",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def build_store(path: Path, now: float) -> None:
    """A job whose worker 13 throttles from step 40, one window that found it, its step times and heatmap."""
    ev = [
        Evidence(feature="work_us", value=105_885.0, peer_value=80_041.0, deviation=15.2),
        Evidence(feature="sm_clock_mhz", value=1522.0, peer_value=1981.0, deviation=-0.23),
        Evidence(feature="gpu_temp_c", value=83.9, peer_value=64.1, deviation=0.31),
        Evidence(feature="clock_events", value=96.0, peer_value=0.0, deviation=96.0),
    ]
    f = Finding(
        id="f-demo",
        job="demo-job",
        window="w64",
        steps=list(range(64, 72)),
        scope="worker",
        workers=[13],
        hosts=["node0001"],
        devices=["node0001/gpu5"],
        function="bwd.gemm",
        function_kind="compute",
        cause="gpu_throttle_thermal",
        confidence=0.99,
        evidence=ev,
        impact=Impact(step_time_share=0.186, gpu_hours_per_day=285.0),
        policy="default@x",
        created_at=now,
        summary="worker 13 on node0001/gpu5: bwd.gemm 32% slower than its 63 peers in 8/8 steps",
        window_steps=8,
    )
    odd = Finding(
        id="f-odd",
        job="demo-job",
        window="w64",
        steps=[66],
        scope="worker",
        workers=[29],
        hosts=["node0003"],
        devices=[],
        function=EVIL,
        function_kind="python",
        cause="unknown",
        confidence=0.4,
        evidence=[Evidence(feature="work_us", value=900.0, peer_value=100.0, deviation=9.0)],
        impact=Impact(step_time_share=0.004, gpu_hours_per_day=6.0),
        policy="default@x",
        created_at=now,
        summary=EVIL,
        window_steps=8,
    )
    w = WindowReport(
        job="demo-job",
        window="w64",
        start_step=64,
        steps=8,
        steps_seen=8,
        expected_workers=64,
        workers_seen=64,
        coverage=1.0,
        bytes_per_worker=20_000.0,
        findings=2,
        actionable=True,
        reached_device=True,
        closed="complete",
        closed_at=now,
    )
    t = ProfileTrigger(
        job="demo-job",
        window="w64",
        start_step=64,
        steps=8,
        expected_workers=64,
        created_at=now - 5,
        reason="slowdown: median of last 5 steps 252.8 ms vs baseline 211.0 ms (+20%); starts 23 steps ahead",
    )
    steps = list(range(76))
    times = [211_000.0 + (s % 4) * 900 + (47_000.0 if s >= 40 else 0.0) for s in steps]
    series = StepSeries(
        job="demo-job", steps=steps, step_time_us=times, median_us=[208_000.0] * len(steps), workers=[64] * len(steps)
    )
    workers, functions = [13, 29, 58, 20, 7, 44], ["bwd.gemm", "fwd.gemm", "fwd.attention", "bwd.attention", "fwd.loss"]
    z = [
        [15.2, 14.1, 8.3, 8.0, None],
        [None, None, None, None, 119.0],
        [None, None, 5.1, None, None],
        [None, None, -4.2, None, None],
        [None, 4.4, None, None, None],
        [None, None, None, -4.1, None],
    ]
    dmap = DeviationMap(
        job="demo-job",
        window="w64",
        start_step=64,
        steps=8,
        workers=workers,
        functions=functions,
        z=z,
        # worker 29's fwd.loss spiked in one step (a one-off, far beyond the peers' spread); the rest held in all 8
        flagged=[[(1 if x == 119.0 else 8) if x is not None else 0 for x in row] for row in z],
        workers_total=6,
        functions_total=5,
        created_at=now,
    )
    store = FindingsStore(path)
    store.write(Batch([f, odd], [w], {}, triggers=[t], series=[series], maps=[dmap]), now=now)
    store.close()


def hottest_cell(dom: str) -> str:
    """The tooltip of the heatmap's most saturated cell, as the browser has it."""
    cells = re.findall(r'class="cell[^"]*"[^>]*fill="rgba\([\d,]+,([\d.]+)\)"[^>]*><title>([^<]*)', dom)
    return max(cells, key=lambda c: float(c[0]))[1]


def dom_checks(dom: str) -> None:
    assert len(re.findall(r'<svg class="steps"', dom)) == 1
    # 6 workers x 5 functions and the odd finding's function; a row for the culprit's GPU
    assert len(re.findall(r'<svg class="heatmap"', dom)) == 1 and len(re.findall(r'class="cell[ "]', dom)) == 37
    # the finding, not worker 29's one-step spike of 119 spreads
    assert hottest_cell(dom).startswith("worker 13 · bwd.gemm")
    assert len(re.findall(r'class="cell (device )?finding"', dom)) == 3  # the findings' cells outlined
    assert len(re.findall(r'class="card finding"', dom)) == 2 and 'class="evidence"' in dom
    assert (
        "slower from step 40" in dom
        and "105.9 ms" in dom
        and "1,522 MHz" in dom
        and "lockstep raw demo-job --workers 13" in dom
    )
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert (
        "data-pwned" not in body and "data-script-error" not in body
    )  # the store's strings stayed text; no script failed
    assert "&lt;img src=x" in dom and not re.search(r"<img\b", dom)


@needs_browser
def test_the_report_renders_in_a_browser(tmp_path):
    import time

    db = tmp_path / "f.duckdb"
    build_store(db, time.time())
    page = tmp_path / "report.html"
    page.write_text(render(gather(lambda sql, params=None: query(db, sql, params)), title="Lockstep report"))
    r = chromium("--dump-dom", page.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom_checks(r.stdout)
    shot = artifacts() / "report.png"
    r = chromium(f"--screenshot={shot}", page.as_uri())
    assert r.returncode == 0 and shot.stat().st_size > 50_000, r.stderr[-2000:]


@needs_browser
def test_the_live_page_renders_refreshes_itself_and_raises_no_script_error(settings, tmp_path):
    import time

    build_store(settings.db, time.time())
    port = free_port()
    sink = Child(
        "sink",
        ["sink", *settings_flags(settings, "sink"), "--http-port", str(port)],
        tmp_path,
        f"http://127.0.0.1:{port}/healthz",
    )
    try:
        sink.wait_healthy(60)
        url = live_url(settings.db)
        # virtual time: the page's timers run (it refreshes every 10 s) without the test waiting that long
        r = chromium("--virtual-time-budget=25000", "--enable-logging=stderr", "--v=0", "--dump-dom", url)
        assert r.returncode == 0, r.stderr[-2000:]
        dom = r.stdout
        dom_checks(dom)
        refreshed = re.search(r'data-refreshed="(\d+)"', dom)
        assert refreshed and int(refreshed.group(1)) >= 1, dom[
            :500
        ]  # it fetched itself again and swapped the content in
        assert re.search(r'id="live" class="ok">live: updated', dom)
        assert "Uncaught" not in r.stderr  # no script error in the console either
        shot = artifacts() / "live-page.png"
        r = chromium(f"--screenshot={shot}", url)
        assert r.returncode == 0 and shot.stat().st_size > 50_000, r.stderr[-2000:]
    finally:
        sink.stop()


@needs_browser
def test_the_demo_jobs_window_in_a_browser_shows_its_culprit_hottest(tmp_path):
    from tests.sinks.report.test_page_pictures import demo_window

    findings, cells, window, series = demo_window(before=40)
    (f,) = findings
    r = Report(findings, [window], [], series={f.job: series}, heatmaps={(f.job, f.window): cells})
    page = tmp_path / "demo.html"
    page.write_text(render(r, title="Lockstep demo: demo-job"))
    out = chromium("--dump-dom", page.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    assert hottest_cell(out.stdout).startswith(f"worker 13 · {f.function}") and "data-script-error" not in out.stdout
    assert "slower from step 40" in out.stdout  # the onset, 24 steps before the window
    shot = artifacts() / "demo-window.png"
    out = chromium(f"--screenshot={shot}", page.as_uri())
    assert out.returncode == 0 and shot.stat().st_size > 50_000, out.stderr[-2000:]


@needs_browser
def test_the_offline_report_of_lockstep_diagnose_renders_in_a_browser(tmp_path, capsys):
    from lockstep.commands.cli import main

    page = tmp_path / "offline.html"
    traces = sorted((ROOT / "tests" / "data" / "traces").glob("sampled_rank-*.json.gz"))
    assert main(["diagnose", *map(str, traces), "--report", str(page)]) == 0, capsys.readouterr().err
    out = chromium("--dump-dom", page.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert len(re.findall(r'<svg class="steps"', dom)) == 1 and len(re.findall(r'class="rank"', dom)) == 2
    assert len(re.findall(r'<svg class="heatmap"', dom)) == 1 and 'class="cell finding"' in dom
    assert 'class="card finding"' in dom and "input_imbalance" in dom and "decided the cause" in dom
    assert "<script" not in dom and not re.search(r"<[^>]*\b(src|href)=", dom)  # self-contained, static
    shot = artifacts() / "offline-report.png"
    out = chromium(f"--screenshot={shot}", page.as_uri())
    assert out.returncode == 0 and shot.stat().st_size > 50_000, out.stderr[-2000:]
