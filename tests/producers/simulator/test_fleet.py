"""The simulator's invariants: synchronous semantics emerge, links bound rings, records reproduce."""

import numpy as np
import pytest

from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.files import write_records
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, ScenarioError, Window
from lockstep.producers.simulator.model import COMM, IDX, Workload
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import ProfileTrigger, decode, encode

AR = IDX["nccl:all_reduce[dp]"]


def sim(topology=None, *faults, step=62, workload=None, seed=7):
    sc = Scenario(
        job="j", seed=seed, topology=topology or Topology(workers=64), workload=workload or Workload(), faults=faults
    )
    return FleetSimulator(sc).step(step)


def test_the_culprit_arrives_last_and_waits_least():
    st = sim(Topology(workers=64), Fault(type="gpu_slow", workers=(5,), severity=0.3))
    ar = st.total_us[:, AR]
    assert np.argmin(ar) == 5 and st.true_wait_us[5, AR] == 0.0
    # everyone else waits for it: their wait is the culprit's extra compute, not their own
    others = np.delete(np.arange(64), 5)
    assert np.all(st.true_wait_us[others, AR] > 0.2 * st.total_us[5, IDX["bwd.gemm"]] * 0.3 / 1.3)
    # so the step ends at about the same time for everyone, up to their own work after the all-reduce
    assert np.ptp(st.step_time_us[others]) < 0.01 * st.step_time_us.max()


def test_waits_emerge_at_tensor_parallel_and_pipeline_collectives():
    # tensor parallel: the throttled GPU's 7 host-mates wait for it in every tp all-reduce
    st = sim(Topology(workers=64, tp=8), Fault(type="gpu_throttle_thermal", workers=(13,), severity=0.3))
    tp = IDX["nccl:all_reduce[tp]"]
    mates = [w for w in range(8, 16) if w != 13]
    assert st.true_wait_us[13, tp] < 0.1 * st.true_wait_us[mates, tp].min()
    assert st.total_us[mates, tp].min() > 1.5 * np.median(st.total_us[16:, tp])
    # pipeline: a stage with more layers makes the others wait at send/recv; it waits least
    st = sim(Topology(workers=256, pp=4), Fault(type="pipeline_imbalance", stage=2, severity=0.3))
    p2p = IDX["nccl:send_recv[pp]"]
    stage = np.repeat(np.arange(4), 64)
    wait = [np.median(st.true_wait_us[stage == s, p2p]) for s in range(4)]
    assert np.argmin(wait) == 2 and min(wait[s] for s in (0, 1, 3)) > 3 * wait[2]
    calls = [np.median(st.calls[stage == s, IDX["bwd.gemm"]]) for s in range(4)]
    assert calls[2] == pytest.approx(calls[0] * (16 + 5) / 16)


def sim_hz(topology, *faults, hz, step=62, hardware="nvml"):
    sc = Scenario(job="j", seed=7, topology=topology, faults=faults, hardware_hz=hz, hardware=hardware)
    return FleetSimulator(sc).step(step)


def test_the_slowest_link_bounds_the_ring():
    healthy = sim(Topology(workers=64))
    slow = sim_hz(Topology(workers=64), Fault(type="nic", nics=("node0003/bond1",), severity=1.0), hz=10_000)
    transfer = lambda s: s.total_us[:, AR] - s.true_wait_us[:, AR]  # noqa: E731
    # every member of the ring moves its bytes at the degraded bond's speed ...
    assert np.ptp(transfer(slow)) < 1e-6 * transfer(slow).max()
    assert transfer(slow).min() > 1.3 * transfer(healthy).max()
    # ... so every member's mean throughput is the slow bond's (as real counters show) ...
    behind = np.arange(28, 32)
    nic, sd, peak = (slow.hw[m][:, AR] for m in ("nic_gbps", "nic_gbps_sd", "nic_gbps_p95"))
    assert np.median(nic[behind]) == pytest.approx(np.median(np.delete(nic, behind)), rel=0.05)
    # ... and only the shape differs: the slow bond is busy all the time, the others burst and idle
    cv = sd / nic
    assert cv[behind].max() < 0.2 and np.median(np.delete(cv, behind)) > 0.8
    assert peak[behind].max() < 0.6 * np.median(np.delete(peak, behind))
    assert np.all(np.isnan(slow.hw["nic_gbps"][:, IDX["bwd.gemm"]]))


