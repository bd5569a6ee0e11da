"""Reading PyTorch profiler Chrome traces into op events (synthetic traces shaped like torch.profiler's)."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import pytest

from lockstep.producers.agent.trace import TraceError, call_site, kernel_key, read_chrome_trace
from lockstep.schemas.events import OP_EVENT_SCHEMA


def X(name, ts, dur, cat="cpu_op", tid=1, pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def trace(events, rank=3, pgs=1, **top):
    dist = {
        "backend": "nccl",
        "rank": rank,
        "world_size": 8,
        "pg_config": [
            {"pg_name": str(i), "pg_desc": "default_pg" if i == 0 else f"pg{i}", "ranks": list(range(8))}
            for i in range(pgs)
        ],
    }
    return {
        "schemaVersion": 1,
        "distributedInfo": dist,
        "host_name": "node07",
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
        "traceEvents": [{"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}}, *events],
        **top,
    }


STEPS = [X("ProfilerStep#7", 1000, 1000, cat="user_annotation"), X("ProfilerStep#8", 2000, 1000, cat="user_annotation")]


def rows(t):
    return {(r["step"], r["function"]): r for r in t.events.to_pylist()}


def test_rank_steps_and_metadata():
    t = read_chrome_trace(trace([*STEPS, X("aten::mm", 1100, 50)]))
    assert t.worker == 3 and t.step_bounds == {7: (1000.0, 2000.0), 8: (2000.0, 3000.0)}
    assert (t.meta.host, t.meta.backend, t.meta.world_size, t.meta.device) == ("node07", "nccl", 8, "")
    assert t.events.schema == OP_EVENT_SCHEMA
    assert read_chrome_trace(trace([*STEPS, X("aten::mm", 1100, 50)]), worker=11).worker == 11


def test_events_belong_to_the_step_holding_their_start():
    t = read_chrome_trace(
        trace([*STEPS, X("a", 1100, 50), X("b", 1990, 50), X("c", 2500, 10), X("before", 500, 10), X("after", 3100, 5)])
    )
    assert sorted(rows(t)) == [(7, "a"), (7, "b"), (8, "c")]


def test_operators_inside_a_region_are_the_region():
    ev = [
        *STEPS,
        X("slow_function", 1100, 300, cat="user_annotation"),
        X("aten::mm", 1150, 100),  # inside the region: part of it
        X("aten::linear", 1500, 100),  # top-level operator: a function of its own
        X("aten::addmm", 1510, 50),  # inside an operator: part of it
        X("Optimizer.step#AdamW.step", 1700, 50, cat="user_annotation"),
        X("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 1800, 20, cat="user_annotation"),
        X("autograd::engine::evaluate_function: AddmmBackward0", 2100, 30),
    ]
    r = rows(read_chrome_trace(trace(ev)))
    assert sorted(f for _, f in r) == [
        "AddmmBackward0",
        "Optimizer.step#AdamW.step",
        "aten::linear",
        "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
        "slow_function",
    ]
    assert r[(7, "slow_function")]["kind"] == "python" and r[(7, "slow_function")]["resource"] == "cpu"
    assert r[(7, "aten::linear")]["kind"] == "compute" and r[(7, "aten::linear")]["resource"] == "cpu"
    assert r[(7, "Optimizer.step#AdamW.step")]["kind"] == "optimizer"
    assert r[(7, "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__")]["kind"] == "dataloader"


def test_nesting_is_per_thread():
    ev = [*STEPS, X("aten::mm", 1100, 500, tid=1), X("aten::mm", 1200, 100, tid=2)]  # another thread: not nested
    assert len(read_chrome_trace(trace(ev)).events) == 2


def test_collectives_by_name_and_process_group():
    ev = [
        *STEPS,
        X("autograd::engine::evaluate_function: AccumulateGrad", 1100, 300),
        X("c10d::allreduce_", 1150, 100),  # launched inside an operator: still communication
        X("gloo:all_reduce", 1200, 400, cat="user_annotation", tid=9),
        X("nccl:send", 1700, 20, cat="user_annotation", **{"Process Group Description": "pp_group"}),
    ]
    r = rows(read_chrome_trace(trace(ev)))
    assert r[(7, "c10d::allreduce_[default_pg]")]["kind"] == "collective"
    assert r[(7, "gloo:all_reduce[default_pg]")]["resource"] == "nic"
    assert r[(7, "nccl:send[pp_group]")]["kind"] == "p2p"
    # with several process groups and no group on the event, the name stays as it is
    assert (7, "gloo:all_reduce") in rows(read_chrome_trace(trace(ev, pgs=2)))


def test_gpu_kernels_and_copies():
    ev = [
        *STEPS,
        X(
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
            1100,
            20,
            cat="kernel",
            pid=0,
            tid=7,
            device=0,
            stream=7,
        ),
        X(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            1200,
            300,
            cat="kernel",
            pid=0,
            tid=13,
        ),
        X("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", 1600, 30, cat="kernel", pid=0, tid=13),
        X("Memcpy HtoD (Pageable -> Device)", 1050, 40, cat="gpu_memcpy", pid=0, tid=7, bytes=4096),
        X("Memset (Device)", 1060, 4, cat="gpu_memset", pid=0, tid=7),
    ]
    t = read_chrome_trace(trace(ev))
    r = rows(t)
    k = r[
        (
            7,
            "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >",
        )
    ]
    assert (k["kind"], k["resource"], k["device"], k["host"]) == ("compute", "gpu", "node07/gpu0", "node07")
    assert r[(7, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")]["kind"] == "collective"
    assert r[(7, "ncclDevKernel_SendRecv")]["kind"] == "p2p"
    cp = r[(7, "Memcpy HtoD (Pageable -> Device)")]
    assert (cp["kind"], cp["resource"], cp["bytes"]) == ("memcpy", "pcie", 4096.0)
    assert r[(7, "Memset (Device)")]["resource"] == "gpu"
    assert t.meta.device == "node07/gpu0" and t.meta.gpu == "NVIDIA H100"


def test_python_frames_by_call_site():
    ev = [*STEPS, X("/home/alice/proj/train.py(42): slow_function", 1100, 30, cat="python_function")]
    assert (7, "train.py(42): slow_function") in rows(read_chrome_trace(trace(ev)))
    assert call_site("C:\\work\\train.py(7): step") == "train.py(7): step"
    assert call_site("<built-in method item of Tensor object>") == "<built-in method item of Tensor object>"


def test_kernel_keys_are_stable_and_bounded():
    assert kernel_key("void   foo<(anonymous namespace)::Op>(float*, int)") == "foo<(anonymous namespace)::Op>"
    assert kernel_key("sm90_xmma_gemm_f16f16_f16f32") == "sm90_xmma_gemm_f16f16_f16f32"
    long = kernel_key("k" * 500)
    assert len(long) == 200 and long == kernel_key("k" * 500) and long != kernel_key("k" * 499 + "j")


def test_files_plain_and_gzipped(tmp_path):
    data = trace([*STEPS, X("aten::mm", 1100, 50)])
    (tmp_path / "r.json").write_text(json.dumps(data))
    (tmp_path / "r.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    plain, gz = read_chrome_trace(tmp_path / "r.json").events, read_chrome_trace(str(tmp_path / "r.json.gz")).events
    assert plain.num_rows == 1 and plain.drop_columns(["bytes"]).equals(gz.drop_columns(["bytes"]))


@pytest.mark.parametrize(
    "data,match",
    [
        (b"not json", "not a Chrome-trace JSON"),
        (b'{"x": 1}', "not a Chrome-trace JSON"),
        (b'{"traceEvents": [{"args": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001 + b"]}", "nested too deeply"),
        (
            json.dumps(trace([X("ProfilerStep#99999999999999999999", 1, 10, cat="user_annotation")])).encode(),
            "step number beyond 2147483647",
        ),
        (json.dumps(trace([*STEPS, X("aten::mm", 1100, 1e300)])).encode(), "lasts 1e\\+300 µs"),
        (
            json.dumps(trace([*STEPS], rank=2**63 - 1)).encode(),
            "distributedInfo.rank 9223372036854775807 is not a rank",
        ),
    ],
)
def test_bad_traces_say_what_is_wrong(tmp_path, data, match):
    p = tmp_path / "bad.json"
    p.write_bytes(data)
    with pytest.raises(TraceError, match=match):
        read_chrome_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        read_chrome_trace(tmp_path / "missing.json")


def test_the_rank_from_the_file_name_when_the_trace_has_none(tmp_path):
    from lockstep.producers.agent.trace import file_rank

    names = {
        "rank-3.json": 3,
        "rank3.pt.trace.json.gz": 3,
        "trainer_rank_12.json": 12,
        "worker7.1623143089861.pt.trace.json": 7,
        "sampled_rank-1.json.gz": 1,
        "myworker3.json": None,
        "framework3.json": None,
        "trace.json": None,
    }
    assert {n: file_rank(Path(n)) for n in names} == names
    data = trace([*STEPS, X("aten::mm", 1100, 50)])
    del data["distributedInfo"]["rank"]
    (tmp_path / "rank-5.json").write_text(json.dumps(data))
    t = read_chrome_trace(tmp_path / "rank-5.json")
    assert (t.worker, t.meta.rank_from, set(t.events.column("worker").to_pylist())) == (5, "file name", {5})
    (tmp_path / "trace.json").write_text(json.dumps(data))
    assert read_chrome_trace(tmp_path / "trace.json").worker is None
    assert read_chrome_trace(tmp_path / "trace.json", worker=9).meta.rank_from == "given"


def test_host_from_the_trace_else_the_file_name(tmp_path):
    data = trace([*STEPS, X("k", 1100, 5, cat="kernel", pid=3, tid=7)])
    assert read_chrome_trace({**data, "hostName": "gpu-node-4"}).meta.device == "gpu-node-4/gpu3"
    del data["host_name"]
    (tmp_path / "node12_4711.1700000000000.pt.trace.json").write_text(
        json.dumps(data)
    )  # tensorboard_trace_handler: <host>_<pid>.<ms>
    t = read_chrome_trace(tmp_path / "node12_4711.1700000000000.pt.trace.json")
    assert (t.meta.host, t.meta.device, t.events.column("device").to_pylist()) == (
        "node12",
        "node12/gpu3",
        ["node12/gpu3"],
    )


def test_steps_without_profiler_step_annotations():
    opt = [
        X("fwd", 100, 300, cat="user_annotation"),
        X("Optimizer.step#AdamW.step", 400, 50, cat="user_annotation"),
        X("fwd", 500, 300, cat="user_annotation"),
        X("Optimizer.step#AdamW.step", 800, 50, cat="user_annotation"),
        X("fwd", 900, 100, cat="user_annotation"),
    ]
    t = read_chrome_trace(trace(opt))
    assert t.meta.steps_from == "Optimizer.step" and t.step_bounds == {
        0: (100.0, 450.0),
        1: (450.0, 850.0),
    }  # the tail after the last one is no step
    assert sorted((s, f) for s, f in rows(t)) == [
        (0, "Optimizer.step#AdamW.step"),
        (0, "fwd"),
        (1, "Optimizer.step#AdamW.step"),
        (1, "fwd"),
    ]
    region = [
        X("serve", 100, 300, cat="user_annotation"),
        X("aten::mm", 150, 10),
        X("serve", 600, 300, cat="user_annotation"),
        X("gc", 950, 10, cat="user_annotation"),
    ]
    t = read_chrome_trace(trace(region))
    assert t.meta.steps_from == "region serve" and t.step_bounds == {0: (100.0, 400.0), 1: (600.0, 900.0)}
    t = read_chrome_trace(trace([X("main", 100, 900, cat="user_annotation"), X("aten::mm", 150, 10)]))
    assert t.meta.steps_from == "whole trace" and t.step_bounds == {0: (100.0, 1000.0)}


def test_device_work_by_launch_through_correlation_or_flows():
    launch = lambda ts, corr: X("cudaLaunchKernel", ts, 5, cat="cuda_runtime", correlation=corr)  # noqa: E731
    ev = [
        *STEPS,
        launch(1900, 11),
        X("late", 2100, 700, cat="kernel", pid=0, tid=7, correlation=11),  # launched in 7, runs in 8
        launch(2950, 12),
        X("last", 3000, 400, cat="kernel", pid=0, tid=7, correlation=12),  # the last step's, after its span
        {"ph": "s", "cat": "ac2g", "id": 13, "pid": 100, "tid": 1, "ts": 1950, "name": "ac2g"},
        {"ph": "f", "cat": "ac2g", "id": 13, "pid": 0, "tid": 9, "ts": 2200, "name": "ac2g", "bp": "e"},
        X("flowed", 2200, 50, cat="kernel", pid=0, tid=9),  # no correlation: its flow says it was launched in 7
        X("orphan", 2300, 10, cat="kernel", pid=0, tid=9),  # neither: the step holding its start
        launch(1200, 14),
        X("Memcpy DtoH (Device -> Pageable)", 1210, 2, cat="gpu_memcpy", pid=0, tid=7, correlation=14, bytes=4),
        X("cudaMemcpyAsync", 1300, 80, cat="cuda_runtime", correlation=15),
        X(
            "Memcpy DtoH (Device -> Pageable)", 1370, 2, cat="gpu_memcpy", pid=0, tid=7, correlation=15, bytes=4
        ),  # its call waited
        X("cudaStreamSynchronize", 1400, 30, cat="cuda_runtime", correlation=16),
    ]
    t = read_chrome_trace(trace(ev))
    r = rows(t)
    assert {(s, f) for s, f in r if f in ("late", "last", "flowed", "orphan")} == {
        (7, "late"),
        (8, "last"),
        (7, "flowed"),
        (8, "orphan"),
    }
    assert t.step_bounds == {7: (1000.0, 2800.0), 8: (2000.0, 3400.0)}
    assert r[(7, "cudaMemcpyAsync")]["kind"] == "sync" and r[(7, "cudaStreamSynchronize")]["kind"] == "sync"
    assert (7, "cudaLaunchKernel") not in r  # a launch is part of the CPU function around it
    assert r[(7, "Memcpy DtoH (Device -> Pageable)")]["resource"] == "pcie" and math.isnan(
        r[(7, "Memcpy DtoH (Device -> Pageable)")]["bytes"]
    )


def test_reading_is_bounded(tmp_path):
    from lockstep.producers.agent.trace import read_bounded

    body = json.dumps(trace([*STEPS, X("aten::mm", 1100, 50)])).encode()
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(body))
    assert read_bounded(tmp_path / "t.json.gz", 1 << 20) == body
    with pytest.raises(TraceError, match=f"unpacks to {len(body):,} bytes, more than the limit of 500"):
        read_bounded(tmp_path / "t.json.gz", 500)  # announced in the gzip trailer: refused before inflating
    member = gzip.compress(b" " * (1 << 20))
    (tmp_path / "multi.json.gz").write_bytes(member * 40)  # 40 MiB in 40 members, the trailer says 1 MiB
    with pytest.raises(TraceError, match="unpacks to more than the limit of 4,194,304 bytes"):
        read_bounded(tmp_path / "multi.json.gz", 4 << 20)
    (tmp_path / "big.json").write_bytes(b" " * 5000)
    with pytest.raises(TraceError, match="5,000 bytes is larger than the limit of 4,096"):
        read_bounded(tmp_path / "big.json", 4096)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(TraceError, match=r"not a regular file \(a FIFO\)"):
        read_bounded(tmp_path / "fifo.json", 1 << 20)  # and no hang waiting for a writer
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    with pytest.raises(TraceError, match=r"not a regular file \(a device\)"):
        read_bounded(tmp_path / "zero.json", 1 << 20)
    with pytest.raises(TraceError, match=r"not a regular file \(a directory\)"):
        read_bounded(tmp_path, 1 << 20)


def test_nesting_is_exact_when_a_stray_zero_timestamp_stretches_a_threads_span():
    """A Kineto trace can hold an event at ``ts`` 0 beside events at ~1.7e15 µs: enclosure is still decided
    in the events' own times, on every thread (checked against every pair)."""
    import numpy as np

    from lockstep.producers.agent.trace import _nested

    rng = np.random.default_rng(5)
    n = 400
    stream = rng.integers(0, 40, n).astype(np.int32)
    ts = 1.7e15 + np.round(rng.uniform(0, 5_000, n), 3)
    dur = np.round(rng.uniform(0.001, 50, n), 3)
    ts[0], dur[0] = 0.0, 1.0  # the stray event
    ts[1], stream[1] = ts[2] + dur[2], stream[2]  # starts exactly where another ends: not inside it
    among = rng.random(n) < 0.9
    among[:3] = True
    got = _nested(stream, ts, dur, among)
    want = np.zeros(n, dtype=bool)
    idx = np.flatnonzero(among)
    for i in idx:
        for j in idx:
            if i == j or stream[i] != stream[j]:
                continue
            before = ts[j] < ts[i] or (ts[j] == ts[i] and (dur[j] > dur[i] or (dur[j] == dur[i] and j < i)))
            if before and ts[i] < ts[j] + dur[j]:
                want[i] = True
    assert not got[1]
    assert np.array_equal(got, want)
