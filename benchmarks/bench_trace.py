"""Benchmark of the trace reader on a real GPU trace, tiled to the size of a long profiling window.

    python benchmarks/bench_trace.py [--copies 20] [--repeats 3]

Takes ``tests/data/traces/a100_rank0_of16.json.gz`` (2 steps of an A100 NCCL job, ~50,000 events),
repeats it ``--copies`` times one after the other (times shifted by its length, step numbers and
correlation ids renumbered, so that each copy is more steps of the same job), writes it as one
JSON file and reads it as ``lockstep diagnose`` and the agent do: ``read_chrome_trace`` (decode,
launch attribution, sync waits, naming) then ``summarise``.  Prints the medians and the rate in
events per second.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

from lockstep.producers.agent.summarise import summarise
from lockstep.producers.agent.trace import read_chrome_trace

TRACE = Path(__file__).parents[1] / "tests" / "data" / "traces" / "a100_rank0_of16.json.gz"


def tiled(trace: dict, copies: int) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e.get("dur", 0) for e in events) - t0
    corr = 1 + max(e.get("args", {}).get("correlation", 0) for e in events)
    out = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    for i in range(copies):
        for e in events:
            e = copy.deepcopy(e)
            e["ts"] += i * span
            if "correlation" in e.get("args", {}):
                e["args"]["correlation"] += i * corr
            if e["name"].startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{int(e['name'][13:]) + 2 * i}"
            out.append(e)
    return {**trace, "traceEvents": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    trace = tiled(json.loads(gzip.decompress(TRACE.read_bytes())), a.copies)
    n = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        path.write_text(json.dumps(trace))
        size = path.stat().st_size
        del trace
        read_s, summ_s = [], []
        for _ in range(a.repeats):
            t1 = time.perf_counter()
            te = read_chrome_trace(path)
            t2 = time.perf_counter()
            summarise(te.events, None, te.step_bounds)
            read_s.append(t2 - t1)
            summ_s.append(time.perf_counter() - t2)
    r, s = statistics.median(read_s), statistics.median(summ_s)
    print(
        f"{a.copies} copies of {TRACE.name}: {n:,} complete events, {size / 1e6:.0f} MB of JSON, {len(te.step_bounds)} steps, "
        f"{te.events.num_rows:,} op events; read {r:.2f} s ({n / r / 1e6:.2f} M events/s), summarise {s:.2f} s "
        f"(median of {a.repeats})"
    )


if __name__ == "__main__":
    main()
