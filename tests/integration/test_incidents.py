"""Incidents that end, through the real broker, processor and sink: a simulated job whose fault is diagnosed and that
then ends (every worker's final heartbeat) resolves its incident as ``job_ended``; a job whose fault is removed mid-run
resolves its incident as ``recovered`` once its step time is back; either way the GPU-hours lost stop growing."""

from __future__ import annotations

import dataclasses
import time

import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.live import run_live
from lockstep.producers.simulator.topology import Topology
from lockstep.sinks.http import query, wait_for
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

POLICY = """id: incidents-itest
detector: {recovery_steps: 30, control_latency_s: 0.2, hang_min_s: 3}
"""
STEPS_PER_S = 20


def scenario(job: str, fault: bool = True) -> Scenario:
    return Scenario(
        job=job,
        seed=7,
        topology=Topology(workers=16, gpus_per_host=8),
        faults=(Fault(type="gpu_throttle_thermal", workers=(5,), severity=0.3, start_step=40),) if fault else (),
    )


def incident(db, job: str) -> dict:
    cols, rows = query(
        db,
        "SELECT status, resolved_reason, resolved_step, first_window, onset_step, before_s, during_s, after_s, "
        "time_to_diagnose_s, time_to_recover_s, gpu_hours_per_day, gpu_hours_lost FROM incident_timeline WHERE job = ?",
        [job],
    )
    return dict(zip(cols, rows[0])) if rows else {}


def test_an_ended_job_and_a_removed_fault_resolve_their_incidents(settings, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    s = dataclasses.replace(settings, policy=policy)
    topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    pipeline = Pipeline(s, tmp_path)
    control = Tail(consumer_config(s, None), topics.control).open()
    publisher = Publisher(producer_config(s))
    try:
        pipeline.start("sink", 30)
        pipeline.start("processor", 45)

        # job A: the throttled GPU is diagnosed, then the job ends (3 steps after its window)
        ended = run_live(
            FleetSimulator(scenario("ends")), publisher, control, topics, steps_per_s=STEPS_PER_S, max_steps=400
        )
        (window,) = ended.windows_done

        def resolved(job: str) -> bool:
            return incident(s.db, job).get("status") == "resolved"

        assert wait_for(lambda: resolved("ends"), 60), incident(s.db, "ends")
        a = incident(s.db, "ends")
        assert (a["resolved_reason"], a["first_window"]) == ("job_ended", window)
        assert a["resolved_step"] == ended.steps  # its last step was steps - 1
        assert 35 <= a["onset_step"] <= 50 and a["during_s"] > a["before_s"] * 1.1  # the slowdown the window was for
        assert a["time_to_diagnose_s"] > 0 and a["time_to_recover_s"] is None  # it ended, never recovered
        lost = a["gpu_hours_lost"]
        assert lost > 0
        time.sleep(1.0)
        assert incident(s.db, "ends")["gpu_hours_lost"] == lost  # the clock stopped with the job

        # job B: the same fault, removed a few steps after its window: the same fleet without it from then on
        faulty = run_live(
            FleetSimulator(scenario("recovers")),
            publisher,
            control,
            topics,
            steps_per_s=STEPS_PER_S,
            max_steps=400,
            end_job=False,
        )
        assert faulty.windows_done
        healthy = run_live(
            FleetSimulator(scenario("recovers", fault=False)),
            publisher,
            control,
            topics,
            steps_per_s=STEPS_PER_S,
            start_step=faulty.steps,
            max_steps=80,
            stop_after_windows=10,
            end_job=False,  # still running: only the recovery can resolve it
        )
        assert healthy.steps == 80
        assert wait_for(lambda: resolved("recovers"), 60), incident(s.db, "recovers")
        b = incident(s.db, "recovers")
        assert b["resolved_reason"] == "recovered"
        assert faulty.steps < b["resolved_step"] <= faulty.steps + 80
        assert b["after_s"] < b["during_s"] and b["after_s"] == pytest.approx(b["before_s"], rel=0.02)
        assert b["time_to_recover_s"] > b["time_to_diagnose_s"] > 0
        lost = b["gpu_hours_lost"]
        time.sleep(1.0)
        assert incident(s.db, "recovers")["gpu_hours_lost"] == lost

        # nothing is being lost now; the recovered rate is counted as recovered, the ended one is not
        _, rows = query(
            s.db,
            "SELECT resolution, incidents, gpu_hours_per_day_recovered FROM incident_outcomes ORDER BY resolution",
        )
        assert [r[:2] for r in rows] == [["job_ended", 1], ["recovered", 1]]
        assert rows[0][2] == 0 and rows[1][2] == b["gpu_hours_per_day"] > 0
        _, rows = query(s.db, "SELECT coalesce(sum(gpu_hours_per_day), 0) FROM gpu_hours_lost_by_cause")
        assert rows == [[0]]
        # the detector said so, and never took the ended job's silence (job B's run, beyond hang_min_s) for a hang
        kinds = query(s.db, "SELECT job, change FROM job_changes ORDER BY job, changed_at")[1]
        assert ["ends", "ended"] in kinds and ["recovers", "recovered"] in kinds
        assert not any(r[0] == "ends" and r[1] == "hang" for r in query(s.db, "SELECT job, kind FROM triggers")[1])
    finally:
        control.close()
        pipeline.stop()
