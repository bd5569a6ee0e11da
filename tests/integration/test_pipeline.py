"""The pipeline as separate processes against a real broker: the finding lands in DuckDB."""

import re
from pathlib import Path

import duckdb
import pytest

from lockstep.demo import default_scenario, run_demo
from lockstep.kafka import Topics, features_key, read_all
from lockstep.schemas.records import FeatureBatch, ProfileTrigger, StepReport, decode

pytestmark = pytest.mark.integration


def test_injected_fault_is_diagnosed_end_to_end(settings, tmp_path):
    scenario = default_scenario(workers=32, fault="gpu_throttle_thermal", culprit=13)
    res = run_demo(settings, scenario, timeout_s=120, steps_per_s=20, keep_logs=tmp_path / "logs")

    con = duckdb.connect(str(settings.db), read_only=True)
    rows = con.execute("SELECT workers, function, function_kind, cause, devices, confidence, len(steps) FROM findings").fetchall()
    assert len(rows) == 1, rows
    workers, function, kind, cause, devices, confidence, n_steps = rows[0]
    assert workers == [13]
    assert kind == "compute" and function in ("fwd.gemm", "bwd.gemm", "fwd.attention", "bwd.attention")
    assert cause == "gpu_throttle_thermal"
    assert devices == ["node0001/gpu5"]
    assert confidence > 0.7 and n_steps == 8
    (coverage, closed, expected), = con.execute("SELECT coverage, closed, expected_workers FROM windows").fetchall()
    assert (coverage, closed, expected) == (1.0, "complete", 32)

    # the records of a step really travelled through Kafka, keyed job:step
    topics = Topics.named(settings.topic_prefix)
    recs = read_all(settings, [topics.control, topics.features, topics.stepreports])
    (trigger,) = [decode(v, ProfileTrigger) for _, v in recs[topics.control]]
    batches = [(k, decode(v, FeatureBatch)) for k, v in recs[topics.features]]
    assert len(batches) == 32 * trigger.steps
    assert all(k == features_key(b.job, b.step) for k, b in batches)
    reports = [decode(v, StepReport) for _, v in recs[topics.stepreports]]
    assert sorted(r.step for r in reports) == list(range(trigger.start_step, trigger.start_step + trigger.steps))
    assert {t.topic: t.records for t in res.topics}[topics.findings] == 1

    # every SQL example of the README runs on the file the demo leaves, and the main ones find the fault
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = [q for q in re.findall(r'lockstep query (?:--tenant \S+ )?"(.*?)"', readme, re.S) if q.lstrip().upper().startswith("SELECT")]
    assert len(examples) >= 10
    answers = {q: con.execute(q).fetchall() for q in examples}
    by_view = {name: rows for q, rows in answers.items() for name in re.findall(r"FROM (\w+)", q)}
    assert by_view["findings"] and by_view["open_findings"] and by_view["incident_events"]
    assert by_view["top_culprits"][0][:2] == ("node0001", "node0001/gpu5")
    assert by_view["gpu_hours_lost_by_cause"][0][0] == "gpu_throttle_thermal"

    # the HTML report reads the same file: the finding's evidence and the window, as pictures
    from lockstep.commands.report import gather
    from lockstep.sinks.report import render

    con.close()
    found, windows, causes = gather(settings.db)
    assert [f.devices for f in found] == [["node0001/gpu5"]] and len(windows) == 1 and causes[0].cause == "gpu_throttle_thermal"
    page = render(found, windows, causes)
    assert page.count("<svg") == 4 and "node0001/gpu5" in page
