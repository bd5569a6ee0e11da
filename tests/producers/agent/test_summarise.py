"""The host-side summariser: critical path, statistics, hardware while functions ran."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from lockstep.producers.agent.summarise import SummaryError, summarise
from lockstep.schemas import functions as ft
from lockstep.schemas.events import OP_EVENT_SCHEMA, SAMPLE_SCHEMA


def events(rows, worker=0, step=1):
    """rows: (function, kind, start_us, duration_us[, resource[, bytes]])"""
    cols = {c: [] for c in OP_EVENT_SCHEMA.names}
    for r in rows:
        f, k, s, d, *rest = r
        cols["worker"].append(r[5] if len(r) > 5 and isinstance(r[5], int) else worker)
        cols["step"].append(step)
        cols["function"].append(f)
        cols["kind"].append(k)
        cols["start_us"].append(float(s))
        cols["duration_us"].append(float(d))
        cols["resource"].append(rest[0] if rest else None)
        cols["bytes"].append(rest[1] if len(rest) > 1 and not isinstance(rest[1], int) else None)
        cols["host"].append(None), cols["device"].append(None), cols["stream"].append(None)
    return pa.Table.from_pydict(cols, schema=OP_EVENT_SCHEMA)


def by_fn(summary):
    return {r["function"]: r for r in summary.functions.to_pylist()}


def samples(rows):
    w, t, m, v = zip(*rows)
    return pa.Table.from_pydict(
        {"worker": list(w), "t_us": [float(x) for x in t], "metric": list(m), "value": [float(x) for x in v]},
        schema=SAMPLE_SCHEMA,
    )


def test_each_instant_counts_once_gpu_over_copies_over_communication_over_cpu():
    s = summarise(
        events(
            [
                ("launch", "python", 0, 100),  # CPU, overlapped by everything below
                ("gemm", "compute", 10, 30),  # GPU kernel
                ("h2d", "memcpy", 20, 30),  # copy, partly under the kernel
                ("allreduce", "collective", 45, 30),  # communication, partly under the copy
            ]
        )
    )[0]
    f = by_fn(s)
    assert f["gemm"]["critical_us"] == pytest.approx(30)
    assert f["h2d"]["critical_us"] == pytest.approx(10)  # 40..50
    assert f["allreduce"]["critical_us"] == pytest.approx(25)  # 50..75
    assert f["launch"]["critical_us"] == pytest.approx(35)  # 0..10 and 75..100
    assert s.step_time_us == pytest.approx(100)
    assert all(r["total_us"] >= r["critical_us"] for r in f.values())


def test_a_sync_wait_outranks_the_cpu_around_it_and_yields_to_device_work():
    s = summarise(
        events(
            [
                ("## data_dist ##", "python", 0, 100),  # the region that called it
                ("aten::copy_", "compute", 5, 90, "cpu"),  # the operator inside it
                ("cudaMemcpyAsync", "sync", 10, 80),  # blocked until the device got to the copy
                ("gemm", "compute", 30, 20),  # device work of this step meanwhile
                ("Memcpy DtoH", "memcpy", 88, 2),
            ]
        )
    )[0]
    f = by_fn(s)
    assert f["cudaMemcpyAsync"]["kind"] == "sync" and f["cudaMemcpyAsync"]["resource"] == "none"
    assert f["cudaMemcpyAsync"]["critical_us"] == pytest.approx(58)  # 10..30, 50..88
    assert f["gemm"]["critical_us"] == pytest.approx(20) and f["Memcpy DtoH"]["critical_us"] == pytest.approx(2)
    assert f["aten::copy_"]["critical_us"] == pytest.approx(5 + 5)  # 5..10 and 90..95, never the wait
    assert f["## data_dist ##"]["critical_us"] == pytest.approx(5 + 5)


def test_nested_regions_credit_the_innermost_and_idle_time_nobody():
    s = summarise(
        events(
            [
                ("train_step", "python", 0, 100),
                ("slow_function", "python", 10, 50),
                ("log", "python", 20, 5),
                ("opt", "optimizer", 200, 10, "cpu"),
            ]
        )
    )[0]
    f = by_fn(s)
    assert (
        f["log"]["critical_us"],
        f["slow_function"]["critical_us"],
        f["train_step"]["critical_us"],
    ) == pytest.approx((5, 45, 50))
    assert s.step_time_us == pytest.approx(210)
    assert sum(r["critical_us"] for r in f.values()) == pytest.approx(110)  # 100..200 was idle


def test_statistics_of_each_function():
    s = summarise(
        events(
            [
                ("k", "compute", 0, 10),
                ("k", "compute", 20, 30),
                ("k", "compute", 60, 20),
                ("c", "memcpy", 90, 5, "pcie", 4096.0),
                ("c", "memcpy", 95, 5, "pcie", 4096.0),
            ]
        ),
        step_bounds={1: (-10.0, 110.0)},
    )[0]
    k, c = by_fn(s)["k"], by_fn(s)["c"]
    assert (k["calls"], k["total_us"], k["mean_us"], k["p50_us"], k["max_us"], k["first_start_us"]) == pytest.approx(
        (3, 60, 20, 20, 30, 10)
    )
    assert k["p95_us"] == pytest.approx(np.percentile([10, 30, 20], 95), rel=1e-5)
    assert np.isnan(k["bytes"]) and c["bytes"] == 8192 and c["resource"] == "pcie" and k["resource"] == "gpu"
    assert np.isnan(k["wait_us"])  # waits are estimated across peers, not on one host
    assert s.step_time_us == 120
    ft.conform(s.functions)  # the contract of a FeatureBatch's function table


def test_step_bounds_clip_the_critical_path():
    s = summarise(events([("k", "compute", 50, 100)]), step_bounds={1: (0.0, 100.0)})[0]
    assert by_fn(s)["k"]["critical_us"] == pytest.approx(50) and by_fn(s)["k"]["total_us"] == pytest.approx(100)


def test_every_worker_and_step_at_once():
    t = pa.concat_tables([events([("k", "compute", 0, 10)], worker=w, step=s) for w in (2, 0) for s in (5, 4)])
    out = summarise(t)
    assert [(s.worker, s.step) for s in out] == [(0, 4), (0, 5), (2, 4), (2, 5)]
    assert all(s.functions.num_rows == 1 for s in out)


def test_hardware_means_of_the_samples_overlapping_the_function():
    ev = events(
        [
            ("gemm", "compute", 0, 15),
            ("gemm", "compute", 20, 15),
            ("h2d", "memcpy", 40, 10, "pcie"),
            ("py", "python", 60, 10),
        ]
    )
    sm = samples(
        [
            (0, t, "sm_clock_mhz", v)
            for t, v in ((10, 1000), (20, 1200), (30, 1400), (40, 9999), (50, 9999), (60, 9999), (70, 9999))
        ]
        + [(0, t, "cpu_other", 0.1 * i) for i, t in enumerate((10, 20, 30, 40, 50, 60, 70))]
        + [(0, 30, "clock_events", 0x20), (0, 10, "clock_events", 0x04), (0, 70, "clock_events", 0x80)]
        + [(0, 50, "pcie_gbps", 12.0), (0, 55, "pcie_gbps", 10.0), (0, 60, "nic_gbps", 3.0)]
    )
    f = by_fn(summarise(ev, sm)[0])
    # periods (t-10, t]: gemm 0..15 and 20..35 overlap the samples at 10, 20, 30, 40 (each once)
    assert f["gemm"]["sm_clock_mhz"] == pytest.approx((1000 + 1200 + 1400 + 9999) / 4)
    assert f["gemm"]["clock_events"] == 0x20 | 0x04  # not 0x80: after it ran
    assert np.isnan(f["py"]["sm_clock_mhz"]) and np.isnan(f["h2d"]["sm_clock_mhz"])  # GPU clock: only GPU work
    assert f["h2d"]["pcie_gbps"] == 12.0 and np.isnan(
        f["h2d"]["nic_gbps"]
    )  # the sample at 55 covers (50, 55]: after the copy
    assert f["py"]["cpu_other"] == pytest.approx(0.6)  # host CPU: every function; the sample at 70 covers (60, 70]
    assert f["gemm"]["samples"] == 4


def test_spread_and_peak_tell_a_steady_link_from_a_bursty_one():
    """Two workers' all-reduce at the same mean NIC throughput: one link busy all the time, the other bursting and idle."""
    t = np.arange(1, 201) * 10.0  # a sample every 10 us over the 2 ms all-reduce
    steady = np.full(t.size, 1.0)
    bursty = np.where(np.arange(t.size) % 4 == 0, 4.0, 0.0)  # same mean, 1 in 4 samples at 4 GB/s
    ev = pa.concat_tables([events([("allreduce", "collective", 0, 2000)], worker=w) for w in (0, 1)])
    sm = samples(
        [(0, x, "nic_gbps", y) for x, y in zip(t, steady)] + [(1, x, "nic_gbps", y) for x, y in zip(t, bursty)]
    )
    a, b = (by_fn(s)["allreduce"] for s in summarise(ev, sm))
    assert a["nic_gbps"] == pytest.approx(1.0) and b["nic_gbps"] == pytest.approx(
        1.0
    )  # the level cannot tell them apart
    assert a["nic_gbps_sd"] == pytest.approx(0.0) and b["nic_gbps_sd"] == pytest.approx(
        np.std(bursty, ddof=1), rel=1e-6
    )
    assert a["nic_gbps_p95"] == pytest.approx(1.0) and b["nic_gbps_p95"] == pytest.approx(np.percentile(bursty, 95))
    assert np.isnan(a["sm_clock_mhz_sd"]) and np.isnan(a["cpu_other_p95"])  # not sampled


