"""The evaluation: rendering a simulated step, judging a finding against the truth, a regression against the
scenario's earlier window, and the whole standard suite (every finding's evidence supports its cause)."""

from dataclasses import replace

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from lockstep.app.evaluate import STANDARD_SUITE, _Renderer, judge, load_suite, run_scenario, summarise
from lockstep.producers.simulator.faults import Fault, Truth
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import Evidence, Finding, Impact, StepSlice, decode
from lockstep.streams.diagnosis import StepFrame, analyze_step
from lockstep.streams.diagnosis.causes import CPU_BOUND_MIN
from lockstep.streams.policy import Policy
from lockstep.streams.stages.shard import step_slices
from lockstep.streams.stages.step import read_slice, step_frame
from lockstep.streams.windows import Handle, ShardAssembler, StepAssembler


def _processor_frame(fleet, st, keys, trigger, kind):
    """The step stage's frame of a simulated step, from feature batches or from the shard stage's slices."""
    steps: StepAssembler = StepAssembler(60.0)
    closed = []
    if kind == "batches":
        for i, b in enumerate(fleet.feature_batches(st, trigger)):
            closed.append(steps.add(b, ft.read(b.functions), 0, Handle(0, i, None), 0.0)[0])
    else:
        shards: ShardAssembler = ShardAssembler(60.0)
        full = [
            shards.add(w, ft.read_compact(w.functions), 0, Handle(0, i, None), 0.0)[0]
            for i, w in enumerate(fleet.window_features([st], trigger))
        ]
        for shard in [c for c in full if c is not None] + shards.expire(
            1e9
        ):  # the missing worker's shard: closed by its timeout
            for i, (_, value) in enumerate(step_slices(shard.pending, keys)[0]):
                sl = decode(value, StepSlice)
                closed.append(steps.add_slice(sl, *read_slice(sl), Handle(1, i, None), 0.0)[0])
    (done,) = [c for c in closed + steps.expire(1e9) if c is not None and c.pending.step == st.step]
    return step_frame(done.pending, keys)[0]


