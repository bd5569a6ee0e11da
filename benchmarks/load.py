"""Sustained load: a simulated job through the whole pipeline (embedded broker, processor, sink) for minutes.

    .venv/bin/python benchmarks/load.py [--workers 1024] [--minutes 10] [--steps-per-s 1] [--processors 1] [--kill N] [--json]

Prints what was published, the processor's lag (records behind, from the fleet's delivery reports and the
processor's /metrics; seconds behind, from the records' Kafka timestamps), the step latency (last feature
batch of a step to its step report) and the end-to-end latency (last feature batch of a window to its
findings in DuckDB) as p50/p99/max, the time to drain after the fleet stopped, and the CPU seconds of the
processors and the sink (and the load average, since the machine may be shared).  ``--processors N``: N processors
in one consumer group share the job's partitions; ``--kill K``: the last one is SIGKILLed halfway through window K.  See lockstep/load.py for the method; RELIABILITY.md for the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from pathlib import Path

from lockstep.app.load import run_load
from lockstep.config import Settings


def short(topic: str) -> str:
    return topic.rsplit(".", 1)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--steps-per-s", type=float, default=1.0)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--processors", type=int, default=1, help="processors sharing the partitions (one consumer group)")
    ap.add_argument(
        "--kill",
        type=int,
        default=None,
        metavar="K",
        help="SIGKILL the last processor halfway through window K (0: the first)",
    )
    ap.add_argument(
        "--stop-after-windows",
        type=int,
        default=0,
        metavar="N",
        help="stop the fleet a few steps after N windows were delivered, or at --minutes (default 0: at --minutes)",
    )
    ap.add_argument("--no-windows", action="store_true", help="heartbeats only: the always-on signal's cost")
    ap.add_argument(
        "--features",
        choices=("window", "step"),
        default="window",
        help="what the fleet sends: a WindowFeatures per worker and window (default, as agents do) or a FeatureBatch per worker and step",
    )
    ap.add_argument("--bootstrap-servers", default=None, help="a Kafka to use (default: start the embedded broker)")
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the processes' logs and the DuckDB file go (default: a new temporary folder)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tag = uuid.uuid4().hex[:8]
    log_dir = args.log_dir or Path(f"/tmp/lockstep-load-{tag}")
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        bootstrap_servers=args.bootstrap_servers,
        topic_prefix=f"load{tag}",
        processor_id=f"load-{tag}",
        sink_group=f"load-sink-{tag}",
        partitions=args.partitions,
        db=log_dir / "findings.duckdb",
    )
    res = run_load(
        settings,
        workers=args.workers,
        duration_s=args.minutes * 60,
        steps_per_s=args.steps_per_s,
        log_dir=log_dir,
        windows=not args.no_windows,
        features=args.features,
        processors=args.processors,
        kill=args.kill,
        stop_after_windows=args.stop_after_windows,
    )
    summary = res.summary()
    summary["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"{res.workers} workers, {res.steps} steps in {res.seconds:.0f} s ({res.steps_per_s:g} steps/s asked), "
        f"{len(res.windows)} windows delivered, {len(res.stored)} stored with findings; logs in {res.log_dir}"
    )
    print(
        f"processors: {res.processors}"
        + (f", killed: {res.killed} (name: the fleet's step then)" if res.killed else "")
    )
    print("published: " + ", ".join(f"{short(t)} {n:,}" for t, n in sorted(res.published.items())))
    print(f"{'figure':38s} {'n':>6s} {'p50':>9s} {'p99':>9s} {'max':>9s}")
    rows = [(f"lag, records, {short(t)}", summary["lag_records"][t]) for t in sorted(summary["lag_records"])]
    rows += [(f"lag, seconds, {short(t)}", summary["lag_seconds"][t]) for t in sorted(summary["lag_seconds"])]
    rows += [
        ("step latency, s", summary["step_latency_s"]),
        ("end-to-end latency (window -> DuckDB), s", summary["window_latency_s"]),
    ]
    for name, q in rows:
        if q.get("n"):
            print(f"{name:38s} {q['n']:>6d} {q['p50']:>9.2f} {q['p99']:>9.2f} {q['max']:>9.2f}")
    print(f"records never consumed: {', '.join(f'{short(t)} {n:g}' for t, n in sorted(res.unconsumed.items()))}")
    print(
        f"drain after the fleet stopped: {res.drain_s:.1f} s; CPU seconds: "
        f"{', '.join(f'{k} {v:.0f}' for k, v in summary['cpu_s'].items())}"
        f" ({', '.join(f'{k} {v / res.seconds:.2f}' for k, v in res.cpu_s.items())} of a core over the fleet's run); dead letters: {res.dead_letters:.0f}"
    )
    print(
        f"findings in DuckDB: {res.finding_rows} rows, {len({f for v in res.findings.values() for f in v})} distinct ids; load average (1, 5, 15 min) at the end: "
        + ", ".join(f"{x:.2f}" for x in summary["load_average_after"])
    )


if __name__ == "__main__":
    main()
