"""Benchmark: diagnose one profiling window of a large job on one core.

    python benchmarks/bench_diagnosis.py [--workers 10000] [--functions 20] [--steps 8] [--runs 7] [--shard-workers 256]

What is measured (median over ``--runs``, wall clock, pinned to one CPU core,
numpy / Arrow single-threaded), all in one process, one after the other in each run
(this machine is shared: compare the figures of one run, not figures of two runs):

1. **step + window stage**: ``analyze_step`` on each step's ``StepFrame`` and
   ``diagnose_window`` on the step results, with the frames built beforehand,
   as the processor holds them when a step closes;
2. **... plus frames from slices**: the same with each step's frame built as the step
   stage builds it from the shard stage's ``StepSlice`` records (one per 256 workers and
   step): decode, read their two Arrow tables, assemble, check every row, ``StepFrame``;
3. **... plus frames from one table per worker** (the baseline: ``FeatureBatch``es before
   issue 13, ``StepFrame.from_tables`` over 10,000 tables per step);
4. **the partition-median floor**: a median per (step, function, column) across the
   workers with ``np.partition``, over every numeric column of the same window's frames:
   what any peer comparison of this window must at least do;
5. **the shard stage**: the window's ``WindowFeatures`` (one encoded record per worker)
   decoded, read, checked and cut into ``StepSlice`` records (encoded): the processor's
   per-record cost of the features, without Kafka;
6. **the hop between the stages**, per step: a step's result through ``step_report``,
   ``encode``, ``decode`` and ``step_result`` (the window stage's read and check of
   a step report), as it travels through Kafka between (1)'s two halves.

Targets (issue 13): one step's frame (2, per step) within 2x that step's analysis; the whole
window (2) within 5x the floor (4); >= 10,000 feature batches (a worker's step: a WindowFeatures carries
``--steps`` of them) per second and core, which ``bench_processor.py features`` measures through the real processor.

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
from lockstep.schemas.records import StepReport, StepSlice, WindowFeatures, WorkerMeta, decode, encode  # noqa: E402
from lockstep.streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window, step_report, step_result  # noqa: E402
from lockstep.streams.policy import Policy  # noqa: E402
from lockstep.streams.stages.shard import step_slices  # noqa: E402
from lockstep.streams.stages.step import read_slice, step_frame  # noqa: E402
from lockstep.streams.windows import Handle, ShardAssembler, StepAssembler  # noqa: E402

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


def window_records(
    metas: list[WorkerMeta], steps: list[tuple[np.ndarray, list[pa.Table]]], shard_workers: int
) -> list[bytes]:
    """The window as the agents send it: one encoded ``WindowFeatures`` per worker (its steps in one compact table)."""
    n = len(metas)
    tables = [
        pa.concat_tables(tables).combine_chunks() for _, tables in steps
    ]  # per step, every worker's rows in rank order
    per = tables[0].num_rows // n
    step_col = np.repeat(np.arange(len(steps), dtype=np.int32), per)
    out = []
    for w, m in enumerate(metas):
        rows = ft.window_table(np.arange(len(steps)), [t.slice(w * per, per) for t in tables])
        assert rows.column("step").to_numpy().tolist() == step_col.tolist()
        out.append(
            encode(
                WindowFeatures(
                    job="bench",
                    window="w0",
                    window_start=0,
                    window_steps=len(steps),
                    expected_workers=n,
                    shard=w // shard_workers,
                    shard_workers=shard_workers,
                    worker=m,
                    steps=list(range(len(steps))),
                    step_time_us=[float(st[w]) for st, _ in steps],
                    functions=ft.pack_window(rows),
                    hardware="nvml",
                )
            )
        )
    return out


def shard_stage(records: list[bytes], keys: tuple[str, ...], shard_workers: int) -> dict[int, list[bytes]]:
    """What the shard stage does with a window's records: decode, read, assemble per shard, check and cut into step
    slices (encoded).  Returns step -> its slices."""
    shards: ShardAssembler = ShardAssembler(1e9)
    out: dict[int, list[bytes]] = {}
    for i, value in enumerate(records):
        rec = decode(value, WindowFeatures)
        closed, _ = shards.add(
            rec, ft.read_compact(rec.functions, rec.functions_codec), len(value), Handle(0, i, None), 0.0
        )
        if closed is not None:
            slices, errors = step_slices(closed.pending, keys)
            assert not errors, errors
            for step, v in slices:
                out.setdefault(step, []).append(v)
    return out


def slice_frame(values: list[bytes], keys: tuple[str, ...]) -> StepFrame:
    """The step stage's frame of one step from its slices: decode, read, assemble, check every row, build."""
    steps: StepAssembler = StepAssembler(1e9)
    closed = None
    for i, value in enumerate(values):
        sl = decode(value, StepSlice)
        closed, _ = steps.add_slice(sl, *read_slice(sl), Handle(0, i, None), 0.0)
    assert closed is not None, "the step's slices did not account for every worker"
    frame, refused = step_frame(closed.pending, keys)
    assert frame is not None and not refused
    return frame