@pytest.mark.parametrize("workers, pp", [(64, 2), (32, 4)])  # big peer groups; groups of up to 8 (ordered)
def test_one_table_per_step_gives_the_processors_step_analysis(workers, pp):
    """evaluate renders all workers as one Arrow table; the processor concatenates one table per worker (agents'
    FeatureBatches), or a few shards' slices of many workers (their WindowFeatures): the same analysis."""
    fleet = FleetSimulator(
        Scenario(
            job="j",
            topology=Topology(workers=workers, pp=pp, tp=2),
            faults=(
                Fault(type="missing_worker", workers=(7,)),
                Fault(type="gpu_slow", workers=(workers - 24,), severity=0.3),
            ),
        )
    )
    policy = Policy()
    keys = policy.diagnosis.peer_group_keys
    st = fleet.step(61)
    trigger = msgspec.structs.replace(fleet.trigger(), shard_workers=24)
    batches = fleet.feature_batches(st, trigger)
    one_by_one = StepFrame.from_tables(
        "j",
        "w60",
        61,
        [b.worker for b in batches],
        [b.step_time_us for b in batches],
        [ft.unpack(b.functions) for b in batches],
        keys,
        [b.hardware for b in batches],
    )
    fast = _Renderer(fleet, keys).frame(st, "w60")
    b = analyze_step(fast, policy.diagnosis)
    ordered = 0
    for frame in (
        one_by_one,
        _processor_frame(fleet, st, keys, trigger, "batches"),
        _processor_frame(fleet, st, keys, trigger, "slices"),
    ):
        a = analyze_step(frame, policy.diagnosis)
        assert a.outliers.num_rows > 0 and a.workers_seen == b.workers_seen == workers - 1
        for x, y in ((a.outliers, b.outliers), (a.groups, b.groups)):
            assert x.schema == y.schema and x.num_rows == y.num_rows
            for name in x.column_names:
                if pa.types.is_list(x.schema.field(name).type):  # the order of a small group's workers
                    assert x.column(name).to_pylist() == y.column(name).to_pylist(), name
                    ordered += sum(len(o) > 0 for o in x.column(name).to_pylist())
                    continue
                np.testing.assert_array_equal(
                    x.column(name).to_numpy(zero_copy_only=False),
                    y.column(name).to_numpy(zero_copy_only=False),
                    err_msg=name,
                )
    assert (ordered > 0) == (workers // pp // 2 <= policy.diagnosis.split_peers_max)


def _finding(workers, function, cause, devices=(), hosts=(), scope="worker", group=None):
    return Finding(
        id="x",
        job="j",
        window="w",
        steps=[1],
        scope=scope,
        workers=list(workers),
        hosts=list(hosts),
        devices=list(devices),
        group=group,
        function=function,
        function_kind="compute",
        cause=cause,
        confidence=0.9,
        evidence=[Evidence(feature="work_us", value=1.0, peer_value=1.0, deviation=0.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=1.0),
        policy="p",
        created_at=0.0,
    )


def test_judging_a_finding_against_the_truth():
    topo = Topology(workers=64)
    thermal = Fault(type="gpu_throttle_thermal", workers=(13,)).truth(topo)
    o = judge(thermal, _finding([13], "bwd.gemm", "gpu_throttle_thermal", ["node0001/gpu5"], ["node0001"]))
    assert o.correct and o.worker and o.host and o.device
    assert not judge(thermal, _finding([13], "bwd.gemm", "gpu_slow", ["node0001/gpu5"])).correct
    assert not judge(thermal, _finding([12, 13], "bwd.gemm", "gpu_throttle_thermal", ["node0001/gpu5"])).localised
    assert not judge(thermal, _finding([13], "nccl:all_reduce[dp]", "gpu_throttle_thermal")).correct
    # a link fault is localised by naming the device, even with more workers listed
    nvlink = Fault(type="nvlink", workers=(13,)).truth(Topology(workers=64, tp=8))
    o = judge(nvlink, _finding(range(8, 16), "nccl:all_reduce[tp]", "nvlink", ["node0001/gpu5/nvlink"]))
    assert o.correct and not o.worker and o.device
    nic = Fault(type="nic", nics=("node0003/bond1",)).truth(topo)
    assert nic.workers == [28, 29, 30, 31] and nic.devices == ["node0003/bond1"]
    assert judge(nic, _finding([28, 29, 30, 31], "nccl:all_reduce[dp]", "nic", ["node0003/bond1"])).correct
    # group and job scopes
    pipe = Fault(type="pipeline_imbalance", stage=2).truth(Topology(workers=256, pp=4))
    o = judge(
        pipe, _finding([], "bwd.gemm", "pipeline_imbalance", scope="group", group={"pp": "2", "role": "transformer"})
    )
    assert o.correct and o.worker and o.host  # the group's labels stand for its workers and hosts
    assert not judge(pipe, _finding([], "bwd.gemm", "pipeline_imbalance", scope="group", group={"pp": "1"})).localised
    # without the samples that decide, a perfect diagnosis names worker, function and device, and no cause
    blind = Fault(type="gpu_throttle_thermal", workers=(13,)).truth(topo, hardware="host")
    assert blind.cause == "undetermined" and blind.devices == ["node0001/gpu5"]
    assert judge(blind, _finding([13], "bwd.gemm", "undetermined", ["node0001/gpu5"], ["node0001"])).correct
    assert not judge(blind, _finding([13], "bwd.gemm", "gpu_throttle_thermal", ["node0001/gpu5"], ["node0001"])).correct
    assert Fault(type="host_cpu_contention", hosts=(1,)).truth(topo, hardware="host").cause == "host_cpu_contention"
    assert (
        Fault(type="input_imbalance", workers=(3,)).truth(topo, hardware="none").cause == "input_imbalance"
    )  # bytes: the trace's
    regr = Fault(type="regression", function="fwd.attention").truth(topo)
    assert judge(regr, _finding([], "fwd.attention", "regression", scope="job")).correct
    assert not judge(regr, _finding([], "bwd.gemm", "regression", scope="job")).correct
    assert isinstance(regr, Truth) and regr.functions == ["fwd.attention"]


def test_a_regression_is_found_against_the_scenarios_earlier_healthy_window():
    # the baseline window is diagnosed first and folded into the job's history, as the processor does
    sc = load_suite(STANDARD_SUITE / "regression-00-16w.yaml")[0]
    (o,) = run_scenario(sc, Policy()).faults
    assert o.correct and o.finding.scope == "job"
    ev = {e.feature: e for e in o.finding.evidence}
    assert ev["healthy_windows"].value == 1
    # without an earlier window nothing tells a job-wide regression
    assert run_scenario(replace(sc, baseline=None), Policy()).findings == []


# --------------------------------------------------------------------------- causes follow the evidence


def _unsupported(f: Finding, dp) -> str:
    """Why the finding's evidence does not support its cause ('' if it does): the table in METHOD.md, step 5."""
    ev = {e.feature: e for e in f.evidence}

    def rel(name):
        e = ev.get(name)
        return None if e is None or e.value is None or not e.peer_value else e.value / e.peer_value - 1.0

    def measured(name):
        return rel(name) is not None

    def saturated(
        metric,
    ):  # the link steady (its sd/mean well below its ring-mates') while they burst (spread or peaks)
        if not all(measured(m) for m in (metric, f"{metric}_sd")):
            return False
        cv, peer_cv = ev[f"{metric}_sd"].value / ev[metric].value, ev[f"{metric}_sd"].peer_value / ev[metric].peer_value
        bursting = peer_cv >= dp.link_burst_cv or (
            measured(f"{metric}_p95") and rel(f"{metric}_p95") < -dp.throughput_drop
        )
        return bursting and cv < dp.link_steady_ratio * peer_cv

    bits = int(ev["clock_events"].deviation) if "clock_events" in ev and ev["clock_events"].deviation is not None else 0
    clock_down = measured("sm_clock_mhz") and rel("sm_clock_mhz") < -dp.clock_drop
    host_normal = measured("cpu_other") and ev["cpu_other"].value - ev["cpu_other"].peer_value <= dp.cpu_other_rise
    more_input = any(measured(c) and rel(c) > dp.input_rise for c in ("calls", "bytes", "input_bytes"))
    over = lambda name: name in ev and ev[name].value > ev[name].peer_value  # noqa: E731
    ok = {
        "gpu_throttle_thermal": clock_down and bits & 0x60,
        "gpu_throttle_power": clock_down and bits & 0x84,
        "gpu_throttle": clock_down,
        "gpu_slow": measured("sm_clock_mhz") and not clock_down,
        "pcie": measured("pcie_gbps") and rel("pcie_gbps") < -dp.throughput_drop,
        "nvlink": saturated("nvlink_gbps"),
        "nic": saturated("nic_gbps"),
        "switch": saturated("nic_gbps") and len(f.devices) == 1,
        # others take more of the host; or the worker got far less of a core than its peers, others as busy
        "host_cpu_contention": (measured("cpu_other") and not host_normal)
        or (
            measured("cpu_self")
            and rel("cpu_self") < -dp.cpu_self_drop
            and ev["cpu_self"].peer_value >= CPU_BOUND_MIN  # CPU work on the peers
            and ev["cpu_other"].value >= ev["cpu_other"].peer_value
        ),
        "host_memory": measured("mem_used_frac") and ev["mem_used_frac"].value > dp.mem_high,
        "storage": measured("disk_read_mbps")
        and rel("disk_read_mbps") < -dp.throughput_drop
        and ev["disk_read_mbps"].peer_value >= dp.disk_read_min_mbps,
        "dataloader": host_normal and measured("disk_read_mbps") and rel("disk_read_mbps") >= -dp.throughput_drop,
        "input_imbalance": more_input,
        # a function the peers do not run, or several times their time with the host's CPU normal
        "rank_specific_code": (
            "workers_running_it" in ev and ev["workers_running_it"].value < ev["workers_running_it"].peer_value
        )
        or (host_normal and rel("work_us") is not None and rel("work_us") >= dp.rank_specific_ratio - 1),
        "python_overhead": over("share") if f.scope == "job" else host_normal,
        "undetermined": any(e.value is None for e in f.evidence) and "samples, which would tell" in f.summary,
        "unknown": True,
        "pipeline_imbalance": over("group_work_us"),
        "regression": over("work_us"),
        "framework_config": over("share"),
    }
    return (
        ""
        if ok.get(f.cause, False)
        else f"{f.cause}: {f.summary} | " + ", ".join(f"{e.feature} {e.value} vs {e.peer_value}" for e in f.evidence)
    )


def test_the_checker_catches_causes_the_evidence_contradicts():
    dp = Policy().diagnosis
    everyone = _finding([3], "python.log_metrics", "rank_specific_code")
    everyone.evidence.append(Evidence(feature="workers_running_it", value=5.0, peer_value=5.0, deviation=1.0))
    assert _unsupported(everyone, dp)
    alone = _finding([3], "python.log_metrics", "rank_specific_code")
    alone.evidence.append(Evidence(feature="workers_running_it", value=1.0, peer_value=5.0, deviation=0.2))
    assert not _unsupported(alone, dp)
    throttled = _finding([3], "bwd.gemm", "gpu_throttle_thermal")
    throttled.evidence += [
        Evidence(feature="sm_clock_mhz", value=1980.0, peer_value=1981.0, deviation=0.0),
        Evidence(feature="clock_events", value=0x40, peer_value=0, deviation=0x40),
    ]
    assert _unsupported(throttled, dp)  # the clock did not drop


def _evaluate_on_two_cores(scenarios: list[Scenario], policy: Policy):
    """``evaluate(scenarios, policy)``, its scenarios shared by two fresh processes: each scenario's run is independent
    of the others (its own simulator), ``summarise`` gets the same results in the same order, and pytest runs one test
    at a time, so the build machine's second core is otherwise idle during this one (~100 s of CPU).  The README table
    check below compares the figures with what ``lockstep evaluate`` (one process) printed."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    cores = min(2, len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(partial(run_scenario, policy=policy), scenarios, chunksize=4))
    return summarise(results), results


@pytest.mark.slow  # the whole standard suite
@pytest.mark.timeout(1200)  # the whole suite: about 90 s of CPU, minutes on a shared machine
def test_every_finding_of_the_standard_suite_shows_evidence_for_its_cause():
    """The whole standard suite: no finding's evidence contradicts its cause; and the figures the README reports."""
    policy = Policy()
    figures, results = _evaluate_on_two_cores(load_suite(STANDARD_SUITE), policy)
    findings = [f for r in results for f in r.findings]
    assert len(findings) >= 200
    bad = [why for f in findings if (why := _unsupported(f, policy.diagnosis))]
    assert not bad, bad[:5]
    assert figures["overall"]["accuracy"] >= 0.99 and figures["overall"]["healthy_false_findings"] == 0
    assert {f.cause for f in findings} >= {"undetermined", "nic", "switch", "nvlink", "rank_specific_code"}
    # the table README.md shows under <!-- evaluate-table --> is what `lockstep evaluate` prints today
    from lockstep.commands.evaluate import report
    from tests.paths import ROOT

    printed = [line.rstrip() for line in report(figures, policy.ref, "standard suite").split("\n")]
    start = next(i for i, line in enumerate(printed) if line.startswith("fault "))
    end = next(i for i, line in enumerate(printed) if line.startswith("Calibration"))
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- evaluate-table -->") :].split("```")[1].strip("\n")
    assert block == "\n".join(printed[start : end + 1]), (
        "README.md's evaluate table is not what `lockstep evaluate` prints now; paste its table in:\n"
        + "\n".join(printed[start : end + 1])
    )
