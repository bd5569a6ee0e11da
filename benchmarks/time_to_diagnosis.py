"""Time to diagnosis: from a fault's onset to its finding stored in DuckDB, live, under the default policy.

    python benchmarks/time_to_diagnosis.py                       # simulated jobs: faults costing 2%, 5%, 20% of the step
    python benchmarks/time_to_diagnosis.py --runs 5 --costs 0.1  # more runs of one cost
    python benchmarks/time_to_diagnosis.py --real                # real torch DDP jobs of 2, 3 and 4 ranks as well

What is measured.  The embedded broker, a processor and a sink start once (as child processes, as in production).
Each simulated run publishes a 16-worker job step by step at ``--steps-per-s`` (10) with one worker's GPU slowed from
step 80 by the amount that costs the asked share of the step (found on the simulator itself); the detector must notice
the slowdown on its own, profile a window, and the sink must store a finding naming that worker.  Onset-to-finding is
counted in seconds and in steps (seconds times the job's step rate: the simulated job stops a few steps after its
window).  Each real run is
``lockstep agent run -- torchrun`` of ``tests/integration/live_job.py`` (CPU, gloo) whose last rank spends 30 ms more
in ``preprocess`` from step 120 (about 30-60% of its step here).  Prints p50 and p90 per cost and per job size, and
the runs that found nothing within ``--timeout-s``.  The machine is shared: read the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lockstep.app.runtime import Pipeline  # noqa: E402
from lockstep.broker import EmbeddedBroker  # noqa: E402
from lockstep.config import Settings  # noqa: E402
from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config  # noqa: E402
from lockstep.producers.simulator.faults import Fault  # noqa: E402
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario  # noqa: E402
from lockstep.producers.simulator.live import run_live  # noqa: E402
from lockstep.producers.simulator.topology import Topology  # noqa: E402
from lockstep.sinks.http import query, wait_for  # noqa: E402
from lockstep.streams.app import changelog_topics  # noqa: E402

ONSET = 80
CULPRIT = 3


def _scenario(job: str, severity: float, seed: int) -> Scenario:
    return Scenario(
        job=job,
        seed=seed,
        topology=Topology(workers=16, gpus_per_host=8),
        faults=(Fault(type="gpu_slow", workers=(CULPRIT,), severity=severity, start_step=ONSET),),
    )


def step_cost(severity: float) -> float:
    """The share of the step a gpu_slow fault of ``severity`` costs (median over 20 steps, against no fault)."""
    sim = FleetSimulator(_scenario("cost", severity, 1))
    slow = np.median([sim.step(s, readings=False).step_time_us.max() for s in range(ONSET, ONSET + 20)])
    fast = np.median([sim.step(s, faults=(), readings=False).step_time_us.max() for s in range(ONSET, ONSET + 20)])
    return float(slow / fast - 1.0)


def severity_for(cost: float) -> float:
    lo, hi = 1e-3, 9.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_cost(mid) < cost else (lo, mid)
    return (lo + hi) / 2


def simulated_run(settings: Settings, cost: float, seed: int, steps_per_s: float, timeout_s: float) -> dict:
    job = f"ttd-{int(cost * 100)}-{seed}-{uuid.uuid4().hex[:4]}"
    topics = ensure_topics(settings)
    control = Tail(consumer_config(settings, None), topics.control).open()
    found: dict = {}
    started = time.time()
    step_at: dict[int, float] = {}

    def progress(step: int, _res: object) -> None:
        step_at[step] = time.time()

    try:
        live = run_live(
            FleetSimulator(_scenario(job, severity_for(cost), seed)),
            Publisher(producer_config(settings)),
            control,
            topics,
            steps_per_s=steps_per_s,
            max_steps=ONSET + int(timeout_s * steps_per_s),
            progress=progress,
            end_job=False,
        )
    finally:
        control.close()

    def stored() -> bool:
        rows = query(
            settings.db,
            "SELECT epoch(min(created_at)) FROM findings WHERE job = ? AND list_contains(workers, ?)",
            [job, CULPRIT],
        )[1]
        if rows and rows[0][0] is not None:
            found["at"] = rows[0][0]
        return "at" in found

    wait_for(stored, 30, 0.5)
    onset_t = step_at.get(ONSET, started)
    if "at" not in found:
        return {"cost": cost, "found": False, "triggers": len(live.triggers)}
    seconds = found["at"] - onset_t
    # the simulated job stops a few steps after its window: count the steps it would have run by then
    return {"cost": cost, "found": True, "steps": round(seconds * steps_per_s), "seconds": seconds}


def real_run(settings: Settings, world: int, tmp: Path, timeout_s: float) -> dict:
    from tests.integration import test_live_jobs as live

    job = live.start_job(settings, tmp, f"real{world}-{uuid.uuid4().hex[:4]}", world, world - 1)
    try:
        ok = wait_for(
            lambda: (
                any(world - 1 in f[1] and "preprocess" in f[2] for f in live.findings(settings, job.job))
                or job.proc.poll() is not None
            ),
            timeout_s,
            1.0,
        )
        hits = [f for f in live.findings(settings, job.job) if world - 1 in f[1] and "preprocess" in f[2]]
        if not ok or not hits:
            return {"world": world, "found": False}
        steps, seconds = live.onset_to_finding(job, min(f[5] for f in hits))
        return {"world": world, "found": True, "steps": steps, "seconds": seconds}
    finally:
        job.stop()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarise(label: str, runs: list[dict]) -> dict:
    hit = [r for r in runs if r["found"]]
    steps = [r["steps"] for r in hit]
    secs = [r["seconds"] for r in hit]
    row = {
        "case": label,
        "runs": len(runs),
        "found": len(hit),
        "steps_p50": _pct(steps, 50),
        "steps_p90": _pct(steps, 90),
        "seconds_p50": _pct(secs, 50),
        "seconds_p90": _pct(secs, 90),
    }
    print(
        f"{label:24s} found {len(hit)}/{len(runs)}  steps p50 {row['steps_p50']:6.1f} p90 {row['steps_p90']:6.1f}"
        f"  seconds p50 {row['seconds_p50']:6.1f} p90 {row['seconds_p90']:6.1f}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per cost and per job size (default 3)")
    ap.add_argument(
        "--costs", default="0.02,0.05,0.20", help="fault costs as shares of the step (default 2%%, 5%%, 20%%)"
    )
    ap.add_argument("--steps-per-s", type=float, default=10.0, help="simulated jobs' speed (default 10 steps/s)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="how long a run may take to find it (default 60)")
    ap.add_argument("--real", action="store_true", help="also real torch DDP jobs of 2, 3 and 4 ranks")
    ap.add_argument("--json", action="store_true", help="one JSON line with every row")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-ttd-"))
    rows = []
    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:8]
        settings = Settings(
            bootstrap_servers=broker.bootstrap_servers,
            topic_prefix=f"ttd{tag}",
            processor_id=f"proc-{tag}",
            sink_group=f"sink-{tag}",
            partitions=3,
            db=tmp / "findings.duckdb",
            step_timeout_s=5.0,
            window_timeout_s=10.0,
        )
        ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
        pipeline = Pipeline(settings, tmp)
        try:
            pipeline.start("sink", 60)
            pipeline.start("processor", 60)
            for cost in (float(c) for c in args.costs.split(",")):
                runs = [
                    simulated_run(settings, cost, 100 + i, args.steps_per_s, args.timeout_s) for i in range(args.runs)
                ]
                rows.append(summarise(f"simulated, cost {cost:.0%}", runs))
            if args.real:
                for world in (2, 3, 4):
                    runs = [real_run(settings, world, tmp, 4 * args.timeout_s) for _ in range(args.runs)]
                    rows.append(summarise(f"real, {world} ranks", runs))
        finally:
            pipeline.stop()
    if args.json:
        print(json.dumps(rows))
    med = [r["steps_p50"] for r in rows if r["found"]]
    if med:
        print(f"median of the p50s: {statistics.median(med):.1f} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