def test_spread_and_peak_count_each_overlapping_sample_once_per_function():
    # two calls of one function whose sample ranges touch: the sample at 20 (period (10, 20]) overlaps both
    ev = events([("gemm", "compute", 0, 15), ("gemm", "compute", 15, 10), ("py", "python", 40, 5)])
    vals = {10: 1000.0, 20: 1200.0, 30: 1500.0, 40: 7000.0, 50: 900.0}
    sm = samples(
        [(0, x, "sm_clock_mhz", y) for x, y in vals.items()] + [(0, 45, "cpu_other", 0.5), (0, 46, "cpu_other", 0.9)]
    )
    f = by_fn(summarise(ev, sm)[0])
    seen = [1000.0, 1200.0, 1500.0]  # periods (t-10, t] overlapping 0..25 (and nothing after the end)
    assert f["gemm"]["samples"] == 3
    assert f["gemm"]["sm_clock_mhz"] == pytest.approx(np.mean(seen))
    assert f["gemm"]["sm_clock_mhz_sd"] == pytest.approx(np.std(seen, ddof=1), rel=1e-6)
    assert f["gemm"]["sm_clock_mhz_p95"] == pytest.approx(np.percentile(seen, 95), rel=1e-6)
    assert f["py"]["cpu_other"] == 0.5 and np.isnan(
        f["py"]["cpu_other_sd"]
    )  # one sample (period 1 us: (44, 45]): no spread
    assert f["py"]["cpu_other_p95"] == 0.5


