"""StepResult <-> StepReport: what the step stage sends, the window stage reads, also from the previous release."""

from dataclasses import replace

import numpy as np

from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import ProfileTrigger, decode, encode
from lockstep.streams.diagnosis import StepFrame, analyze_step, step_report, step_result
from lockstep.streams.policy import Policy

POLICY = Policy()


def scenario(fault=None, workers=64, **kw):
    return Scenario(job="j", topology=Topology(workers=workers), faults=(fault,) if fault else (), **kw)


def test_a_step_report_of_the_previous_release_is_read():
    # mid-upgrade, a step stage of the previous release sends outliers without the links' spread and peak
    sim = FleetSimulator(scenario(Fault(type="gpu_slow", workers=(13,), severity=0.3)))
    frame = StepFrame.from_tables("j", "w100", 100, *_frame_parts(sim, 100))
    r = analyze_step(frame, POLICY.diagnosis)
    old = r.outliers.drop_columns([c for c in r.outliers.column_names if c.endswith(("gbps_sd", "gbps_p95"))])
    rep = step_report(
        replace(r, outliers=old),
        window_start=100,
        window_steps=8,
        expected_workers=64,
        bytes_in=0,
        policy="p",
        tenant="",
        closed="complete",
    )
    back = step_result(decode(encode(rep)))
    assert (
        back.outliers.num_rows == r.outliers.num_rows
        and np.isnan(back.outliers.column("nic_gbps_p95").to_numpy()).all()
    )


def _frame_parts(sim, step):
    trig = ProfileTrigger(job="j", window="w100", start_step=100, steps=8, expected_workers=sim.topology.workers)
    batches = sim.feature_batches(sim.step(step), trig)
    return (
        [b.worker for b in batches],
        [b.step_time_us for b in batches],
        [ft.unpack(b.functions) for b in batches],
        POLICY.diagnosis.peer_group_keys,
        [b.hardware for b in batches],
    )