def partition_floor(frames: list[StepFrame]) -> None:
    """A median per (step, function, column) across the workers by ``np.partition``, over every numeric column."""
    for f in frames:
        n = f.n_workers
        for name in f.functions.column_names:
            col = f.functions.column(name)
            if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                continue
            v = col.to_numpy(zero_copy_only=False).reshape(n, -1)
            np.partition(v, n // 2, axis=0)[n // 2]


def numeric_bytes(frames: list[StepFrame]) -> int:
    return sum(
        c.nbytes
        for f in frames
        for c in f.functions.columns
        if pa.types.is_floating(c.type) or pa.types.is_integer(c.type)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--functions", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--shard-workers", type=int, default=256, help="workers per shard of the WindowFeatures (the trigger's default)"
    )
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
    records = window_records(metas, steps, args.shard_workers)
    slices = shard_stage(records, keys, args.shard_workers)
    frames = [slice_frame(slices[s], keys) for s in range(args.steps)]
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

    per_step: dict[str, list[float]] = {"frame": [], "analysis": []}

    def diagnose(how: str):
        if how == "prebuilt":
            fs = frames
        elif how == "tables":
            fs = [
                StepFrame.from_tables("bench", "w0", s, metas, st, tables, keys, hardware)
                for s, (st, tables) in enumerate(steps)
            ]
        else:  # slices, one step at a time as the step stage does: its frame, then its analysis
            results = []
            for s in range(args.steps):
                t0 = time.perf_counter()
                f = slice_frame(slices[s], keys)
                t1 = time.perf_counter()
                results.append(analyze_step(f, policy.diagnosis))
                per_step["frame"].append(t1 - t0)
                per_step["analysis"].append(time.perf_counter() - t1)
            return diagnose_window(info, results, policy, now=0.0)
        return diagnose_window(info, [analyze_step(f, policy.diagnosis) for f in fs], policy, now=0.0)

    d = diagnose("prebuilt")  # warm-up; also the findings to report
    d_slices, d_tables = diagnose("slices"), diagnose("tables")
    same = [(f.workers, f.function, f.cause) for f in d.findings]
    assert (
        same
        == [(f.workers, f.function, f.cause) for f in d_slices.findings]
        == [(f.workers, f.function, f.cause) for f in d_tables.findings]
    )
    per_step = {"frame": [], "analysis": []}
    results = [analyze_step(f, policy.diagnosis) for f in frames]
    times: dict[str, list[float]] = {"prebuilt": [], "slices": [], "tables": [], "floor": [], "shards": [], "hop": []}
    for _ in range(args.runs):
        for mode in times:
            t0 = time.perf_counter()
            if mode == "hop":
                [hop(r) for r in results]
            elif mode == "floor":
                partition_floor(frames)
            elif mode == "shards":
                shard_stage(records, keys, args.shard_workers)
            else:
                diagnose(mode)
            times[mode].append(time.perf_counter() - t0)
    rows = args.workers * args.functions * args.steps
    med = {k: statistics.median(v) for k, v in times.items()}
    frame_s, analysis_s = statistics.median(per_step["frame"]), statistics.median(per_step["analysis"])
    ratios = {
        "frame_vs_analysis": frame_s / analysis_s,
        "window_vs_floor": med["slices"] / med["floor"],
        "tables_window_vs_floor": med["tables"] / med["floor"],
    }
    shard_rate = len(records) / med["shards"]
    record_bytes = statistics.median(len(r) for r in records)
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
                    "rows_per_s": {k: rows / med[k] for k in ("prebuilt", "slices", "tables")},
                    "per_step_s": {"frame": frame_s, "analysis": analysis_s},
                    "ratios": ratios,
                    "floor_bytes": numeric_bytes(frames),
                    "shard_stage_records_per_s": shard_rate,
                    "window_features_bytes": record_bytes,
                    "findings": found,
                }
            )
        )
        return 0
    ok = {True: "met", False: "NOT met"}
    print(
        f"Diagnosis of one window: {args.workers:,} workers x {args.functions} functions x {args.steps} steps = {rows:,} function rows"
    )
    print(
        f"one CPU core, numpy {np.__version__}, pyarrow {pa.__version__}, median of {args.runs} runs (each run measures every line)\n"
    )
    print(
        f"  analyze_step x {args.steps} + diagnose_window, StepFrames prebuilt:        {med['prebuilt']:.3f} s   {rows / med['prebuilt'] / 1e6:.2f} M rows/s"
    )
    print(
        f"  ... plus frames from StepSlices ({len(slices[0])} per step, the step stage):   {med['slices']:.3f} s   {rows / med['slices'] / 1e6:.2f} M rows/s"
    )
    print(
        f"  ... plus frames from one table per worker ({args.workers:,} per step, before):   {med['tables']:.3f} s   {rows / med['tables'] / 1e6:.2f} M rows/s"
    )
    print(
        f"  partition-median floor ({numeric_bytes(frames) / 1e6:.0f} MB of numeric columns, np.partition):   {med['floor']:.3f} s"
    )
    print(
        f"  shard stage: {len(records):,} WindowFeatures ({record_bytes / 1e3:.1f} KB each) -> StepSlices:   {med['shards']:.3f} s"
        f" = {shard_rate:,.0f} records/s ({shard_rate * args.steps:,.0f} worker-steps/s)"
    )
    print(
        f"  the hop between the stages (StepReport built, encoded, decoded, read, checked):   {med['hop'] / args.steps * 1e3:.2f} ms per step"
    )
    print()
    print(
        f"  one step: frame from slices {frame_s * 1e3:.1f} ms vs its analysis {analysis_s * 1e3:.1f} ms = {ratios['frame_vs_analysis']:.2f}x"
        f" (target <= 2x: {ok[ratios['frame_vs_analysis'] <= 2]})"
    )
    print(
        f"  whole window with frames from slices vs the floor: {ratios['window_vs_floor']:.2f}x (target <= 5x: {ok[ratios['window_vs_floor'] <= 5]});"
        f" from one table per worker: {ratios['tables_window_vs_floor']:.2f}x"
    )
    print(
        f"  shard stage: {shard_rate * args.steps:,.0f} worker-steps/s on one core, {shard_rate:,.0f} WindowFeatures of {args.steps} steps"
        f" (target >= 10,000 feature batches/s, a batch being one worker's step: {ok[shard_rate * args.steps >= 10_000]};"
        f" through faust and Kafka: benchmarks/bench_processor.py features)"
    )
    print(f"\nfindings: {'; '.join(found) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
