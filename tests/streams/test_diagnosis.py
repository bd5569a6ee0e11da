"""The diagnosis library on simulated steps: culprit, function, cause, and who is not blamed."""

import time

import numpy as np
import pytest

from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.model import IDX
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import ProfileTrigger, decode, encode
from lockstep.streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window, step_report, step_result
from lockstep.streams.policy import Policy

POLICY = Policy()


def run_window(scenario: Scenario, start=100, steps=8, drop_workers=()):
    sim = FleetSimulator(scenario)
    n = scenario.topology.workers
    trig = ProfileTrigger(job=scenario.job, window=f"w{start}", start_step=start, steps=steps, expected_workers=n)
    results = []
    for s in range(start, start + steps):
        batches = [b for b in sim.feature_batches(sim.step(s), trig) if b.worker.rank not in drop_workers]
        frame = StepFrame.from_tables(scenario.job, trig.window, s, [b.worker for b in batches], [b.step_time_us for b in batches],
                                      [ft.unpack(b.functions) for b in batches], POLICY.diagnosis.peer_group_keys, [b.hardware for b in batches])  # fmt: skip
        r = analyze_step(frame, POLICY.diagnosis)
        # through the wire format, as in the processor
        rep = decode(encode(step_report(r, window_start=start, window_steps=steps, expected_workers=n, bytes_in=0, policy="p", tenant="", closed="complete")))
        results.append(step_result(rep))
    return diagnose_window(WindowInfo(scenario.job, trig.window, start, steps, n), results, POLICY, now=time.time())


def scenario(fault=None, workers=64, **kw):
    return Scenario(job="j", topology=Topology(workers=workers), faults=(fault,) if fault else (), **kw)


@pytest.mark.parametrize(
    "fault,cause,kind",
    [
        ("gpu_throttle_thermal", "gpu_throttle_thermal", "compute"),
        ("gpu_throttle_power", "gpu_throttle_power", "compute"),
        ("gpu_slow", "gpu_slow", "compute"),
        ("pcie", "pcie", "memcpy"),
        ("dataloader", "dataloader", "dataloader"),
        ("input_imbalance", "input_imbalance", "compute"),
        ("rank_specific_code", "rank_specific_code", "python"),
    ],
)
def test_single_worker_fault_is_attributed(fault, cause, kind):
    d = run_window(scenario(Fault(type=fault, workers=(13,), severity=0.3)))
    assert len(d.findings) == 1, [f.summary for f in d.findings]
    f = d.findings[0]
    assert f.workers == [13] and f.scope == "worker"
    assert f.cause == cause
    assert f.function_kind == kind
    assert f.hosts == ["node0001"]
    assert len(f.steps) == 8 and f.window_steps == 8
    assert 0.5 < f.confidence <= 1.0
    assert d.report.actionable and d.report.reached_device


def test_throttled_gpu_names_the_device_and_the_evidence():
    f = run_window(scenario(Fault(type="gpu_throttle_thermal", workers=(13,), severity=0.3))).findings[0]
    assert f.devices == ["node0001/gpu5"]
    ev = {e.feature: e for e in f.evidence}
    assert ev["sm_clock_mhz"].value < 0.85 * ev["sm_clock_mhz"].peer_value
    assert ev["work_us"].deviation > POLICY.diagnosis.z_threshold
    # a 30% slower GPU on the critical path costs every worker its excess: about 0.3 x compute share
    assert 0.1 < f.impact.step_time_share < 0.3
    assert f.impact.gpu_hours_per_day == pytest.approx(f.impact.step_time_share * 64 * 24, rel=1e-3)


def test_victims_waiting_in_the_all_reduce_are_not_blamed():
    sc = scenario(Fault(type="gpu_slow", workers=(5,), severity=0.3))
    sim = FleetSimulator(sc)
    st = sim.step(100)
    ar = st.total_us[:, IDX["nccl:all_reduce[dp]"]]
    assert np.argmin(ar) == 5  # the culprit arrives last and waits least: naive "longest collective" blames the others
    d = run_window(sc)
    assert all(f.function_kind != "collective" for f in d.findings)
    assert [f.workers for f in d.findings] == [[5]]


def test_host_cpu_contention_is_reported_once_for_the_host():
    d = run_window(scenario(Fault(type="host_cpu_contention", hosts=(3,), severity=0.3)))
    assert len(d.findings) == 1
    f = d.findings[0]
    assert f.workers == list(range(24, 32)) and f.devices == ["node0003"]
    assert f.cause == "host_cpu_contention"


def test_healthy_job_has_no_findings():
    for seed in range(3):
        d = run_window(scenario(seed=seed))
        assert d.findings == [], [f.summary for f in d.findings]
        assert d.report.coverage == 1.0 and not d.report.actionable


def test_missing_worker_lowers_coverage_and_confidence():
    full = run_window(scenario(Fault(type="gpu_slow", workers=(13,), severity=0.3))).findings[0]
    part = run_window(scenario(Fault(type="gpu_slow", workers=(13,), severity=0.3)), drop_workers=(40, 41, 42, 43, 44, 45, 46, 47))
    assert part.report.coverage == pytest.approx(56 / 64)
    assert part.findings[0].workers == [13]
    assert part.findings[0].confidence < full.confidence


def test_a_fault_in_one_step_only_is_not_persistent():
    # the fault starts at the window's last step: one noisy step is not a finding
    d = run_window(scenario(Fault(type="gpu_slow", workers=(13,), severity=0.5, start_step=107)))
    assert d.findings == []


def test_finding_ids_are_stable_across_reruns():
    a = run_window(scenario(Fault(type="pcie", workers=(2,), severity=0.3)))
    b = run_window(scenario(Fault(type="pcie", workers=(2,), severity=0.3)))
    assert [f.id for f in a.findings] == [f.id for f in b.findings]