def test_bursts_shorter_than_a_sample_are_averaged_out():
    topo, fault = Topology(workers=64), Fault(type="nic", nics=("node0003/bond1",), severity=1.0)
    cv = lambda s: np.median(s.hw["nic_gbps_sd"][:32, AR] / s.hw["nic_gbps"][:32, AR])  # noqa: E731  (healthy bonds)
    fast, slow = sim_hz(topo, fault, hz=10_000), sim_hz(topo, fault, hz=500)
    assert np.median(slow.samples[:, AR]) >= 5 and cv(slow) < 0.7 * cv(fast)
    # with fewer than two samples of a function there is no spread at all, only a level
    coarse = sim_hz(topo, fault, hz=100)
    one = coarse.samples[:, AR] < 2
    assert one.any() and np.all(np.isnan(coarse.hw["nic_gbps_sd"][one, AR]))
    assert np.allclose(coarse.hw["nic_gbps_p95"][one, AR], coarse.hw["nic_gbps"][one, AR])


def test_what_the_samplers_see():
    topo, fault = Topology(workers=16), Fault(type="gpu_throttle_thermal", workers=(3,), severity=0.3)
    host = sim_hz(topo, fault, hz=1000, hardware="host")
    assert set(host.hw) == {
        f"{m}{x}"
        for m in ("nic_gbps", "cpu_self", "cpu_other", "mem_used_frac", "disk_read_mbps")
        for x in ("", "_sd", "_p95")
    }
    assert not host.clock_events.any()  # no NVML: no clock-event reasons either
    none = sim_hz(topo, fault, hz=1000, hardware="none")
    assert none.hw == {} and not none.samples.any()
    table, _ = FleetSimulator(Scenario(job="j", topology=topo, hardware="none")).table(none)
    assert all(np.isnan(table.column(m).to_numpy()).all() for m in ft.HARDWARE)
    # the same job's times do not depend on what was sampled
    np.testing.assert_array_equal(none.step_time_us, sim_hz(topo, fault, hz=1000).step_time_us)


def test_a_degraded_nvlink_slows_its_tensor_parallel_group_only():
    st = sim_hz(Topology(workers=64, tp=8), Fault(type="nvlink", workers=(13,), severity=2.0), hz=10_000)
    tp = IDX["nccl:all_reduce[tp]"]
    xfer = st.total_us[:, tp] - st.true_wait_us[:, tp]
    assert np.ptp(xfer[8:16]) < 1e-6 * xfer.max() and xfer[8] > 2.5 * np.median(xfer[16:])
    link, peak = st.hw["nvlink_gbps"][:, tp], st.hw["nvlink_gbps_p95"][:, tp]
    mates = [w for w in range(8, 16) if w != 13]
    # the group's links carry its bytes at the slow link's rate; only the slow one never bursts above it
    assert link[mates] == pytest.approx(np.full(7, link[13]), rel=0.05) and np.median(link[16:]) > 2.5 * link[13]
    assert peak[13] < 0.4 * np.median(peak[mates])


def test_the_critical_path_covers_the_step():
    for topo, wl in [
        (Topology(workers=64), Workload()),
        (Topology(workers=256, pp=4, tp=2), Workload()),
        (Topology(workers=128, tp=2), Workload(moe=True)),
    ]:
        st = sim(topo, Fault(type="gpu_slow", workers=(9,), severity=0.3), workload=wl)
        np.testing.assert_allclose(st.critical_us.sum(axis=1), st.step_time_us, rtol=1e-9)
        assert np.all(st.true_wait_us[:, ~COMM] == 0) and np.all(st.true_wait_us >= 0)


def test_faults_show_on_the_hardware_their_functions_depend_on():
    st = sim(Topology(workers=64), Fault(type="gpu_throttle_power", workers=(3,), severity=0.3))
    g = IDX["bwd.gemm"]
    assert st.hw["sm_clock_mhz"][3, g] < 0.8 * np.median(st.hw["sm_clock_mhz"][:, g])
    assert st.clock_events[3, g] == 0x04 and st.clock_events[3, IDX["memcpy.h2d"]] == 0 and st.clock_events[4, g] == 0
    st = sim(Topology(workers=64), Fault(type="host_cpu_contention", hosts=(2,), severity=0.3))
    d = IDX["dataloader.next"]
    host2 = np.arange(16, 24)
    assert st.hw["cpu_other"][host2, d].min() > np.median(st.hw["cpu_other"][:, d]) + 0.2
    assert st.total_us[host2, d].min() > 10 * np.median(st.total_us[:, d])
    st = sim(Topology(workers=64), Fault(type="input_imbalance", workers=(3,), severity=0.3))
    h2d = IDX["memcpy.h2d"]
    assert st.bytes[3, h2d] > 1.2 * np.median(st.bytes[:, h2d])
    assert st.hw["pcie_gbps"][3, h2d] == pytest.approx(np.median(st.hw["pcie_gbps"][:, h2d]), rel=0.1)


