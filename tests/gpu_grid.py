"""A test grid on real GPU traces: one kernel made slower on one rank, the timeline kept consistent.

    python -m tests.gpu_grid [--job NAME] [--cells]

The jobs are built from the public multi-rank traces of ``tests/data/traces/`` (README there): two ranks of a
128-rank NCCL job as they are (``pair``), the same two with copies of them as five ranks (``pair5``: the copies
have the real difference between the two ranks as their peers' noise), rank 0 of a 16-rank A100 job as four
workers (``a100x4``, the way traces of one rank from several nodes or runs are compared), and independent runs of
ResNet-50 on a V100 (kineto's samples) as ranks: two runs as two ranks (``v100a``, ``v100b``), and the first pair
with copies as four (``v100a4``).  A cell is (job, kernel,
rank, factor): every run of ``kernel`` on ``rank`` lasts ``factor`` times as long (1.2 to 1.5) and everything
that rank did after it is later by the time added, which is what a slower kernel does to a stream and the CPU
that waits for it (the step grows by the extra time).  Kernels are picked per factor where the extra time is
1% to 5% of the step (median over the steps of the culprit rank), the smallest slowdown the detector fires on
and the largest the issue asked about.

A cell is *found* when a worker finding names exactly that rank; *named* when it names the kernel too; *wrong*
when any finding names another rank.  Each trace is read once (``read_chrome_trace``); the slowdown is applied to
its op events and step bounds (``slowed``), so a cell costs one summary per worker and one diagnosis.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from tests.paths import DATA

TRACES = DATA / "traces"
PAIR = (TRACES / "sampled_rank-0.json.gz", TRACES / "sampled_rank-1.json.gz")
A100 = TRACES / "a100_rank0_of16.json.gz"
V100 = tuple(TRACES / f"v100_resnet50_run{i}.json.gz" for i in range(4))
#: job -> the trace of each of its ranks (a rank's trace may be another's copy)
JOBS: dict[str, tuple[Path, ...]] = {
    "pair": PAIR,
    "pair5": (PAIR[0], PAIR[1], PAIR[0], PAIR[1], PAIR[0]),
    "a100x4": (A100,) * 4,
    # two runs of one configuration as two ranks (runs 2 and 3 loaded data with 4 workers, and cuDNN chose other
    # kernels there: 15 wgrad calls a step against 26, so the four runs are not peers)
    "v100a": V100[:2],
    "v100b": V100[2:],
    "v100a4": (V100[0], V100[1], V100[0], V100[1]),
}
FACTORS = (1.2, 1.3, 1.4, 1.5)
COST = (0.01, 0.05)  # the extra time of a cell, as a share of the step


@dataclass(frozen=True)
class Cell:
    job: str
    kernel: str
    rank: int
    factor: float
    cost: float  # the extra time, as a share of the culprit's step (median over steps)


@dataclass(frozen=True)
class Outcome:
    cell: Cell
    found: bool  # a worker finding names exactly the rank
    named: bool  # ... and the kernel
    wrong: list[str]  # findings on another rank that the job as recorded does not have
    recorded: list[str]  # findings on another rank that the job as recorded has too
    confidence: float  # the finding's that names the rank (0 if none)
    summary: str  # every finding, one line each


_read_cache: dict[Path, object] = {}


def _trace(path: Path):
    from lockstep.producers.agent.trace import read_chrome_trace

    if path not in _read_cache:
        _read_cache[path] = read_chrome_trace(path, 0)
    return _read_cache[path]


def slowed(events: pa.Table, bounds: dict[int, tuple[float, float]], kernel: str, factor: float):
    """(events, bounds) as if every run of ``kernel`` took ``factor`` times as long and everything after it waited
    for it: an instant moves by the time added by the runs that ended by then (on any stream, the CPU too)."""
    fn = events.column("function").to_numpy(zero_copy_only=False)
    start = events.column("start_us").to_numpy().astype(np.float64)
    dur = events.column("duration_us").to_numpy().astype(np.float64)
    device = events.column("resource").to_numpy(zero_copy_only=False) == "gpu"
    runs = np.flatnonzero((fn == kernel) & device & (events.column("kind").to_numpy(zero_copy_only=False) == "compute"))
    order = runs[np.argsort(start[runs] + dur[runs], kind="stable")]
    ends = start[order] + dur[order]
    delay = np.concatenate([[0.0], np.cumsum(dur[order] * (factor - 1.0))])

    def later(t: np.ndarray) -> np.ndarray:
        return t + delay[np.searchsorted(ends, t, side="right")]

    new_start, new_end = later(start), later(start + dur)
    out = events.set_column(events.schema.get_field_index("start_us"), "start_us", pa.array(new_start))
    out = out.set_column(out.schema.get_field_index("duration_us"), "duration_us", pa.array(new_end - new_start))
    b = {s: tuple(float(x) for x in later(np.array(v, dtype=np.float64))) for s, v in bounds.items()}
    return out, b


def _from_zero(events: pa.Table, bounds: dict[int, tuple[float, float]]):
    """Steps numbered from 0 in each trace: independent runs (``v100a``) were profiled at other iterations."""
    first = min(bounds) if bounds else 0
    step = events.column("step").to_numpy() - first
    events = events.set_column(events.schema.get_field_index("step"), "step", pa.array(step, pa.int64()))
    return events, {s - first: b for s, b in bounds.items()}


def _summaries(job: str, culprit: int | None = None, kernel: str = "", factor: float = 1.0):
    from lockstep.app.offline import Inputs
    from lockstep.producers.agent.summarise import summarise
    from lockstep.schemas.records import WorkerMeta

    inputs = Inputs(files=len(JOBS[job]))
    for rank, path in enumerate(JOBS[job]):
        te = _trace(path).with_worker(rank)  # type: ignore[attr-defined]
        events, bounds = _from_zero(te.events, te.step_bounds)
        if rank == culprit:
            events, bounds = slowed(events, bounds, kernel, factor)
        host = f"node{rank}"
        inputs.workers[rank] = WorkerMeta(rank=rank, host=host, device=f"{host}/gpu0")
        inputs.hardware[rank] = "none"
        inputs.summaries += summarise(events, None, bounds)
    inputs.expected_workers = len(JOBS[job])
    return inputs


def cells(job: str, factors: tuple[float, ...] = FACTORS, cost: tuple[float, float] = COST) -> list[Cell]:
    """Every (kernel, rank, factor) of ``job`` whose extra time is within ``cost`` of the rank's step."""
    inputs = _summaries(job)
    out = []
    for rank in range(len(JOBS[job])):
        mine = [s for s in inputs.summaries if s.worker == rank]
        per: dict[str, list[float]] = {}
        for s in mine:
            f = s.functions
            kernel = (f.column("kind").to_numpy(zero_copy_only=False) == "compute") & (
                f.column("resource").to_numpy(zero_copy_only=False) == "gpu"
            )
            names = f.column("function").to_numpy(zero_copy_only=False)
            total = f.column("total_us").to_numpy()
            for name, t in zip(names[kernel], total[kernel]):
                per.setdefault(str(name), []).append(float(t) / s.step_time_us)
        for name, shares in sorted(per.items()):
            if len(shares) < len(mine):  # a kernel every step runs
                continue
            share = float(np.median(shares))
            for factor in factors:
                c = (factor - 1.0) * share
                if cost[0] <= c <= cost[1]:
                    out.append(Cell(job, name, rank, factor, round(c, 4)))
    return out


