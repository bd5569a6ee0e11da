"""The trace reader on real GPU / accelerator traces (tests/data/traces/README.md says where each comes from).

Expected values are computed here from the raw JSON with plain Python (a dict from correlation id to the
launching call, the ProfilerStep spans), independently of the reader's vectorised code.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from lockstep.producers.agent.summarise import summarise
from lockstep.producers.agent.trace import read_chrome_trace
from tests.paths import DATA as DATA_DIR

DATA = DATA_DIR / "traces"
A100 = DATA / "a100_rank0_of16.json.gz"
V100 = DATA / "worker0.1623143089861.pt.trace.json.gz"
MI250 = DATA / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
SYNC = DATA / "event_sync_trace.json.gz"
MTIA = DATA / "mtia_inference_rank_0.json.gz"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset", "mtia_ccp_events")


def raw(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def cpu_steps(trace: dict) -> dict[int, tuple[float, float]]:
    return {
        int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
        and e.get("cat") in ("user_annotation", "Operator")
        and e["name"].startswith("ProfilerStep#")
    }


def step_at(spans: dict[int, tuple[float, float]], t: float) -> int | None:
    """The step whose span holds ``t`` (of overlapping spans, as MTIA's concurrent requests have, the one begun last)."""
    return max((s for s, (a, b) in spans.items() if a <= t < b), key=lambda s: spans[s][0], default=None)


@pytest.fixture(scope="module")
def a100():
    return read_chrome_trace(A100)


def test_device_work_belongs_to_the_step_that_launched_it(a100):
    trace = raw(A100)
    spans = cpu_steps(trace)
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in trace["traceEvents"]
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    want, elsewhere, total = defaultdict(float), 0.0, 0.0
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            s = step_at(spans, launch[e["args"]["correlation"]])
            want[s] += e["dur"]
            total += e["dur"]
            elsewhere += e["dur"] * (step_at(spans, e["ts"]) != s)
    assert (
        elsewhere / total > 0.3
    )  # the trace shows the problem: a step's GPU work runs while the CPU is in the next one
    got = defaultdict(float)
    for r in a100.events.to_pylist():
        if r["stream"].startswith("0/") and r["kind"] != "sync":  # pid 0: the GPU's timelines
            got[r["step"]] += r["duration_us"]
    assert got.keys() == want.keys() == {553, 554}
    assert all(math.isclose(got[s], want[s], rel_tol=1e-9) for s in want)
    # the last step keeps its GPU work, and its span reaches the end of it
    last_cpu_end = spans[554][1]
    tail = [
        r
        for r in a100.events.to_pylist()
        if r["step"] == 554 and r["stream"].startswith("0/") and r["start_us"] >= last_cpu_end
    ]
    assert sum(r["duration_us"] for r in tail) > 10_000
    assert a100.step_bounds[554][0] == spans[554][0] and a100.step_bounds[554][1] >= max(
        r["start_us"] + r["duration_us"] for r in tail
    )


def test_a_blocking_copy_is_a_sync_wait_not_python(a100):
    sums = {
        s.step: {r["function"]: r for r in s.functions.to_pylist()}
        for s in summarise(a100.events, None, a100.step_bounds)
    }
    for step, fns in sums.items():
        wait = fns["cudaMemcpyAsync"]
        assert wait["kind"] == "sync" and wait["resource"] == "none" and wait["critical_us"] > 100_000, (step, wait)
        region = fns["## sparse_data_dist ##"]  # the region that called it: ~156 ms of which the wait was ~147 ms
        assert region["total_us"] > 150_000 and region["critical_us"] < 10_000, (step, region)
    assert "cudaLaunchKernel" not in sums[554]  # launches are part of the CPU function that made them


def test_copies_by_direction_and_input_bytes(a100):
    copies = {
        (r["function"], r["resource"], math.isnan(r["bytes"])) for r in a100.events.to_pylist() if r["kind"] == "memcpy"
    }
    assert copies == {
        ("Memcpy HtoD (Pinned -> Device)", "pcie", False),
        ("Memcpy HtoD (Pageable -> Device)", "pcie", False),
        ("Memcpy DtoH (Device -> Pageable)", "pcie", True),  # not input
        ("Memcpy DtoD (Device -> Device)", "gpu", True),  # not input either
        ("Memset (Device)", "gpu", True),
    }


def test_hosts_devices_and_job_size():
    a = read_chrome_trace(A100)  # no hostName: the file name's
    assert (a.worker, a.meta.rank_from, a.meta.world_size) == (0, "trace", 16)
    assert (a.meta.host, a.meta.device, a.meta.gpu) == (
        "a100_rank0_of16",
        "a100_rank0_of16/gpu0",
        "NVIDIA A100-SXM4-80GB",
    )
    assert set(a.events.column("device").drop_null().to_pylist()) == {"a100_rank0_of16/gpu0"}
    m = read_chrome_trace(MTIA)  # host_name in the trace; an MTIA device
    assert (m.meta.host, m.meta.device, m.meta.gpu) == (
        "twshared38393.01.cco6.facebook.com",
        "twshared38393.01.cco6.facebook.com/mtia17",
        "ARTEMIS",
    )
    r = read_chrome_trace(MI250)  # ROCm: the device is the GPU that ran the kernels (device 2 of 4)
    assert r.meta.device == "mi250_minitoy_train_ROCm6_2_kineto/gpu2" and r.meta.gpu == "AMD Radeon Graphics"


def test_the_kineto_format_of_2021_with_the_rank_in_the_file_name():
    t = read_chrome_trace(V100)
    assert (t.worker, t.meta.rank_from, t.meta.host, t.meta.device, t.meta.steps_from) == (
        0,
        "file name",
        "worker0",
        "worker0/gpu0",
        "ProfilerStep",
    )
    rows = t.events.to_pylist()
    by_kind = defaultdict(set)
    for r in rows:
        by_kind[r["kind"]].add(r["function"])
    assert {"Optimizer.step#SGD.step", "Optimizer.zero_grad#SGD.zero_grad"} <= by_kind["optimizer"]
    assert by_kind["dataloader"] == {"enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"}
    assert any(f.startswith("cudnn::") for f in by_kind["compute"])
    htod = [r for r in rows if r["function"] == "Memcpy HtoD (Pageable -> Device)" and r["bytes"] > 1e6]
    assert len(htod) == 1 and htod[0]["bytes"] == 19267584.0  # the input batch
    assert "cudaMemcpyAsync" in by_kind["sync"]  # its call waited while the pageable copy ran
    # device events joined through `async` flows and correlation ids: all in the step's span or after it, none before
    start = t.step_bounds[10][0]
    assert all(r["start_us"] >= start for r in rows if r["stream"].startswith("0/"))


def test_rocm_kernels_are_device_work():
    t = read_chrome_trace(MI250)
    assert t.worker is None and t.meta.rank_from == ""  # no rank anywhere: the caller numbers it
    rows = [r for r in t.events.to_pylist() if r["step"] == 1]
    kernels = [r for r in rows if r["kind"] == "compute" and r["resource"] == "gpu"]
    assert len(kernels) == 14 and {r["device"] for r in kernels} == {"mi250_minitoy_train_ROCm6_2_kineto/gpu2"}
    assert {r["function"] for r in rows if r["kind"] == "sync"} == {"hipMemcpyWithStream"}
    assert {r["worker"] for r in t.events.to_pylist()} == {-1} and t.with_worker(5).events.column(
        "worker"
    ).to_pylist() == [5] * t.events.num_rows


def test_sync_calls_and_their_records():
    t = read_chrome_trace(SYNC)
    fns = {(r["function"], r["kind"]) for r in t.events.to_pylist()}
    syncs = {f for f, k in fns if k == "sync"}
    assert syncs == {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync"}
    # the cuda_sync records mirror calls the trace holds: not counted twice; non-blocking calls are not functions
    assert not {f for f, _ in fns} & {
        "Stream Sync",
        "Event Sync",
        "Context Sync",
        "cudaLaunchKernel",
        "cudaEventRecord",
        "cudaEventQuery",
    }


def test_mtia_without_profiler_steps_follows_flows():
    trace = raw(MTIA)
    t = read_chrome_trace(MTIA)
    assert t.meta.steps_from == "region Stage::PyTorchMRSGIFTask::run" and len(t.step_bounds) >= 3
    ev = trace["traceEvents"]
    spans = {
        i: (e["ts"], e["ts"] + e["dur"])
        for i, e in enumerate(
            sorted((e for e in ev if e.get("name") == "Stage::PyTorchMRSGIFTask::run"), key=lambda e: e["ts"])
        )
    }
    assert t.step_bounds.keys() == spans.keys() and all(
        t.step_bounds[s][0] == spans[s][0] and t.step_bounds[s][1] >= spans[s][1] for s in spans
    )
    call = {
        e["args"]["correlation"]: e["ts"]
        for e in ev
        if e.get("cat") == "mtia_runtime" and "correlation" in e.get("args", {})
    }
    start = {e["id"]: e["ts"] for e in ev if e.get("ph") == "s" and e.get("cat") == "ac2g"}
    end_at = {(e["pid"], e["tid"], e["ts"]): e["id"] for e in ev if e.get("ph") == "f" and e.get("cat") == "ac2g"}
    want, by_flow = (
        defaultdict(float),
        0,
    )  # device time per launching step: the call with its correlation id, else the flow
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") == "mtia_ccp_events" and "wait" not in e["name"].lower():
            fid = end_at.get((e["pid"], e["tid"], e["ts"]))
            corr = e.get("args", {}).get("correlation")
            when = call[corr] if corr in call else start[fid] if fid in start else e["ts"]
            by_flow += corr not in call and fid in start
            s = step_at(spans, when)
            if s is not None:
                want[s] += e["dur"]
    got = defaultdict(float)
    for r in t.events.to_pylist():
        if r["device"] and r["device"].endswith("/mtia17") and r["kind"] == "compute":
            got[r["step"]] += r["duration_us"]
    assert want and got.keys() == want.keys() and all(math.isclose(got[s], want[s], rel_tol=1e-9) for s in want)
    assert by_flow > 20  # device events whose call is not in the trace (launched before it): joined by their flows