def test_spread_survives_a_large_level():
    # a clock near 2 GHz wobbling by 1 MHz: the centred sums keep the spread that raw sums of squares would lose
    t = np.arange(1, 1001) * 1.0
    v = 1.98e9 + np.where(np.arange(t.size) % 2 == 0, 1e6, -1e6)
    ev = events([("gemm", "compute", 0, 1000)])
    f = by_fn(summarise(ev, samples([(0, x, "sm_clock_mhz", y) for x, y in zip(t, v)]))[0])
    assert f["gemm"]["sm_clock_mhz_sd"] == pytest.approx(np.std(v, ddof=1), rel=1e-3)


def test_hardware_moments_match_a_brute_force_count():
    rng = np.random.default_rng(11)
    rows = [
        (f"f{i % 7}", "collective", int(rng.integers(0, 5000)), int(rng.integers(1, 400)), "nic") for i in range(60)
    ]
    t = np.sort(rng.choice(np.arange(1, 6000), size=700, replace=False)).astype(float)
    v = rng.gamma(2.0, 1.0, size=t.size)
    f = by_fn(summarise(events(rows), samples([(0, x, "nic_gbps", y) for x, y in zip(t, v)]))[0])
    period = (t[-1] - t[0]) / (t.size - 1)
    for name, got in f.items():
        hit = np.zeros(t.size, dtype=bool)
        for fn, _, s_, d, _ in rows:
            if fn == name:
                hit |= (t > s_) & (t < s_ + d + period)  # the sample's period (t - period, t] overlaps [s, s + d]
        seen = v[hit]
        assert got["samples"] == seen.size
        assert got["nic_gbps"] == pytest.approx(seen.mean(), rel=1e-5)
        assert got["nic_gbps_sd"] == pytest.approx(seen.std(ddof=1), rel=1e-5)
        assert got["nic_gbps_p95"] == pytest.approx(np.percentile(seen, 95), rel=1e-5)


