"""Baseline windows end to end: the detector profiles a healthy job on its own, the window stage keeps
that window as the job's healthy past, and a later job-wide regression (no outlier: every worker is
slower in one function) is found against it.  Real processor and sink, the simulated fleet following
the control topic as agents do."""

import dataclasses
from pathlib import Path

import duckdb
import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.live import run_live
from lockstep.sinks.http import query, wait_for
from lockstep.streams.app import changelog_topics

pytestmark = pytest.mark.integration

SUITE = Path(__file__).resolve().parents[2] / "suites" / "standard"
POLICY = """id: baseline-itest
detector: {baseline_steps: 10, recent_steps: 3, slowdown_threshold: 0.1, baseline_every_steps: 40, cooldown_steps: 5,
           window_steps: 8, small_job_window_steps: 8, control_latency_s: 0.2}
"""


def test_a_baseline_window_lets_the_processor_find_a_job_wide_regression(settings, tmp_path):
    scenario = Scenario.load(SUITE / "regression-00-16w.yaml")  # bwd.gemm 44% slower on every worker
    (fault,) = scenario.faults
    scenario = dataclasses.replace(scenario, baseline=None, faults=(dataclasses.replace(fault, start_step=75),))
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    s = dataclasses.replace(settings, policy=policy)
    topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    pipeline = Pipeline(s, tmp_path)
    control = Tail(consumer_config(s, None), topics.control).open()
    try:
        pipeline.start("sink", 30)
        pipeline.start("processor", 45)
        live = run_live(
            FleetSimulator(scenario),
            Publisher(producer_config(s)),
            control,
            topics,
            steps_per_s=10,
            max_steps=400,
            stop_after_windows=2,
        )
        assert [t.kind for t in live.triggers[:2]] == ["baseline", "slowdown"], [
            (t.kind, t.reason) for t in live.triggers
        ]
        baseline, slowdown = live.triggers[:2]
        assert (
            baseline.start_step + baseline.steps <= 75 < slowdown.start_step
        )  # healthy, then after the regression began

        windows = {baseline.window, slowdown.window}

        def stored() -> bool:
            return (
                query(s.db, "SELECT count(*) FROM windows WHERE list_contains(?, window_id)", [sorted(windows)])[1][0][
                    0
                ]
                == 2
            )

        assert wait_for(stored, 60), "the two windows did not reach DuckDB"
    finally:
        control.close()
        pipeline.stop()
    with duckdb.connect(str(s.db), read_only=True) as con:
        assert con.execute("SELECT findings FROM windows WHERE window_id = ?", [baseline.window]).fetchone() == (
            0,
        )  # healthy: the job's history
        found = con.execute("SELECT window_id, scope, cause, function FROM findings").fetchall()
        kinds = dict(con.execute("SELECT window_id, kind FROM triggers").fetchall())
    assert (kinds[baseline.window], kinds[slowdown.window]) == ("baseline", "slowdown")
    assert (slowdown.window, "job", "regression", fault.function) in found, found
