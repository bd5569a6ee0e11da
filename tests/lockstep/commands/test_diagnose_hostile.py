"""`lockstep diagnose` given hostile files (issue 12): each is one line on stderr, a non-zero exit, no traceback, bounded memory.

Where memory is the threat the command runs in a subprocess of a small wrapper process whose only child it
is, and the wrapper reports the child's peak RSS (``RUSAGE_CHILDREN``).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.csv as pcsv
import pytest

pytestmark = pytest.mark.slow  # every case runs `lockstep diagnose` in a subprocess of a wrapper process

WRAPPER = """
import json, resource, subprocess, sys
p = subprocess.run([sys.executable, "-m", "lockstep", "diagnose", *sys.argv[1:]], capture_output=True, text=True, timeout=60)
print(json.dumps({"rc": p.returncode, "stderr": p.stderr, "peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""
#: the command's own footprint (Python, numpy, pyarrow, msgspec) is ~100 MiB; a bound well under any payload tried here
PEAK_MIB = 400


def diagnose(*args) -> dict:
    p = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def one_line_error(result: dict, message: str) -> None:
    err = result["stderr"]
    assert result["rc"] == 1 and "Traceback" not in err, err
    assert err.startswith("lockstep diagnose: error: ") and err.count("\n") == 1 and message in err, err


def X(name, ts, dur, cat="user_annotation", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def trace(rank=0, steps=(1, 2, 3), fwd=500.0, **top):
    events = [X(f"ProfilerStep#{s}", 1000 * s, 1000) for s in steps] + [X("fwd", 1000 * s + 10, fwd) for s in steps]
    return {"distributedInfo": {"rank": rank, "world_size": 4}, "traceEvents": events, **top}


def test_gzip_bomb_is_refused_before_it_fills_memory(tmp_path):
    member = gzip.compress(b" " * (32 << 20), compresslevel=9)  # 32 MiB of JSON whitespace in ~32 KiB
    bomb = tmp_path / "rank0.json.gz"
    bomb.write_bytes(member * 96)  # 3 MiB of gzip members that unpack to 3 GiB, each trailer saying 32 MiB
    assert 2.9e6 < bomb.stat().st_size < 3.3e6
    r = diagnose(bomb, "--max-input-mb", "64")  # inflated in chunks up to the limit, then refused
    one_line_error(r, "rank0.json.gz: gzip trace unpacks to more than the limit of 67,108,864 bytes (--max-input-mb)")
    assert r["peak_mib"] < PEAK_MIB, r
    single = tmp_path / "rank1.json.gz"
    single.write_bytes(member)
    r = diagnose(single, "--max-input-mb", "16")  # the trailer announces more than the limit: refused without inflating
    one_line_error(r, "rank1.json.gz: gzip trace unpacks to 33,554,432 bytes, more than the limit of 16,777,216")
    assert r["peak_mib"] < PEAK_MIB, r


def test_a_trace_that_is_dev_zero_or_a_fifo(tmp_path):
    (tmp_path / "rank0.json").symlink_to("/dev/zero")
    r = diagnose(tmp_path / "rank0.json")
    one_line_error(r, "rank0.json: not a regular file (a device)")
    assert r["peak_mib"] < PEAK_MIB, r
    os.mkfifo(tmp_path / "rank1.json")
    one_line_error(
        diagnose(tmp_path / "rank1.json"), "rank1.json: not a regular file (a FIFO)"
    )  # no hang: nobody ever writes to it
    os.mkfifo(
        tmp_path / "events"
    )  # no suffix: not even opened for a peek at its first bytes until it is known to be a file
    one_line_error(diagnose(tmp_path / "events"), "events: not a regular file (a FIFO)")
    os.mkfifo(tmp_path / "samples.csv")
    (tmp_path / "good.json").write_text(json.dumps(trace()))
    one_line_error(
        diagnose(tmp_path / "good.json", "--samples", tmp_path / "samples.csv"),
        "samples.csv: not a regular file (a FIFO)",
    )


def test_files_larger_than_the_limit(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(trace()) + " " * (2 << 20))
    one_line_error(diagnose(tmp_path / "rank0.json", "--max-input-mb", "1"), "rank0.json: trace of 2,097,")


@pytest.mark.parametrize(
    "name,content,message",
    [
        (
            "deep.json",
            '{"traceEvents": [{"args": ' + '{"a":' * 100_000 + "1" + "}" * 100_001 + "]}",
            "nested too deeply",
        ),
        (
            "deep_list.json",
            '{"traceEvents": [{"args": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}]}",
            "nested too deeply",
        ),
        (
            "step.json",
            json.dumps(
                {
                    **trace(),
                    "traceEvents": [*trace()["traceEvents"], X("ProfilerStep#99999999999999999999", 5000, 1000)],
                }
            ),
            "ProfilerStep#99999999999999999999: a step number beyond 2147483647",
        ),
        ("rank.json", json.dumps(trace(rank=2**63 - 1)), "distributedInfo.rank 9223372036854775807 is not a rank"),
        ("float_rank.json", json.dumps(trace(rank=1.5)), "distributedInfo.rank 1.5 is not a rank"),
        ("dur.json", json.dumps(trace(fwd=1e300)), "event 'fwd' at ts 1010 lasts 1e+300 µs"),
        ("inf.json", json.dumps(trace()).replace('"dur": 500.0', '"dur": 1e999', 1), "Number out of range"),
    ],
)
def test_hostile_traces_are_one_line_errors(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    r = diagnose(tmp_path / name)
    one_line_error(r, message)
    assert f"{name}: " in r["stderr"]


def test_hostile_tables_are_one_line_errors(tmp_path):
    def table(**override):
        cols = {
            "worker": [0, 1, 2, 3],
            "step": [1, 1, 1, 1],
            "function": ["fwd"] * 4,
            "kind": ["compute"] * 4,
            "start_us": [0.0, 0.0, 0.0, 0.0],
            "duration_us": [500.0, 500.0, 500.0, 500.0],
        }
        return pa.table({**cols, **override})

    cases = [
        (table(worker=[0, 1, 2, 2**63 - 1]), "worker 9223372036854775807 or step 1 out of range"),
        (table(step=[1, 1, 1, 2**31]), "worker 3 or step 2147483648 out of range"),
        (
            table(duration_us=[500.0, 500.0, 1e300, 500.0]),
            "duration_us 1e+300 or start_us beyond what a profiler measures",
        ),
    ]
    for i, (t, message) in enumerate(cases):
        path = tmp_path / f"events{i}.csv"
        pcsv.write_csv(t, path)
        one_line_error(diagnose(path), f"events{i}.csv: op-event {message}")


def test_a_huge_duration_never_drops_a_worker_silently(tmp_path):
    """Before: the worker's function table overflowed float32, the step stage dropped it, and the output said nothing."""
    files = []
    for r in range(4):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(trace(rank=r, fwd=1e300 if r == 2 else 500.0)))
        files.append(tmp_path / f"rank{r}.json")
    one_line_error(diagnose(*files), "rank2.json: event 'fwd' at ts 1010 lasts 1e+300 µs")
