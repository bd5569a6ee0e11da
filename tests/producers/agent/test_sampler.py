"""The hardware sampler: counter parsing and rate conversion (pure), NVML absent, a real host run."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from lockstep.producers.agent import nvml
from lockstep.producers.agent.sampler import (
    HardwareSampler,
    fast_host_metrics,
    host_metrics,
    parse_cpu_jiffies,
    parse_disk_read_bytes,
    parse_meminfo,
    parse_net_bytes,
    to_table,
)
from lockstep.producers.agent.sampler import (
    metrics as sampler_metrics,
)
from lockstep.schemas.events import SAMPLE_SCHEMA
from lockstep.schemas.functions import HARDWARE

STAT = b"""cpu  300 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 20 0 0 0 0 0
cpu1 200 0 50 500 30 0 0 0 0 0
intr 12345
"""
MEMINFO = b"MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"
DISKSTATS = b"   8       0 sda 100 0 2048 0 0 0 0 0 0 0 0\n   8       1 sda1 100 0 2048 0 0 0 0 0 0 0 0\n"
NETDEV = b"""Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 999 1 0 0 0 0 0 0 999 1 0 0 0 0 0 0
  eth0: 1000 1 0 0 0 0 0 0 500 1 0 0 0 0 0 0
  eth1: 7 1 0 0 0 0 0 0 3 1 0 0 0 0 0 0