def run(cell: Cell) -> Outcome:
    from lockstep.app.offline import diagnose
    from lockstep.streams.policy import Policy

    findings = diagnose(_summaries(cell.job, cell.rank, cell.kernel, cell.factor), Policy(), cell.job, now=0.0).findings
    mine = [f for f in findings if f.scope == "worker" and list(f.workers) == [cell.rank]]
    others = [f for f in findings if any(w != cell.rank for w in f.workers)]
    before = {(tuple(f.workers), f.function) for f in _recorded(cell.job)}
    return Outcome(
        cell=cell,
        found=bool(mine),
        named=any(f.function == cell.kernel for f in mine),
        wrong=[_line(f) for f in others if (tuple(f.workers), f.function) not in before],
        recorded=[_line(f) for f in others if (tuple(f.workers), f.function) in before],
        confidence=max((f.confidence for f in mine), default=0.0),
        summary="; ".join(_line(f) for f in findings) or "no finding",
    )


_recorded_cache: dict[str, list] = {}


def _recorded(job: str) -> list:
    """The job's findings as recorded (nothing slowed): the real jobs differ between their ranks (``pair``'s rank 1
    does more embedding work, with more input; ``v100a``'s runs differ in their data loading)."""
    from lockstep.app.offline import diagnose
    from lockstep.streams.policy import Policy

    if job not in _recorded_cache:
        _recorded_cache[job] = diagnose(_summaries(job), Policy(), job, now=0.0).findings
    return _recorded_cache[job]


def healthy(job: str) -> list[str]:
    """The job's findings as recorded, one line each."""
    return [_line(f) for f in _recorded(job)]


def _line(f) -> str:
    return f"{f.scope} {list(f.workers)} {f.function[:60]} {f.cause} {f.confidence:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", action="append", choices=sorted(JOBS), help="jobs to run (default: all)")
    ap.add_argument("--cells", action="store_true", help="print every cell")
    args = ap.parse_args(argv)
    total = {"cells": 0, "found": 0, "named": 0, "wrong": 0, "recorded": 0}
    for job in args.job or sorted(JOBS):
        print(f"{job}: healthy: {'; '.join(healthy(job)) or 'no finding'}")
        outcomes = [run(c) for c in cells(job)]
        n = len(outcomes)
        found = sum(o.found for o in outcomes)
        named = sum(o.named for o in outcomes)
        wrong = sum(bool(o.wrong) for o in outcomes)
        recorded = sum(bool(o.recorded) for o in outcomes)
        conf = [o.confidence for o in outcomes if o.found]
        print(
            f"{job}: {n} cells, found {found} ({found / max(n, 1):.0%}), kernel named {named}, "
            f"a new finding on another rank {wrong} (one the recorded job has too: {recorded}), confidence median {np.median(conf) if conf else 0:.2f} "
            f"min {min(conf, default=0):.2f}"
        )
        for o in outcomes:
            if args.cells or not o.found or o.wrong:
                c = o.cell
                mark = "ok" if o.found and not o.wrong else "MISS" if not o.found else "WRONG"
                print(f"  {mark:5} rank {c.rank} x{c.factor} cost {c.cost:.1%} {c.kernel[:70]}: {o.summary}")
        for k, v in (("cells", n), ("found", found), ("named", named), ("wrong", wrong), ("recorded", recorded)):
            total[k] += v
    n = total["cells"]
    print(
        f"all: {n} cells, found {total['found']} ({total['found'] / max(n, 1):.1%}), kernel named {total['named']}, "
        f"a new finding on another rank {total['wrong']} (one the recorded job has too: {total['recorded']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
