"""The step stage's function-table path for one step of a 1,024-worker job: per record, then per step.

    .venv/bin/python benchmarks/function_tables.py [--workers 1024] [--runs 7]

Each record read and checked alone (``ft.unpack``, what the step stage did) against now (each record read, ``ft.read``,
and the whole step's values checked in one pass at the step's close, ``ft.check_tables``).  Prints the
median over the runs of the time per record and per step, on one core; the simulator's tables (12 rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

from lockstep.app.load import scenario
from lockstep.producers.simulator.fleet import FleetSimulator
from lockstep.schemas import functions as ft
from lockstep.schemas.records import FeatureBatch, decode, encode


def median_s(fn, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    fleet = FleetSimulator(scenario(args.workers))
    wire = [encode(b) for b in fleet.feature_batches(fleet.step(60), fleet.trigger())]
    batches = [decode(v, FeatureBatch) for v in wire]
    tables = [ft.read(b.functions) for b in batches]
    n = len(batches)
    rows = [
        ("decode (msgspec), per record", median_s(lambda: [decode(v, FeatureBatch) for v in wire], args.runs)),
        (
            "each record checked alone: unpack, per record",
            median_s(lambda: [ft.unpack(b.functions) for b in batches], args.runs),
        ),
        (
            "now: read (zstd + Arrow IPC), per record",
            median_s(lambda: [ft.read(b.functions) for b in batches], args.runs),
        ),
        ("now: check_tables, the whole step", median_s(lambda: ft.check_tables(tables), args.runs)),
    ]
    print(f"{n} feature batches of {tables[0].num_rows} rows (one step), median of {args.runs} runs, one core")
    for name, s in rows:
        print(f"  {name:52s} {s / n * 1e6:8.1f} us/record  {s * 1e3:8.1f} ms/step")
    before, now = rows[1][1], rows[2][1] + rows[3][1]
    print(
        f"  table path per step: each record checked alone {before * 1e3:.0f} ms, the step checked at once {now * 1e3:.0f} ms ({before / now:.1f}x)"
    )


if __name__ == "__main__":
    main()
