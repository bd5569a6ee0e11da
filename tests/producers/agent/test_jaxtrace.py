"""The JAX trace reader on small hand-written traces in the JAX profiler's format (pure logic: no JAX needed)."""

from __future__ import annotations

import gzip
import json

import pytest

from lockstep.producers.agent.jaxtrace import (
    is_jax_source,
    jax_profiles,
    path_rank,
    read_jax_trace,
    read_trace,
    to_torch_form,
)
from lockstep.producers.agent.trace import TraceError

HOST, PY, XLA, COMPILE = 701, 1, 2, 3


def meta() -> list[dict]:
    return [
        {"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": HOST, "tid": PY, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": HOST, "tid": XLA, "name": "thread_name", "args": {"name": "tf_XLAPjRtCpuClient/1"}},
        {
            "ph": "M",
            "pid": HOST,
            "tid": COMPILE,
            "name": "thread_name",
            "args": {"name": "tf_PjRtCompilerThreadPool/2"},
        },
    ]


def x(tid: int, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "pid": HOST, "tid": tid, "ts": ts, "dur": dur, "name": name, **({"args": args} if args else {})}


def op(name: str, ts: float, dur: float, run: int) -> dict:
    return x(XLA, name, ts, dur, hlo_op=name, hlo_module="jit_step", device_ordinal="0", run_id=str(run))


def trace(slow_ms: float = 0.0) -> dict:
    """Two steps of 10 ms (+ ``slow_ms`` in ``preprocess``); step 0's all-reduce runs on after step 1 began."""
    ev = meta()
    for s in range(2):
        t0 = s * 20_000.0
        ev += [
            x(PY, "train", t0, 10_000 + slow_ms * 1000, step_num=str(s)),
            x(PY, "preprocess", t0 + 100, 3_000 + slow_ms * 1000),
            x(PY, "$train.py:12 preprocess", t0 + 150, 2_000),  # a Python-tracer frame: left out
            x(PY, "PjitFunction(train_step)", t0 + 4_000 + slow_ms * 1000, 200),
            x(PY, "CommonPjRtBuffer::Await", t0 + 4_300 + slow_ms * 1000, 5_000),
            op("dot.1", t0 + 4_250 + slow_ms * 1000, 1_000, 10 + s),
            op("all-reduce.2", t0 + 5_300 + slow_ms * 1000, 3_000, 10 + s),
            x(XLA, "end: dot.1", t0 + 5_250, 1),
            x(COMPILE, "spmd-partitioner", t0 + 100, 900),
        ]
    ev.append(op("all-reduce.7", 20_500.0, 1_000, 10))  # launched in step 0 (run 10), runs in step 1's span
    return {"displayTimeUnit": "ns", "traceEvents": ev}


def rows(te) -> list[tuple]:
    t = te.events
    return list(
        zip(*(t.column(c).to_pylist() for c in ("step", "function", "kind", "resource", "device", "duration_us")))
    )


def test_steps_regions_ops_and_waits_are_read():
    te = read_jax_trace(trace(), worker=3, host="h1")
    assert te.worker == 3 and sorted(te.step_bounds) == [0, 1] and te.meta.steps_from == "ProfilerStep"
    got = {(s, f, k, r, d) for s, f, k, r, d, _ in rows(te)}
    assert (0, "preprocess", "python", "cpu", None) in got
    assert (0, "jit_step/dot.1", "compute", "cpu", "h1/cpu") in got  # an XLA op on a CPU device: cpu, not gpu
    assert (0, "jit_step/all-reduce.2", "collective", "nic", "h1/cpu") in got
    assert (0, "CommonPjRtBuffer::Await", "sync", "none", "h1/cpu") in got
    assert (0, "PjitFunction(train_step)", "compute", "cpu", None) in got
    names = {f for _, f, *_ in got}
    assert not any(n.startswith(("$", "end:")) or "spmd" in n for n in names), names


def test_xla_work_counts_in_the_step_that_launched_it():
    te = read_jax_trace(trace(), worker=0, host="h1")
    late = [r for r in rows(te) if r[1] == "jit_step/all-reduce.7"]
    assert [r[0] for r in late] == [0]  # ran during step 1's span, launched by step 0's dispatch
    assert te.step_bounds[0][1] >= 20_500.0 + 1_000  # the step lasts until the work it launched ended


def test_the_slow_function_shows_in_its_step():
    fast = {(s, f): d for s, f, _, _, _, d in rows(read_jax_trace(trace(), worker=0, host="h"))}
    slow = {(s, f): d for s, f, _, _, _, d in rows(read_jax_trace(trace(slow_ms=20), worker=1, host="h"))}
    assert slow[(1, "preprocess")] - fast[(1, "preprocess")] == pytest.approx(20_000)


def test_only_the_named_step_annotation_is_a_step_when_one_is_given():
    doc = trace()
    doc["traceEvents"].append(x(PY, "lockstep.step", 0.0, 40_000, step_num="7"))
    converted, _ = to_torch_form(doc, step_name="lockstep.step")
    steps = [e["name"] for e in converted["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert steps == ["ProfilerStep#7"]


def test_files_are_recognised_and_ranked_by_their_path(tmp_path):
    run = tmp_path / "worker9" / "rank2" / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    perfetto = run / "perfetto_trace.json.gz"
    perfetto.write_bytes(gzip.compress(json.dumps(trace()).encode()))
    (run / "node7.xplane.pb").write_bytes(b"")
    tb = run / "node7.trace.json.gz"
    tb.write_bytes(perfetto.read_bytes())
    assert is_jax_source(perfetto) and is_jax_source(tb) and is_jax_source(trace())
    assert not is_jax_source(tmp_path / "rank2.json") and not is_jax_source({"traceEvents": []})
    assert path_rank(perfetto) == 2  # the log folder's, not a folder above it
    assert path_rank(tmp_path / "worker9" / "t" / "plugins" / "profile" / "r" / "perfetto_trace.json.gz") is None
    te = read_trace(perfetto)  # the reader diagnose uses hands it over
    assert (te.worker, te.meta.rank_from, te.meta.host) == (2, "file name", "node7")
    assert read_trace(tb).events.num_rows == te.events.num_rows


def test_a_step_number_beyond_the_limit_is_refused():
    doc = trace()
    doc["traceEvents"].append(x(PY, "train", 0.0, 1.0, step_num=str(10**15)))
    with pytest.raises(TraceError, match="step number"):
        read_jax_trace(doc, worker=0)


def test_a_folder_stands_for_its_log_folders_last_runs(tmp_path):
    def profile(log_dir, run):
        d = tmp_path / log_dir / "plugins" / "profile" / run
        d.mkdir(parents=True)
        (d / "perfetto_trace.json.gz").write_bytes(b"")
        return d / "perfetto_trace.json.gz"

    profile("rank0", "2026_01_01_00_00_00")
    r0 = profile("rank0", "2026_01_01_00_05_00")
    r1 = profile("rank1", "2026_01_01_00_00_00")
    (tmp_path / "notes").mkdir()
    assert jax_profiles(tmp_path) == [r0, r1]
    assert jax_profiles(tmp_path / "rank1") == [r1]
    assert jax_profiles(tmp_path / "notes") == []


@pytest.mark.parametrize(
    "event",
    [
        {"ph": "X", "pid": HOST, "tid": XLA, "name": "dot", "ts": "soon", "dur": 1, "args": {"hlo_op": "dot"}},
        {"ph": "X", "pid": HOST, "tid": PY, "name": "f", "ts": [1], "dur": 1},
        {"ph": "X", "pid": HOST, "tid": PY, "name": "PjitFunction(f)", "ts": {"a": 1}, "dur": 1},
    ],
)
def test_fields_of_the_wrong_type_are_a_trace_error(event):
    doc = trace()
    doc["traceEvents"].append(event)
    with pytest.raises(TraceError):
        read_jax_trace(doc, worker=0)
