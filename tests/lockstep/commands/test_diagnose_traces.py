"""`lockstep diagnose` on real GPU traces as people have them (tests/data/traces/README.md says where each comes from)."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np

from lockstep.commands.cli import main
from tests.paths import DATA as DATA_DIR

DATA = DATA_DIR / "traces"
A100 = DATA / "a100_rank0_of16.json.gz"
PAIR = [DATA / "sampled_rank-0.json.gz", DATA / "sampled_rank-1.json.gz"]
GEMM = "cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_tn_align1>"


def run(capsys, *args):
    code = main(["diagnose", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def slowed(trace: dict, kernel: str, factor: float) -> dict:
    """(In place) the trace as if every run of ``kernel`` took ``factor`` times as long, and everything after it waited for it."""
    ev = [e for e in trace["traceEvents"] if "ts" in e and e.get("ph") != "M"]
    runs = sorted(
        (e for e in ev if e.get("cat") == "kernel" and e["name"].startswith(f"void {kernel}(")),
        key=lambda e: e["ts"] + e["dur"],
    )
    assert runs, kernel
    ends = np.array([e["ts"] + e["dur"] for e in runs])
    delay = np.concatenate([[0.0], np.cumsum([e["dur"] * (factor - 1) for e in runs])])

    def later(t: float) -> float:  # the time an instant moves to: after every longer run that ended by then
        return t + float(delay[np.searchsorted(ends, t, side="right")])

    for e in ev:
        start, end = later(e["ts"]), later(e["ts"] + e.get("dur", 0.0))
        e["ts"] = start
        if "dur" in e:
            e["dur"] = end - start
    return trace


def test_two_ranks_of_a_128_rank_job(capsys):
    code, out, err = run(capsys, *PAIR, "--json")
    assert code == 0 and err == "", err
    json.loads(out)
    code, out, _ = run(capsys, *PAIR)
    assert "2 workers x 2 steps (551..552) from 2 files; coverage 2% of 128 workers" in out


def test_a_kernel_one_and_a_half_times_slower_on_one_worker_is_found(tmp_path, capsys):
    """A100 rank 0 of a 16-rank job (the public set has one rank of it) as four workers, one with a GEMM 1.5x slower.

    The copies keep the trace's own ``distributedInfo.rank`` (0): ``--rank`` numbers them, which is also how
    traces of one rank from several runs or nodes are compared.
    """
    files = []
    for r in range(4):
        trace = json.loads(gzip.decompress(A100.read_bytes()))
        path = tmp_path / f"node{r}.json"
        path.write_text(json.dumps(slowed(trace, GEMM, 1.5) if r == 2 else trace))
        files.append(path)
    ranks = [a for r, p in enumerate(files) for a in ("--rank", f"{p}={r}")]
    code, out, err = run(capsys, *files, *ranks, "--json")
    assert code == 0, err
    found = [f for f in json.loads(out) if f["scope"] == "worker"]
    assert [(f["workers"], f["function"], f["devices"], f["hosts"]) for f in found] == [
        ([2], GEMM, ["node2/gpu0"], ["node2"])
    ]
    assert found[0]["steps"] == [553, 554] and found[0]["impact"]["step_time_share"] > 0.009
    ev = {e["feature"]: e for e in found[0]["evidence"]}
    assert ev["work_us"]["value"] > 1.4 * ev["work_us"]["peer_value"]
    healthy = [files[r] for r in (0, 1, 3)]  # without the slowed one: nothing on a worker
    code, out, err = run(
        capsys, *healthy, *[a for r, p in zip((0, 1, 3), healthy) for a in ("--rank", f"{p}={r}")], "--json"
    )
    assert code == 0 and not [f for f in json.loads(out) if f["scope"] == "worker"], out


def test_ranks_and_steps_the_traces_do_not_give_are_said_in_one_line_each(tmp_path, capsys):
    v100 = DATA / "worker0.1623143089861.pt.trace.json.gz"  # rank 0 from its file name
    rocm = tmp_path / "mi250.json.gz"  # nothing names its rank
    shutil.copy(DATA / "mi250_minitoy_train_ROCm6_2_kineto.json.gz", rocm)
    mtia = tmp_path / "inference.json.gz"  # no rank, no ProfilerStep
    shutil.copy(DATA / "mtia_inference_rank_0.json.gz", mtia)
    code, _, err = run(capsys, v100, rocm, mtia)
    assert code == 0, err
    lines = err.splitlines()
    assert lines == [
        "lockstep diagnose: no rank in the trace or its file name: mi250.json.gz: numbered 1 in the order given; "
        "inference.json.gz: numbered 2 in the order given (--rank FILE=N to set one)",
        f"lockstep diagnose: no distributedInfo.rank: {v100.name}: rank 0 from the file name",
        "lockstep diagnose: no ProfilerStep#N: inference.json.gz: 9 iterations inferred from the repeating top-level region Stage::PyTorchMRSGIFTask::run",
    ], lines
    code, _, err = run(capsys, v100, rocm, "--rank", f"{rocm}=7", "--json")
    assert code == 0 and "numbered" not in err and "rank 0 from the file name" in err


def test_bad_rank_options(tmp_path, capsys):
    cases = [
        (("--rank", f"{A100}"), "--rank " + str(A100) + ": expected FILE=N"),
        (("--rank", f"{A100}=x"), "expected FILE=N with N a rank 0..10000000"),
        (("--rank", f"{A100}=99999999999"), "expected FILE=N"),
        (("--rank", "other.json=3"), "other.json is not one of the files given"),
        (("--rank", f"{A100}=3", "--rank", f"{PAIR[0]}=3"), "worker 3 is also in"),
        (("--max-input-mb", "0"), "--max-input-mb must be positive"),
    ]
    for args, message in cases:
        code, _, err = run(capsys, A100, PAIR[0], *args)
        assert code == 1 and message in err and err.startswith("lockstep diagnose: error: ") and err.count("\n") == 1, (
            args,
            err,
        )
