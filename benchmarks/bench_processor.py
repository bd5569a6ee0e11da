"""Benchmark: a simulated job's feature records through the real processor on the embedded broker.

    python benchmarks/bench_processor.py features [--workers 4096] [--steps 8] [--repeats 3] [--partitions 6]

One processor (``lockstep processor``, a child process, as in production) reads one profiling window of a
``--workers`` job, first as the agents send it (one ``WindowFeatures`` per worker, key ``job:window:shard``:
the shard stage, then the step stage from the shards' ``StepSlice``s), then as agents sent it before issue 13
(one ``FeatureBatch`` per worker and step, key ``job:step``): the baseline, measured in the same run, alternating
(ABAB...) so that this shared machine's drift falls on both.  Every record is produced before it is timed;
what is measured is the processor process's CPU seconds (user + system, all its threads: faust, the Kafka
client, the stages, the diagnosis) from the first record to the window's close (``windows_closed_total``),
less what the idle processor spends over as long (its timers).

Figures: records per processor CPU-second, and worker-steps per CPU-second (one worker's features of one step:
what one ``FeatureBatch`` carries; a ``WindowFeatures`` carries ``--steps`` of them).  Target (issue 13):
>= 10,000 feature batches per second per processor core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from lockstep.app.runtime import Pipeline
from lockstep.broker import kafka_or_embedded
from lockstep.config import Settings
from lockstep.kafka import Publisher, ensure_topics, features_key, producer_config, window_features_key
from lockstep.metrics import value
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import encode
from lockstep.streams.app import changelog_topics


def payloads(workers: int, steps: int, job: str, kind: str, topics) -> list[tuple[str, bytes, bytes]]:
    """One window of a ``workers`` job with a throttled GPU, as (topic, key, value)."""
    fleet = FleetSimulator(
        Scenario(
            job=job,
            topology=Topology(workers=workers, gpus_per_host=8),
            faults=(Fault(type="gpu_throttle_thermal", workers=(13,), severity=0.3),),
        )
    )
    w = Window(60, steps)
    trig = fleet.trigger(w)
    sims = [fleet.step(s) for s in w.range]
    if kind == "window":
        return [
            (topics.windowfeatures, window_features_key(job, r.window, r.shard), encode(r))
            for r in fleet.window_features(sims, trig, sent_at=time.time())
        ]
    return [
        (topics.features, features_key(job, sim.step), encode(b))
        for sim in sims
        for b in fleet.feature_batches(sim, trig, sent_at=time.time())
    ]


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def features(args) -> dict:
    tag = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix="lockstep-bench-processor-"))
    settings = Settings(
        bootstrap_servers=args.bootstrap_servers,
        topic_prefix=f"bp{tag}",
        processor_id=f"bp-{tag}",
        sink_group=f"bp-sink-{tag}",
        partitions=args.partitions,
        db=log_dir / "findings.duckdb",
    )
    figures: dict[str, list[dict]] = {"window": [], "step": []}
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(kafka_or_embedded(settings))
        topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
        jobs = {
            (kind, r): payloads(args.workers, args.steps, f"bench-{kind}-{r}", kind, topics)
            for r in range(args.repeats)
            for kind in figures
        }
        pipeline = Pipeline(s, log_dir)
        stack.callback(pipeline.stop)
        proc = psutil.Process(pipeline.start("processor").proc.pid)
        publisher = Publisher(producer_config(s))
        time.sleep(3.0)  # the group settles
        c0, t0 = cpu_s(proc), time.monotonic()
        time.sleep(args.idle_s)
        idle = (cpu_s(proc) - c0) / (time.monotonic() - t0)  # CPU-seconds per second, with nothing to read
        closed = 0.0
        for r in range(args.repeats):
            for kind in ("window", "step") if r % 2 == 0 else ("step", "window"):
                records = jobs[(kind, r)]
                c0, t0 = cpu_s(proc), time.monotonic()
                for topic, key, v in records:
                    publisher.send_raw(topic, key, v)
                publisher.flush(60)
                while (
                    value(pipeline.metrics("processor"), "lockstep_windows_closed_total", reason="complete") <= closed
                ):
                    if time.monotonic() - t0 > args.timeout_s:
                        raise SystemExit(
                            f"window {kind} {r} not closed after {args.timeout_s:.0f} s; logs in {log_dir}"
                        )
                    time.sleep(0.05)
                closed += 1
                wall = time.monotonic() - t0
                cpu = cpu_s(proc) - c0 - idle * wall
                figures[kind].append(
                    {"records": len(records), "bytes": sum(len(v) for _, _, v in records), "cpu_s": cpu, "wall_s": wall}
                )
        m = pipeline.metrics("processor")
        dead = sum(v for (name, _), v in m.items() if name == "lockstep_dead_letters_total")
    worker_steps = args.workers * args.steps
    out = {
        "workers": args.workers,
        "steps": args.steps,
        "repeats": args.repeats,
        "idle_cpu_per_s": idle,
        "dead_letters": dead,
    }
    for kind, runs in figures.items():
        cpu = statistics.median(x["cpu_s"] for x in runs)
        out[kind] = {
            "records": runs[0]["records"],
            "bytes": runs[0]["bytes"],
            "cpu_s": cpu,
            "cpu_s_all": [round(x["cpu_s"], 3) for x in runs],
            "wall_s": statistics.median(x["wall_s"] for x in runs),
            "records_per_cpu_s": runs[0]["records"] / cpu,
            "worker_steps_per_cpu_s": worker_steps / cpu,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("features", help="feature records of one window through the processor")
    f.add_argument("--workers", type=int, default=4096)
    f.add_argument("--steps", type=int, default=8)
    f.add_argument("--repeats", type=int, default=3, help="windows per kind, alternating")
    f.add_argument("--partitions", type=int, default=6)
    f.add_argument("--idle-s", type=float, default=5.0, help="how long the idle processor's CPU is measured")
    f.add_argument("--timeout-s", type=float, default=300.0)
    f.add_argument("--bootstrap-servers", default=None, help="a Kafka to use (default: start the embedded broker)")
    f.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = features(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    w, st = out["window"], out["step"]
    print(
        f"one window of a {out['workers']:,}-worker job ({out['steps']} steps) through one processor on the embedded broker; "
        f"processor CPU (idle {out['idle_cpu_per_s']:.3f} CPU-s/s subtracted), median of {out['repeats']} windows each, alternating"
    )
    for name, x in (
        ("WindowFeatures (one per worker and window)", w),
        ("FeatureBatch (one per worker and step, before)", st),
    ):
        print(
            f"  {name:48s} {x['records']:7,} records {x['bytes'] / x['records'] / 1e3:5.1f} KB each: {x['cpu_s']:6.2f} CPU-s"
            f" ({', '.join(map(str, x['cpu_s_all']))}), {x['records_per_cpu_s']:8,.0f} records/CPU-s, {x['worker_steps_per_cpu_s']:8,.0f} worker-steps/CPU-s"
        )
    ok = w["worker_steps_per_cpu_s"] >= 10_000
    print(
        f"  feature batches (worker-steps) per processor core: {w['worker_steps_per_cpu_s']:,.0f}/s, {w['worker_steps_per_cpu_s'] / st['worker_steps_per_cpu_s']:.1f}x"
        f" the FeatureBatch path (target >= 10,000/s: {'met' if ok else 'NOT met'}); dead letters: {out['dead_letters']:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
