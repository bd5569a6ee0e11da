"""A small slowdown, live: the standard suite's slow-NIC job (+1.8% step time) published step by step next to a
real processor and sink under the default policy.  The detector must profile it on its own, and the window's
diagnosis must name the NIC.  Before issue 15 (a fixed 15% threshold) this job was never profiled."""

from pathlib import Path

import duckdb
import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.live import run_live
from lockstep.sinks.http import query, wait_for
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

SUITE = Path(__file__).resolve().parents[2] / "suites" / "standard"


def test_a_slow_nic_is_profiled_by_the_default_detector_and_diagnosed(settings, tmp_path):
    scenario = Scenario.load(SUITE / "nic-00-16w.yaml")  # node0000/bond1 at 1/3.6 of its capacity from step 45
    (fault,) = scenario.faults
    assert settings.policy is None  # the default policy
    topics = ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    pipeline = Pipeline(settings, tmp_path)
    control = Tail(consumer_config(settings, None), topics.control).open()
    try:
        pipeline.start("sink", 30)
        pipeline.start("processor", 45)
        live = run_live(
            FleetSimulator(scenario),
            Publisher(producer_config(settings)),
            control,
            topics,
            steps_per_s=10,
            max_steps=400,
        )
        assert live.triggers, f"no window in {live.steps} steps"
        (trig,) = live.triggers
        assert trig.kind == "slowdown" and trig.start_step > fault.start_step, (trig.kind, trig.reason)
        assert trig.start_step < fault.start_step + 100, (
            trig.reason
        )  # found within 100 steps of the onset (plus the margin)

        def stored() -> bool:
            return query(settings.db, "SELECT count(*) FROM windows WHERE window_id = ?", [trig.window])[1][0][0] == 1

        assert wait_for(stored, 60), "the window did not reach DuckDB"
    finally:
        control.close()
        pipeline.stop()
    with duckdb.connect(str(settings.db), read_only=True) as con:
        found = con.execute(
            "SELECT cause, devices, function FROM findings WHERE window_id = ?", [trig.window]
        ).fetchall()
    assert any(cause == "nic" and fault.nics[0] in devices for cause, devices, _ in found), found
