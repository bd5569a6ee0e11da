"""Cut a few steps out of a PyTorch profiler (Kineto) trace, to keep small real traces as test data.

    python scripts/trace_extract.py SRC.json.gz DST.json.gz --steps 552:554
    python scripts/trace_extract.py SRC.json.gz DST.json.gz --span-us 140000:270000

Keeps, unchanged: the ``ProfilerStep#N`` spans of the steps asked for and every CPU, runtime
and sync event that starts inside them (``--steps``), or every event that starts in a stretch of
the trace (``--span-us A:B``, microseconds after its first event); the device events those runtime calls launched
(``correlation``) and the flow events that join them (unless ``--no-flows``); process and thread names.  Each event's
``args`` keep only what the trace reader uses (correlation, device, stream, bytes, process
group, a collective's sequence number); top-level keys except ``traceEvents`` are kept, ``deviceProperties`` reduced to id and
name.  Timestamps and durations are not touched.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re

KEEP_ARGS = (
    "correlation",
    "External id",
    "external id",
    "device",
    "stream",
    "bytes",
    "Process Group Description",
    "Process Group Name",
    "Seq",
)
CPU = (
    "cpu_op",
    "user_annotation",
    "python_function",
    "Operator",
    "cuda_runtime",
    "cuda_driver",
    "Runtime",
    "cuda_sync",
    "mtia_runtime",
    "xpu_runtime",
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--steps", help="A:B, the ProfilerStep numbers to keep (inclusive)")
    ap.add_argument(
        "--span-us", help="A:B, keep what starts between A and B microseconds after the trace's first event"
    )
    ap.add_argument(
        "--no-flows", action="store_true", help="leave out flow events (where correlation ids say the same)"
    )
    a = ap.parse_args(argv)
    with gzip.open(a.src) if a.src.endswith(".gz") else open(a.src, "rb") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    x = [e for e in events if e.get("ph") == "X"]
    if a.steps:
        lo, hi = (int(v) for v in a.steps.split(":"))
        spans = [
            (e["ts"], e["ts"] + e["dur"])
            for e in x
            if re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))
            and e.get("cat") in ("user_annotation", "Operator", "cpu_op")
            and lo <= int(e["name"].split("#")[1]) <= hi
        ]
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
    else:
        t0 = min(e["ts"] for e in x)
        start, end = (t0 + float(v) for v in a.span_us.split(":"))
    kept = [e for e in x if start <= e["ts"] < end and (e.get("cat") in CPU or not a.steps)]
    if a.steps:  # and the device work launched in those steps, wherever it ran
        corr = {e.get("args", {}).get("correlation") for e in kept} - {None}
        kept += [e for e in x if e.get("cat") not in CPU and e.get("args", {}).get("correlation") in corr]
    marks = {(e["pid"], e["tid"], e["ts"]) for e in kept}
    ids = {f.get("id") for f in events if f.get("ph") in ("s", "f") and (f["pid"], f["tid"], f["ts"]) in marks}
    flows = [] if a.no_flows else [f for f in events if f.get("ph") in ("s", "f") and f.get("id") in ids]
    meta = [e for e in events if e.get("ph") == "M"]
    for e in kept:
        e["args"] = {k: v for k, v in e.get("args", {}).items() if k in KEEP_ARGS}
    out = {k: v for k, v in trace.items() if k != "traceEvents"}
    if "deviceProperties" in out:
        out["deviceProperties"] = [{"id": d.get("id"), "name": d.get("name")} for d in out["deviceProperties"]]
    out["traceEvents"] = meta + sorted(kept, key=lambda e: e["ts"]) + flows
    with gzip.open(a.dst, "wt", compresslevel=9) as fh:
        json.dump(out, fh, separators=(",", ":"))


if __name__ == "__main__":
    main()