def test_samples_of_another_worker_do_not_count():
    ev = pa.concat_tables([events([("k", "compute", 0, 100)], worker=0), events([("k", "compute", 0, 100)], worker=1)])
    sm = samples(
        [(0, t, "sm_clock_mhz", 1000) for t in (20, 40, 60)] + [(1, t, "sm_clock_mhz", 2000) for t in (20, 40, 60)]
    )
    a, b = summarise(ev, sm)
    assert by_fn(a)["k"]["sm_clock_mhz"] == 1000 and by_fn(b)["k"]["sm_clock_mhz"] == 2000


def test_min_share_leaves_out_small_functions():
    ev = events([("big", "compute", 0, 1000), ("tiny", "python", 1000, 1)])
    assert set(by_fn(summarise(ev)[0])) == {"big", "tiny"}
    assert set(by_fn(summarise(ev, min_share=0.01)[0])) == {"big"}


def test_critical_path_matches_a_brute_force_sweep():
    rng = np.random.default_rng(7)
    kinds = [("compute", "gpu"), ("memcpy", "pcie"), ("collective", "nic"), ("python", "cpu"), ("compute", "cpu")]
    rows = []
    for i in range(300):
        k, r = kinds[rng.integers(len(kinds))]
        rows.append((f"f{i % 23}", k, int(rng.integers(0, 1000)), int(rng.integers(0, 120)), r))
    s = summarise(events(rows), step_bounds={1: (0.0, 1000.0)})[0]
    # reference: walk every microsecond (all times are integers), pick (class, start, position) max
    prio = {"gpu": 3, "pcie": 2, "nic": 1, "cpu": 0}
    want: dict[str, float] = {}
    for t in range(1000):
        live = [
            (prio[r] if k != "memcpy" and k != "collective" else {"memcpy": 2, "collective": 1}[k], s_, i)
            for i, (f, k, s_, d, r) in enumerate(rows)
            if s_ <= t < s_ + d
        ]
        if live:
            f = rows[max(live)[2]][0]
            want[f] = want.get(f, 0.0) + 1.0
    got = {r["function"]: r["critical_us"] for r in s.functions.to_pylist()}
    assert got == pytest.approx({f: want.get(f, 0.0) for f in got}, abs=1e-3)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t: t.drop_columns(["kind"]), "lacks column"),
        (lambda t: t.set_column(t.schema.get_field_index("kind"), "kind", pa.array(["gpu_stuff"])), "kind.*unknown"),
        (
            lambda t: t.set_column(t.schema.get_field_index("duration_us"), "duration_us", pa.array([-1.0])),
            "duration_us",
        ),
        (
            lambda t: t.set_column(t.schema.get_field_index("resource"), "resource", pa.array(["moon"])),
            "resource.*unknown",
        ),
        (lambda t: t.set_column(t.schema.get_field_index("worker"), "worker", pa.array(["seven"])), "cannot read"),
    ],
)
def test_bad_event_tables_say_what_is_wrong(mutate, match):
    with pytest.raises(SummaryError, match=match):
        summarise(mutate(events([("k", "compute", 0, 1)])))
    with pytest.raises(SummaryError, match="sample table lacks"):
        summarise(events([("k", "compute", 0, 1)]), pa.table({"worker": [0]}))
