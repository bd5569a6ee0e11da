"""The pipeline as separate processes against a real broker: the finding lands in DuckDB."""

import re
from pathlib import Path

import duckdb
import pytest

from lockstep.app.demo import default_scenario, run_demo
from lockstep.kafka import Topics, features_key, read_all, window_features_key
from lockstep.schemas.records import ProfileTrigger, StepReport, StepSlice, WindowExpected, WindowFeatures, decode

pytestmark = pytest.mark.integration


def test_injected_fault_is_diagnosed_end_to_end(settings, tmp_path):
    scenario = default_scenario(workers=32, fault="gpu_throttle_thermal", culprit=13)
    res = run_demo(settings, scenario, timeout_s=120, steps_per_s=20, keep_logs=tmp_path / "logs")

    con = duckdb.connect(str(settings.db), read_only=True)
    rows = con.execute(
        "SELECT workers, function, function_kind, cause, devices, confidence, len(steps) FROM findings"
    ).fetchall()
    assert len(rows) == 1, rows
    workers, function, kind, cause, devices, confidence, n_steps = rows[0]
    assert workers == [13]
    assert kind == "compute" and function in ("fwd.gemm", "bwd.gemm", "fwd.attention", "bwd.attention")
    assert cause == "gpu_throttle_thermal"
    assert devices == ["node0001/gpu5"]
    assert confidence > 0.7 and n_steps == 8
    ((coverage, closed, expected),) = con.execute("SELECT coverage, closed, expected_workers FROM windows").fetchall()
    assert (coverage, closed, expected) == (1.0, "complete", 32)

    # the records really travelled through Kafka: one per worker and window, keyed job:window:shard; the shard
    # stage's slices (one per step: the 32 workers are one shard), keyed job:step
    topics = Topics.named(settings.topic_prefix)
    recs = read_all(settings, [topics.control, topics.windowfeatures, topics.features, topics.stepreports])
    (trigger,) = [decode(v, ProfileTrigger) for _, v in recs[topics.control]]
    records = [(k, decode(v, WindowFeatures)) for k, v in recs[topics.windowfeatures]]
    assert sorted(r.worker.rank for _, r in records) == list(range(32)) and all(
        len(r.steps) == trigger.steps for _, r in records
    )
    assert all(k == window_features_key(r.job, r.window, 0) for k, r in records)
    slices = [(k, decode(v, StepSlice)) for k, v in recs[topics.features]]
    assert sorted(s.step for _, s in slices) == list(range(trigger.start_step, trigger.start_step + trigger.steps))
    assert all(k == features_key(s.job, s.step) and s.missing == [] for k, s in slices)
    on_stepreports = [decode(v) for _, v in recs[topics.stepreports]]
    reports = [r for r in on_stepreports if isinstance(r, StepReport)]
    # the detect stage announced the window to the window stage, on the same topic
    assert [r.window for r in on_stepreports if isinstance(r, WindowExpected)] == [trigger.window]
    assert sorted(r.step for r in reports) == list(range(trigger.start_step, trigger.start_step + trigger.steps))
    assert {t.topic: t.records for t in res.topics}[topics.findings] == 1

    # every SQL example of the README runs on the file the demo leaves, and the main ones find the fault
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = [
        q
        for q in re.findall(r'lockstep query (?:--tenant \S+ )?"(.*?)"', readme, re.S)
        if q.lstrip().upper().startswith("SELECT")
    ]
    assert len(examples) >= 10
    answers = {q: con.execute(q).fetchall() for q in examples}
    by_view = {name: rows for q, rows in answers.items() for name in re.findall(r"FROM (\w+)", q)}
    assert by_view["findings"] and by_view["open_findings"] and by_view["incident_events"]
    assert by_view["top_culprits"][0][:2] == ("node0001", "node0001/gpu5")
    assert by_view["gpu_hours_lost_by_cause"][0][0] == "gpu_throttle_thermal"

    # the HTML report reads the same file: the finding's evidence, the job's step time, the window's heatmap
    from lockstep.sinks.http import query
    from lockstep.sinks.report.data import gather
    from lockstep.sinks.report.page import render

    con.close()
    data = gather(lambda sql, params=None: query(settings.db, sql, params))
    assert (
        [f.devices for f in data.findings] == [["node0001/gpu5"]]
        and len(data.windows) == 1
        and data.causes[0].cause == "gpu_throttle_thermal"
    )
    # the processor published the job's step times: every step the fleet ran up to the window's end, each from all 32 workers
    points = data.series["demo-job"]
    steps = [p.step for p in points]
    assert (
        steps == list(range(steps[0], steps[-1] + 1))
        and steps[0] <= 5
        and steps[-1] >= trigger.start_step + trigger.steps - 1
    )
    assert all(p.workers == 32 for p in points[:-3])
    slow = [p.step_time_us for p in points if trigger.start_step <= p.step < trigger.start_step + trigger.steps]
    healthy = [p.step_time_us for p in points if p.step < 35]
    assert min(slow) > max(healthy)  # the throttled GPU (from step 40) makes every step slower
    # ... and the window's heatmap: worker 13 is the worst row, slower than its peers in a compute kernel
    cells = data.heatmaps[("demo-job", trigger.window)]
    top = min(cells, key=lambda c: (c.worker_rank, c.function_rank))
    assert top.worker == 13 and top.z > 4 and top.flagged_steps == 8
    page = render(data)
    assert "node0001/gpu5" in page and 'class="steps"' in page and 'class="heatmap"' in page
    assert "slower from step" in page  # the onset of the slowdown, from the series


def test_the_demos_hang_is_diagnosed_end_to_end(settings, tmp_path):
    """``lockstep demo --fault hang``: the simulated job stops, the detector's hang trigger is answered by every
    simulated agent, the hang stage names the culprit, the sink stores it."""
    from lockstep.app.demo import hang_scenario

    scenario, hang = hang_scenario(workers=16, culprit=5, at_step=40)
    res = run_demo(settings, scenario, timeout_s=120, steps_per_s=20, keep_logs=tmp_path / "logs", hang=hang)
    rows = (
        duckdb.connect(str(settings.db), read_only=True)
        .execute("SELECT workers, function, devices, summary FROM findings WHERE cause = 'hang'")
        .fetchall()
    )
    assert len(rows) == 1, rows
    workers, function, devices, summary = rows[0]
    assert workers == [5] and "DataLoader" in function and devices == ["node0000/gpu5"]
    assert "15 of 16 answering workers wait in" in summary
    assert res.findings and res.findings[0]["cause"] == "hang"