"""


def test_proc_parsers():
    assert parse_cpu_jiffies(STAT, None) == (150 + 250, 670 + 780)  # per core: busy = all - idle - iowait
    assert parse_cpu_jiffies(STAT, frozenset({1})) == (250, 780)
    assert parse_meminfo(MEMINFO) == pytest.approx(0.75)
    assert parse_disk_read_bytes(DISKSTATS, frozenset({"sda"})) == 2048 * 512  # partitions are not counted twice
    assert parse_net_bytes(NETDEV, None) == 1510  # all but loopback
    assert parse_net_bytes(NETDEV, frozenset({"eth0"})) == 1500


def test_host_counters_become_rates_per_interval():
    t = np.array([0.0, 0.1, 0.2])
    #                 busy s, total s, mem, disk bytes, nic bytes, process cpu s
    raw = np.array(
        [[10.0, 20.0, 0.5, 0.0, 0.0, 1.00], [10.2, 20.4, 0.5, 1e6, 1e9, 1.10], [10.4, 20.8, 0.6, 3e6, 1e9, 1.15]]
    )
    sampler_cpu = np.array([0.0, 0.0, 0.01])
    m = host_metrics(t, raw, sampler_cpu, n_cores=4)
    np.testing.assert_allclose(m["cpu_self"][1], [1.0, 0.4])  # cores, minus the sampler's own CPU
    np.testing.assert_allclose(m["cpu_other"][1], [(0.2 - 0.1) / 0.4, (0.2 - 0.05) / 0.4])
    np.testing.assert_allclose(m["disk_read_mbps"][1], [10.0, 20.0])
    np.testing.assert_allclose(m["nic_gbps"][1], [10.0, 0.0])
    np.testing.assert_allclose(m["cpu_self"][0], [0.1, 0.2])  # a rate is stamped at the end of its interval
    np.testing.assert_allclose(m["mem_used_frac"][1], [0.5, 0.5, 0.6])


def test_nvml_readings_convert_to_table_units():
    t = np.array([0.0, 0.5, 1.0])
    r = {
        "sm_clock_mhz": np.array([1980.0, 1500.0, 1500.0]),
        "utilisation_pct": np.array([100.0, 50.0, np.nan]),
        "power_mw": np.array([700_000.0, 350_000.0, 350_000.0]),
        "temp_c": np.array([60.0, 88.0, 89.0]),
        "clock_events": np.array([0.0, 0x40, 0x40 | 0x20]),
        "nvlink_tx_kib": np.array([0.0, 1e6, 2e6]),
        "nvlink_rx_kib": np.array([0.0, 1e6, 1e6]),
    }
    m = nvml.fast_metrics(t, r)
    np.testing.assert_allclose(m["sm_active"][1], [1.0, 0.5, np.nan])
    np.testing.assert_allclose(m["gpu_power_w"][1], [700.0, 350.0, 350.0])
    np.testing.assert_allclose(m["nvlink_gbps"][1], [2e6 * 1024 / 0.5 / 1e9, 1e6 * 1024 / 0.5 / 1e9])
    assert m["clock_events"][1][2] == 0x60
    no_nvlink = nvml.fast_metrics(t, {**r, "nvlink_tx_kib": np.full(3, np.nan), "nvlink_rx_kib": np.full(3, np.nan)})
    assert "nvlink_gbps" not in no_nvlink
    p = nvml.pcie_metrics(np.array([1.0]), np.array([2e6]), np.array([1e6]))
    assert p["pcie_gbps"][1][0] == pytest.approx(3.0) and p["pcie_gbps"][0][0] == 1.0


def test_a_counter_that_goes_backwards_gives_no_rate():
    _, r = nvml.rate(np.array([0.0, 1.0, 2.0]), np.array([5.0, 2.0, 4.0]))
    assert np.isnan(r[0]) and r[1] == 2.0


def test_samples_table_uses_the_shared_schema_and_drops_unmeasured_values():
    t = to_table(
        3,
        {
            "cpu_self": (np.array([1.0, 2.0]), np.array([0.5, np.nan])),
            "gpu_temp_c": (np.array([1.5]), np.array([70.0])),
        },
    )
    assert t.schema == SAMPLE_SCHEMA
    rows = sorted(t.to_pylist(), key=lambda r: r["metric"])
    assert rows == [
        {"worker": 3, "t_us": 1e6, "metric": "cpu_self", "value": 0.5},
        {"worker": 3, "t_us": 1.5e6, "metric": "gpu_temp_c", "value": 70.0},
    ]


def test_without_nvml_the_sampler_samples_the_host_and_says_so(monkeypatch, caplog):
    """(At DEBUG: by default the agent says only what it does with windows and records.)"""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as on a host without nvidia-ml-py
    monkeypatch.setattr(nvml, "_state", {})
    monkeypatch.setattr("lockstep.producers.agent.sampler._said_host_only", False)
    with caplog.at_level("DEBUG", logger="lockstep.agent"):
        s = HardwareSampler(worker=2, hz=200)
        assert s.wait_ready()  # the sampler process has started (slow on a loaded machine)
        s.start()
        time.sleep(0.3)
        samples, stats = s.stop()
        HardwareSampler(worker=2, hz=200).start().stop()
    assert stats.source == "host" and s.source == "host"
    assert sum("sampling the host only" in r.message for r in caplog.records) == 1  # once per process
    assert "nvidia-ml-py is not importable" in nvml.unavailable_reason()
    assert stats.samples > 5 and stats.cpu_s > 0
    metrics = set(samples.column("metric").to_pylist())
    assert {"cpu_self", "cpu_other", "mem_used_frac"} <= metrics <= set(HARDWARE)
    assert (samples.column("worker").to_numpy() == 2).all()
    t_us = samples.column("t_us").to_numpy()
    assert abs(t_us.mean() / 1e6 - time.time()) < 60  # unix microseconds


def test_fast_tier_rates_leave_out_a_reading_the_sampler_was_preempted_in():
    t = np.array([0.0, 1e-3, 2e-3, 3e-3, 4e-3])
    t_end = t + np.array(
        [5e-6, 6e-6, 1.5e-3, 5e-6, 4e-6]
    )  # the third reading took 1.5 ms: its counters are of another instant
    nic = np.array([0.0, 1e6, 9e9, 3e6, 4e6])
    cpu = np.array([0.0, 0.5e-3, 7.0, 1.5e-3, 2.5e-3])
    m = fast_host_metrics(t, t_end, nic, cpu)
    np.testing.assert_allclose(
        m["nic_gbps"][1], [1.0, 1.0, 1.0], rtol=1e-3
    )  # 1 MB per ms; the second interval spans 2 ms
    np.testing.assert_allclose(m["cpu_self"][1], [0.5, 0.5, 1.0], rtol=1e-3)
    np.testing.assert_allclose(
        m["cpu_self"][0], (t[[1, 3, 4]] + t_end[[1, 3, 4]]) / 2
    )  # stamped at the middle of the reading


def test_the_sampler_is_a_process_of_its_own():
    before = set(os.listdir("/proc/self/task"))
    s = HardwareSampler(worker=0, hz=1000)
    assert s.wait_ready()
    s.start()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.4:
        pass  # a busy training thread
    during = set(os.listdir("/proc/self/task"))
    samples, stats = s.stop()
    assert during == before  # no sampler thread in the training process
    assert stats.tiers["slow"] == -(-stats.tiers["fast"] // 10)  # /proc/stat on every 10th reading at 1 kHz: 100 Hz
    rows = {
        m: samples.filter(pc.equal(samples.column("metric"), m)).column("value").to_numpy()
        for m in ("cpu_self", "nic_gbps", "cpu_other")
    }
    assert rows["cpu_self"].size > rows["cpu_other"].size > 0 and rows["nic_gbps"].size == rows["cpu_self"].size
    assert rows["cpu_self"].max() > 0  # this process's CPU clock, read from the other process


def test_the_sampler_process_ends_with_the_training_process():
    code = (
        "import sys, time\nfrom lockstep.producers.agent.sampler import HardwareSampler\n"
        "HardwareSampler(0, 100).start()\nprint('sampling', flush=True)\ntime.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "sampling"
        probes = [int(p) for p in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()]
        assert len(probes) == 1
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{probes[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{probes[0]}").exists() or "Z" in Path(f"/proc/{probes[0]}/stat").read_text().split()[2]


def test_in_another_network_namespace_the_probe_reads_that_namespaces_counters():
    # `unshare --net` makes a namespace without mounting its sysfs: /sys/class/net still lists the host's interfaces
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --net is not permitted here (needs CAP_SYS_ADMIN)")
    code = "import os\nfrom lockstep.producers.agent.probe import Counters\nc = Counters(os.getpid())\nprint(c.nic_source, c.nic_bytes())"
    out = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["/proc/net/dev", "-", "0.0"]  # only loopback in there, not the host's eth0 through sysfs
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "sysfs" and "lo" not in out[1].split(",")


def test_the_sampler_process_tiers_become_metrics():
    # what the probe sends: a GPU tier (time, then NvmlReading's fields) where utilisation, power and temperature
    # were read only every other reading, and a PCIe tier
    nan = np.nan
    gpu = np.array(
        [
            [10.0, 1980, 90, 700_000, 60, 0, nan, nan],
            [10.1, 1500, nan, nan, nan, 0x40, nan, nan],
            [10.2, 1500, 80, 650_000, 61, 0x40, nan, nan],
        ]
    )
    pcie = np.array([[10.05, 2e6, 1e6]])
    fast = np.array([[10.0, 10.00001, 0.0, 1.0], [10.1, 10.10001, 1e8, 1.05]])  # t, t_end, NIC bytes, process CPU s
    table = to_table(1, sampler_metrics({"fast": fast, "gpu": gpu, "pcie": pcie}, n_cores=4))
    got = {
        m: table.filter(pc.equal(table.column("metric"), m)).column("value").to_pylist()
        for m in set(table.column("metric").to_pylist())
    }
    assert got["sm_clock_mhz"] == [1980, 1500, 1500] and got["clock_events"] == [0, 0x40, 0x40]
    assert got["sm_active"] == [0.9, 0.8] and got["gpu_power_w"] == [700, 650]  # the readings that had them
    assert got["pcie_gbps"] == [pytest.approx(3.0)] and "nvlink_gbps" not in got
    assert got["nic_gbps"] == [pytest.approx(1.0, rel=1e-3)] and got["cpu_self"] == [pytest.approx(0.5, rel=1e-3)]
