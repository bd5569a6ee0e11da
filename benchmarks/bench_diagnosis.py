"""Benchmark: diagnose one profiling window of a large job on one core.

    python benchmarks/bench_diagnosis.py [--workers 10000] [--functions 20] [--steps 8] [--runs 7]

What is measured (median over ``--runs``, wall clock, pinned to one CPU core,
numpy / Arrow single-threaded):

1. **step + window stage**: ``analyze_step`` on each step's ``StepFrame`` and
   ``diagnose_window`` on the step results, with the frames built beforehand,
   as the processor holds them when a step closes;
2. **... plus frame building**: the same with ``StepFrame.from_tables`` from one
   function table per worker (the processor's path: 10,000 tables per step);
3. **the hop between the stages**, per step: a step's result through ``step_report``,
   ``encode``, ``decode`` and ``step_result`` (the window stage's read and check of
   a step report), as it travels through Kafka between (1)'s two halves.

The window is synthetic: every worker runs ``--functions`` functions (kernels,
copies, collectives, Python, data loading, optimizer) with realistic jitter and
hardware readings (the collectives' NIC mean, spread and peak included), workers sit 8 to a host in 4 pipeline stages (peer groups),
and one GPU is thermally throttled so that the finding path runs too.
Rows/s counts function rows (workers x functions x steps) per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from lockstep.schemas import functions as ft  # noqa: E402
from lockstep.schemas.records import StepReport, WorkerMeta, decode, encode  # noqa: E402
from lockstep.streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window, step_report, step_result  # noqa: E402
from lockstep.streams.policy import Policy  # noqa: E402

KINDS = ["compute"] * 11 + [
    "memcpy",
    "memcpy",
    "collective",
    "collective",
    "p2p",
    "python",
    "dataloader",
    "optimizer",
    "other",
]


def synthetic_step(
    workers: int, functions: int, step: int, rng: np.random.Generator
) -> tuple[np.ndarray, list[pa.Table]]:
    """One step: (step times, one function table per worker)."""
    kinds = (KINDS * (functions // len(KINDS) + 1))[:functions]
    names = [f"{k}.{i:02d}" for i, k in enumerate(kinds)]
    base = np.where(np.isin(kinds, ["python", "dataloader", "other"]), 400.0, np.linspace(20_000.0, 2_000.0, functions))
    crit = base * rng.lognormal(0.0, 0.01, (workers, functions))
    gpu = np.array([ft.default_resource(k) == "gpu" for k in kinds])
    culprit = workers * 43 // 100
    clock = np.full((workers, functions), 1980.0) * rng.normal(1, 0.002, (workers, functions))
    crit[culprit, gpu] *= 1.3
    clock[culprit] /= 1.3
    events = np.zeros((workers, functions), dtype=np.uint64)
    events[culprit, gpu] = 0x20
    n = workers * functions
    # collectives' NIC readings: every link at the ring's mean rate, steady (the shape the ring rule reads)
    link = np.array([k in ("collective", "p2p") for k in kinds])[None, :]
    nic = np.where(link, 12.5 * rng.normal(1, 0.01, (workers, functions)), np.nan)
    table = ft.make_table(
        {
            "function": np.tile(np.asarray(names, dtype=object), workers),
            "kind": np.tile(np.asarray(kinds, dtype=object), workers),
            "calls": np.full(n, 8, dtype=np.int32),
            "total_us": crit.ravel(),
            "critical_us": crit.ravel(),
            "mean_us": crit.ravel() / 8,
            "p95_us": crit.ravel() / 7,
            "sm_clock_mhz": np.where(gpu[None, :], clock, np.nan).ravel(),
            "gpu_temp_c": np.where(gpu[None, :], 65.0, np.nan).repeat(workers, axis=0).ravel(),
            "cpu_other": np.full(n, 0.05),
            "samples": np.where(link, 20, 1).repeat(workers, axis=0).ravel().astype(np.int32),
            "nic_gbps": nic.ravel(),
            "nic_gbps_sd": (nic * 0.1).ravel(),
            "nic_gbps_p95": (nic * 1.16).ravel(),
            "clock_events": events.ravel(),
        }
    )
    tables = [table.slice(w * functions, functions) for w in range(workers)]  # one table per worker
    return crit.sum(axis=1), tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--functions", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)

    policy = Policy()
    rng = np.random.default_rng(0)
    metas = [
        WorkerMeta(rank=w, host=f"node{w // 8:05d}", local_rank=w % 8, labels={"pp": str(w % 4)})
        for w in range(args.workers)
    ]
    keys = ("pp",)
    steps = [synthetic_step(args.workers, args.functions, s, rng) for s in range(args.steps)]
    hardware = ["nvml"] * args.workers
    frames = [
        StepFrame.from_tables("bench", "w0", s, metas, st, tables, keys, hardware)
        for s, (st, tables) in enumerate(steps)
    ]
    info = WindowInfo("bench", "w0", 0, args.steps, args.workers)

    def hop(result):
        report = step_report(
            result,
            window_start=0,
            window_steps=args.steps,
            expected_workers=args.workers,
            bytes_in=0,
            policy=policy.ref,
            tenant="",
            closed="complete",
        )
        return step_result(decode(encode(report), StepReport))

    def diagnose(prebuilt: bool):
        fs = (
            frames
            if prebuilt
            else [
                StepFrame.from_tables("bench", "w0", s, metas, st, tables, keys, hardware)
                for s, (st, tables) in enumerate(steps)
            ]
        )
        return diagnose_window(info, [analyze_step(f, policy.diagnosis) for f in fs], policy, now=0.0)

    d = diagnose(True)  # warm-up; also the findings to report
    results = [analyze_step(f, policy.diagnosis) for f in frames]
    times = {"prebuilt": [], "with_frames": [], "hop": []}
    for _ in range(args.runs):
        for mode in times:
            t0 = time.perf_counter()
            if mode == "hop":
                [hop(r) for r in results]
            else:
                diagnose(mode == "prebuilt")
            times[mode].append(time.perf_counter() - t0)
    rows = args.workers * args.functions * args.steps
    med = {k: statistics.median(v) for k, v in times.items()}
    found = [f"{f.workers[:3]} {f.function} {f.cause}" for f in d.findings]
    if args.json:
        print(
            json.dumps(
                {
                    "workers": args.workers,
                    "functions": args.functions,
                    "steps": args.steps,
                    "rows": rows,
                    "runs": args.runs,
                    "median_s": med,
                    "rows_per_s": {k: rows / med[k] for k in ("prebuilt", "with_frames")},
                    "findings": found,
                }
            )
        )
        return 0
    print(
        f"Diagnosis of one window: {args.workers:,} workers x {args.functions} functions x {args.steps} steps = {rows:,} function rows"
    )
    print(f"one CPU core, numpy {np.__version__}, pyarrow {pa.__version__}, median of {args.runs} runs\n")
    print(
        f"  analyze_step x {args.steps} + diagnose_window, StepFrames prebuilt:   {med['prebuilt']:.3f} s   {rows / med['prebuilt'] / 1e6:.2f} M rows/s"
    )
    print(
        f"  ... plus StepFrame.from_tables ({args.workers:,} tables per step):   {med['with_frames']:.3f} s   {rows / med['with_frames'] / 1e6:.2f} M rows/s"
    )
    print(
        f"  the hop between the stages (StepReport built, encoded, decoded, read, checked):   {med['hop'] / args.steps * 1e3:.2f} ms per step"
    )
    print(f"\nfindings: {'; '.join(found) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