def test_clock_skew_leaves_summaries_unchanged():
    base = Scenario(job="j", topology=Topology(workers=32))
    skewed = Scenario(
        job="j", topology=Topology(workers=32), faults=(Fault(type="clock_skew", hosts=(1,), severity=3.0),)
    )
    a, b = FleetSimulator(base), FleetSimulator(skewed)
    sa, sb = a.step(62), b.step(62)
    assert ft.pack(a.table(sa)[0]) == ft.pack(b.table(sb)[0])
    trig = a.trigger()
    fa, fb = a.feature_batches(sa, trig, sent_at=100.0), b.feature_batches(sb, trig, sent_at=100.0)
    assert [x.functions for x in fa] == [x.functions for x in fb]
    shift = [y.sent_at - x.sent_at for x, y in zip(fa, fb)]
    assert shift == [3.0 if 8 <= i < 16 else 0.0 for i in range(32)]


def test_a_missing_worker_sends_nothing():
    fleet = FleetSimulator(
        Scenario(
            job="j", topology=Topology(workers=16), faults=(Fault(type="missing_worker", workers=(4,), start_step=61),)
        )
    )
    assert len(fleet.heartbeats(fleet.step(60))) == 16
    st = fleet.step(61)
    assert [h.worker for h in fleet.heartbeats(st)] == [w for w in range(16) if w != 4]
    assert 4 not in {b.worker.rank for b in fleet.feature_batches(st, fleet.trigger())}


def test_feature_batches_are_valid_records():
    fleet = FleetSimulator(Scenario(job="j", topology=Topology(workers=64, pp=2, tp=4), workload=Workload(moe=True)))
    trig = fleet.trigger(Window(start_step=10, steps=4))
    batches = fleet.feature_batches(fleet.step(11), trig, sent_at=5.0)
    assert len(batches) == 64
    for b in (batches[0], batches[-1]):
        back = decode(encode(b))
        t = ft.unpack(back.functions)  # the processor's validation
        assert back.worker.labels["role"] == ("embedding" if b.worker.rank < 32 else "loss")
        assert set(t.column("function").to_pylist()) >= {
            "fwd.gemm",
            "nccl:all_reduce[tp]",
            "nccl:send_recv[pp]",
            "moe.expert_gemm",
        }
    assert isinstance(trig, ProfileTrigger) and trig.sampling.hardware_hz == 100.0


def test_a_seed_reproduces_its_records_byte_for_byte(tmp_path):
    sc = Scenario(
        job="j",
        seed=11,
        topology=Topology(workers=32, tp=2),
        window=Window(start_step=12, steps=4),
        baseline=Window(start_step=4, steps=2),
        faults=(Fault(type="nic", nics=("node0001/bond0",), severity=2.0, start_step=8),),
    )
    a, _ = write_records(sc, tmp_path / "a"), write_records(sc, tmp_path / "b")
    assert a.heartbeats == 32 * 18 and a.feature_batches == 32 * 6
    for name in ("heartbeats.parquet", "features.parquet", "triggers.parquet", "truth.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other = write_records(Scenario(**{**sc.__dict__, "seed": 12}), tmp_path / "c")
    assert other.heartbeats == a.heartbeats
    assert (tmp_path / "c" / "features.parquet").read_bytes() != (tmp_path / "a" / "features.parquet").read_bytes()


def test_bad_scenarios_say_what_is_wrong():
    with pytest.raises(ScenarioError, match="say which hosts"):
        Scenario.from_dict({"faults": [{"type": "storage", "workers": [1]}]})
    with pytest.raises(ScenarioError, match="no NIC named"):
        Scenario.from_dict({"faults": [{"type": "nic", "nics": ["node9999/bond0"]}]})
    with pytest.raises(ScenarioError, match="unknown key"):
        Scenario.from_dict({"toplogy": {}})
    with pytest.raises(ScenarioError, match="tensor parallelism stays inside a host"):
        Scenario.from_dict({"topology": {"workers": 48, "tp": 3}})
