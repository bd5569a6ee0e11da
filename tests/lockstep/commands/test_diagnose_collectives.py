"""`lockstep diagnose` matching collectives across ranks by their sequence number (issue 23, item 5).

The jobs are derived from the real A100 trace (tests/data/traces/README.md): rank 0 of a 16-rank NCCL job as four
workers, one of them with a GEMM 1.5x slower (as in test_diagnose_traces.py).  :func:`numbered` writes the
collectives' numbers the way ``torch.profiler`` does on today's torch (the public trace is from a torch that
wrote none): a ``record_param_comms`` operator inside each ``c10d::`` operator, enclosing its ``nccl:`` region and
the launch of its kernel, with ``Seq`` (the collective's number in its process group), ``Process Group Name`` and
``Process Group Description``.  :func:`extra_collective` gives a rank one all-reduce more per step in another
process group, under the same NCCL kernel name as the job's own collectives (kernels do not carry their group).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lockstep.app.offline import diagnose, load_inputs
from lockstep.commands.cli import main
from lockstep.streams.policy import Policy
from tests.lockstep.commands.test_diagnose_traces import A100, GEMM, slowed

#: the extra collective's kernel: as long as a large all-reduce in a pipeline group, run while the GPU is idle
EXTRA_US = 30_000
SEND_RECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"


def numbered(trace: dict, group: tuple[str, str] = ("0", "default_pg")) -> dict:
    """(In place) every ``c10d::`` operator's collective numbered in ``group`` in the order of their starts, on a
    ``record_param_comms`` inside it (the trace's own where it has one, else one added just inside it)."""
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    c10d = [e for e in ops if e["name"].startswith("c10d::")]

    def inside(r: dict, o: dict) -> bool:
        return r["tid"] == o["tid"] and o["ts"] <= r["ts"] and r["ts"] + r["dur"] <= o["ts"] + o["dur"]

    records = [e for e in ops if e["name"] == "record_param_comms"]
    for o in c10d:
        if not any(inside(r, o) for r in records):
            r = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": o["pid"], "tid": o["tid"]}
            records.append({**r, "ts": o["ts"] + 1, "dur": o["dur"] - 2, "args": {}})
            trace["traceEvents"].append(records[-1])
    ours = sorted((r for r in records if any(inside(r, o) for o in c10d)), key=lambda e: e["ts"])
    for n, r in enumerate(ours):
        r.setdefault("args", {}).update(
            {"Seq": n, "Process Group Name": group[0], "Process Group Description": group[1]}
        )
    return trace


def extra_collective(trace: dict, us: float, group: tuple[str, str] = ("1", "pp")) -> dict:
    """(In place) one all-reduce more per step in ``group`` (numbered 0, 1, ... in it), launched from a thread of
    its own during the step's blocking copy, its kernel where the GPU is idle: nothing else moves."""
    x = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in x if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    copies = sorted((e for e in x if e["name"] == "cudaMemcpyAsync" and e["dur"] > 100_000), key=lambda e: e["ts"])
    assert copies, "the A100 trace blocks in a copy every step"
    for k, copy in enumerate(copies):
        t = copy["ts"] + 1000
        while hit := [b for a, b in busy if a < t + us + 2000 and b > t]:  # the first idle stretch long enough
            t = max(hit) + 1
        assert t + us < copy["ts"] + copy["dur"]
        cpu = {"ph": "X", "pid": copy["pid"], "tid": 77777}
        corr = 9_000_000 + k
        trace["traceEvents"] += [
            {**cpu, "cat": "cpu_op", "name": "c10d::allreduce_", "ts": t, "dur": 80, "args": {}},
            {
                **cpu,
                "cat": "cpu_op",
                "name": "record_param_comms",
                "ts": t + 5,
                "dur": 70,
                "args": {"Seq": k, "Process Group Name": group[0], "Process Group Description": group[1]},
            },
            {**cpu, "cat": "user_annotation", "name": "nccl:all_reduce", "ts": t + 15, "dur": 55, "args": {}},
            {
                **cpu,
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": t + 20,
                "dur": 10,
                "args": {"correlation": corr},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": SEND_RECV,
                "pid": 0,
                "tid": 285,
                "ts": t + 40,
                "dur": us,
                "args": {"device": 0, "stream": 285, "correlation": corr},
            },
        ]
    return trace


def without_numbers(trace: dict) -> dict:
    """(In place) the trace as a torch that numbers nothing writes it."""
    for e in trace["traceEvents"]:
        (e.get("args") or {}).pop("Seq", None)
    return trace


def _job(tmp: Path, *, numbers: bool, extra_us: float) -> list[str]:
    """Four workers of the A100 trace, worker 2 with the GEMM 1.5x slower; workers 2 and 3 (a pipeline group)
    with one all-reduce more per step when ``extra_us``; the CLI's arguments for them."""
    files = []
    for r in range(4):
        trace = numbered(json.loads(gzip.decompress(A100.read_bytes())))
        if extra_us and r in (2, 3):
            extra_collective(trace, extra_us)
        if r == 2:
            slowed(trace, GEMM, 1.5)
        if not numbers:
            without_numbers(trace)
        path = tmp / f"{'numbered' if numbers else 'plain'}{extra_us:g}" / f"node{r}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(trace))
        files.append(path)
    return [*map(str, files), *[a for r, p in enumerate(files) for a in ("--rank", f"{p}={r}")], "--json"]


def _worker_findings(capsys, args: list[str]) -> list[dict]:
    code = main(["diagnose", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [f for f in json.loads(out) if f["scope"] == "worker"]


@pytest.mark.slow
def test_a_collective_of_another_group_does_not_hide_the_slowed_rank_when_the_trace_numbers_them(tmp_path, capsys):
    """Workers 2 and 3 run one 30 ms all-reduce more per step in their own process group, under the kernel name of
    the job's collectives.  Numbered, each instance is matched with its own on the other ranks: nobody waited, and
    the diagnosis is the one of the job without the extra collective (the slowed worker 2 alone, at the same cost).
    Without numbers (as today) the per-step totals of the kernel are compared: workers 2 and 3 seem to wait 30 ms
    that workers 0 and 1 do not, so 0 and 1 are named for their "own work", and worker 2's cost is lost."""
    reference = _worker_findings(capsys, _job(tmp_path, numbers=True, extra_us=0))
    assert [(f["workers"], f["function"]) for f in reference] == [([2], GEMM)]
    share = reference[0]["impact"]["step_time_share"]
    assert share > 0.009

    matched = _worker_findings(capsys, _job(tmp_path, numbers=True, extra_us=EXTRA_US))
    assert [(f["workers"], f["function"]) for f in matched] == [([2], GEMM)]
    assert matched[0]["impact"]["step_time_share"] == pytest.approx(share, rel=0.01)
    assert matched[0]["confidence"] == pytest.approx(reference[0]["confidence"])

    positional = _worker_findings(capsys, _job(tmp_path, numbers=False, extra_us=EXTRA_US))
    named = sorted(w for f in positional for w in f["workers"])
    assert {0, 1} <= set(named), positional  # the innocent ones
    slowed_rank = [f for f in positional if f["workers"] == [2]]
    assert all(f["impact"]["step_time_share"] < share / 2 for f in slowed_rank), slowed_rank


def test_an_op_event_table_with_numbers_is_matched_too(tmp_path):
    """An op-event table's optional ``collective_seq`` and ``process_group`` columns: workers 0 and 1 run one
    all-reduce more in their own group (numbers 0), the job's two all-reduces are numbers 0 and 1 of group "0".
    Worker 3 arrives last at each (its calls are the shortest): the waits are each call's excess over worker 3's,
    and the extra one's over the shorter of workers 0 and 1 (it is not compared with 2 and 3, which never ran it)."""
    rows = []
    for w in range(4):
        rows.append((w, 1, "train.py(9): step", "python", 0.0, 1000.0 + 100 * (w == 3), None, None))
        for n, d in enumerate((300.0 - 50 * w, 200.0 - 40 * w)):  # the job's: shortest on worker 3
            rows.append((w, 1, "nccl:all_reduce", "collective", 1100.0 + 400 * n, d, n, "0"))
        if w < 2:  # the extra one, in group "pp": 80 on worker 0, 50 on worker 1
            rows.append((w, 1, "nccl:all_reduce", "collective", 1900.0, 80.0 - 30 * w, 0, "pp"))
    names = ("worker", "step", "function", "kind", "start_us", "duration_us", "collective_seq", "process_group")
    table = pa.table({k: list(v) for k, v in zip(names, zip(*rows))})
    path = tmp_path / "events.parquet"
    pq.write_table(table, path)
    inputs = load_inputs([path], None, None)
    (summary,) = [s for s in inputs.summaries if s.worker == 0]
    assert summary.collectives is not None and summary.collectives.num_rows == 3
    results: list = []
    diagnose(inputs, Policy(), "t", now=0.0, keep=results)
    workers = results[0].workers.to_pydict()
    wait = dict(zip(workers["worker"], workers["wait_us"]))
    # the job's calls: (300 - 50w) - 150 and (200 - 40w) - 80; the extra one: worker 0 waits 30
    assert wait == pytest.approx({0: 150 + 120 + 30, 1: 100 + 80 + 0, 2: 50 + 40, 3: 0.0})
    # without the numbers the step stage compares totals: worker 0's extra call reads as waiting
    plain = tmp_path / "plain.parquet"
    pq.write_table(table.drop_columns(["collective_seq", "process_group"]), plain)
    results = []
    diagnose(load_inputs([plain], None, None), Policy(), "t", now=0.0, keep=results)
    workers = results[0].workers.to_pydict()
    wait = dict(zip(workers["worker"], workers["wait_us"]))
    assert wait == pytest.approx({0: 580 - 230, 1: 460 - 230, 2: 320 - 230, 3: 0.0})
