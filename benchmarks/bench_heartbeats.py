"""Benchmark: a simulated job's heartbeats through the real processor on the embedded broker.

    python benchmarks/bench_heartbeats.py [--workers 4096] [--steps 20] [--repeats 3] [--partitions 6] [--json]

One processor (``lockstep processor``, a child process, as in production, every stage running) reads ``--steps``
steps of a ``--workers`` job's heartbeats, first as agents and host relays send them since issue 13 (one
``HeartbeatBatch`` per host and shard, key ``job/shard``: the heartbeat stage decodes and aggregates them in
columns and sends one ``StepPartial`` per shard and step to the detector), then as agents sent them before
(one ``StepHeartbeat`` per worker and step, key ``job``): the baseline, measured in the same run, alternating
(ABAB...) so that this shared machine's drift falls on both.  Every record is produced before it is timed; what
is measured is the processor process's CPU seconds (user + system, all its threads: faust, the Kafka client,
the heartbeat stage, the detector) from the first record until every heartbeat was aggregated and every partial
the stage sent was consumed by the detect stage (polled on its /metrics four times a second: a scrape costs the
processor CPU too), less what the idle processor spends over as long.

``--agent`` adds what one agent sends alone (one ``HeartbeatBatch`` of its own heartbeat per flush), ``--relay``
what a host relay sends (``lockstep.producers.agent.relay``: each of the host's ``--ranks-per-host`` agents hands
over its flush of ``--steps-per-flush`` steps, the relay merges them with :func:`merge_batches`, exactly as it does
live, into one ``HeartbeatBatch`` per host, shard and flush); both measured the same way, in the same run.

Figure: heartbeats per processor CPU-second (one worker's heartbeat of one step, whatever record carries it).
Target (issue 13): >= 50,000 heartbeats per second per processor core.
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
from lockstep.kafka import Publisher, ensure_topics, heartbeat_key, producer_config
from lockstep.metrics import value
from lockstep.producers.agent.relay import merge_batches
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import SHARD_WORKERS, batch_heartbeats, encode
from lockstep.streams.app import changelog_topics

TARGET = 50_000


def relay_records(beats: list, job: str, topics) -> list[tuple[str, bytes, bytes]]:
    """What the host relays send for one flush of these heartbeats: each agent's own flush (``batch_heartbeats`` of
    its heartbeats), merged per host by the relay's own code."""
    by_host: dict[str, dict[int, list]] = {}
    for hb in beats:
        by_host.setdefault(hb.host, {}).setdefault(hb.worker, []).append(hb)
    return [
        (topics.heartbeats, heartbeat_key(job, b.shard), encode(b))
        for ranks in by_host.values()
        for b in merge_batches(batch for mine in ranks.values() for _, batch in batch_heartbeats(mine, SHARD_WORKERS))
    ]


def payloads(
    workers: int, steps: int, job: str, kind: str, topics, ranks_per_host: int = 8, steps_per_flush: int = 1
) -> list[tuple[str, bytes, bytes]]:
    """``steps`` steps of a ``workers`` job's heartbeats (one slow GPU), as (topic, key, value)."""
    fleet = FleetSimulator(
        Scenario(
            job=job,
            topology=Topology(workers=workers, gpus_per_host=ranks_per_host),
            faults=(Fault(type="gpu_throttle_thermal", workers=(13,), severity=0.3),),
        )
    )
    out = []
    now = time.time()
    flush: list = []  # the relay's heartbeats of the flush being gathered
    for step in range(steps):
        sim = fleet.step(step, readings=False)
        if kind == "relay":
            flush += fleet.heartbeats(sim, now + step)
            if (step + 1) % steps_per_flush == 0 or step == steps - 1:
                out += relay_records(flush, job, topics)
                flush = []
        elif kind == "agent":  # each worker's own agent, one heartbeat per flush: one HeartbeatBatch of one row
            out += [
                (topics.heartbeats, heartbeat_key(job, shard), encode(b))
                for hb in fleet.heartbeats(sim, now + step)
                for shard, b in batch_heartbeats([hb], SHARD_WORKERS)
            ]
        elif kind == "batch":
            out += [
                (topics.heartbeats, heartbeat_key(job, b.shard), encode(b))
                for b in fleet.heartbeat_batches(sim, now + step)
            ]
        else:
            out += [(topics.heartbeats, job.encode(), encode(hb)) for hb in fleet.heartbeats(sim, now + step)]
    return out


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def run(args) -> dict:
    tag = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix="lockstep-bench-heartbeats-"))
    settings = Settings(
        bootstrap_servers=args.bootstrap_servers,
        topic_prefix=f"bh{tag}",
        processor_id=f"bh-{tag}",
        sink_group=f"bh-sink-{tag}",
        partitions=args.partitions,
        db=log_dir / "findings.duckdb",
    )
    figures: dict[str, list[dict]] = {
        k: [] for k in ("batch", "records", *(("agent",) if args.agent else ()), *(("relay",) if args.relay else ()))
    }
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(kafka_or_embedded(settings))
        topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
        jobs = {
            (kind, r): payloads(
                args.workers, args.steps, f"bench-{kind}-{r}", kind, topics, args.ranks_per_host, args.steps_per_flush
            )
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
        beats = 0.0
        for r in range(args.repeats):
            kinds = list(figures)
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # each kind first in turn
                records = jobs[(kind, r)]
                c0, t0 = cpu_s(proc), time.monotonic()
                for topic, key, v in records:
                    publisher.send_raw(topic, key, v)
                publisher.flush(60)
                beats += args.workers * args.steps

                def done(beats: float = beats) -> bool:
                    m = pipeline.metrics("processor")
                    return value(m, "lockstep_heartbeats_total") >= beats and value(
                        m, "lockstep_records_in_total", topic=topics.partials
                    ) >= value(m, "lockstep_records_out_total", topic=topics.partials)

                while not done():
                    if time.monotonic() - t0 > args.timeout_s:
                        raise SystemExit(f"{kind} {r} not consumed after {args.timeout_s:.0f} s; logs in {log_dir}")
                    time.sleep(0.25)  # every scrape of /metrics costs the processor CPU: few of them
                wall = time.monotonic() - t0
                cpu = cpu_s(proc) - c0 - idle * wall
                figures[kind].append(
                    {"records": len(records), "bytes": sum(len(v) for _, _, v in records), "cpu_s": cpu, "wall_s": wall}
                )
        m = pipeline.metrics("processor")
        dead = sum(v for (name, _), v in m.items() if name == "lockstep_dead_letters_total")
        partials = value(m, "lockstep_records_out_total", topic=topics.partials)
    heartbeats = args.workers * args.steps
    out = {
        "workers": args.workers,
        "steps": args.steps,
        "repeats": args.repeats,
        "partitions": args.partitions,
        "ranks_per_host": args.ranks_per_host,
        "steps_per_flush": args.steps_per_flush,
        "idle_cpu_per_s": idle,
        "dead_letters": dead,
        "partials_sent": partials,
    }
    for kind, runs in figures.items():
        cpu = statistics.median(x["cpu_s"] for x in runs)
        out[kind] = {
            "records": runs[0]["records"],
            "bytes": runs[0]["bytes"],
            "cpu_s": cpu,
            "cpu_s_all": [round(x["cpu_s"], 3) for x in runs],
            "wall_s": statistics.median(x["wall_s"] for x in runs),
            "heartbeats_per_cpu_s": heartbeats / cpu,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="runs per kind, alternating")
    p.add_argument(
        "--agent",
        action="store_true",
        help="also one HeartbeatBatch of one heartbeat per worker and step (an agent's own flush)",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="also what host relays send: one HeartbeatBatch per host, shard and flush (--ranks-per-host agents)",
    )
    p.add_argument("--ranks-per-host", type=int, default=8, help="ranks (GPUs) per host (default 8)")
    p.add_argument(
        "--steps-per-flush",
        type=int,
        default=1,
        help="steps in one flush of the agents (default 1: steps as long as the flush interval, the fewest rows)",
    )
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--idle-s", type=float, default=5.0, help="how long the idle processor's CPU is measured")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--bootstrap-servers", default=None, help="a Kafka to use (default: start the embedded broker)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    b, rec = out["batch"], out["records"]
    print(
        f"{out['steps']} steps of a {out['workers']:,}-worker job's heartbeats through one processor on the embedded broker "
        f"({out['partitions']} partitions); processor CPU (idle {out['idle_cpu_per_s']:.3f} CPU-s/s subtracted), median of "
        f"{out['repeats']} runs each, alternating"
    )
    rows = [
        ("HeartbeatBatch (one per host and shard, key job/shard)", b),
        ("StepHeartbeat (one per worker and step, before)", rec),
    ]
    if "agent" in out:
        rows.append(("HeartbeatBatch of one heartbeat (an agent's own flush)", out["agent"]))
    if "relay" in out:
        rows.append(
            (
                f"HeartbeatBatch of a host relay ({out['ranks_per_host']} ranks x {out['steps_per_flush']} step(s))",
                out["relay"],
            )
        )
    for name, x in rows:
        print(
            f"  {name:55s} {x['records']:7,} records {x['bytes'] / x['records']:7,.0f} B each: {x['cpu_s']:6.2f} CPU-s"
            f" ({', '.join(map(str, x['cpu_s_all']))}), {x['heartbeats_per_cpu_s']:9,.0f} heartbeats/CPU-s"
        )
    ok = b["heartbeats_per_cpu_s"] >= TARGET
    print(
        f"  heartbeats per processor core: {b['heartbeats_per_cpu_s']:,.0f}/s, {b['heartbeats_per_cpu_s'] / rec['heartbeats_per_cpu_s']:.1f}x the"
        f" StepHeartbeat path (target >= {TARGET:,}/s: {'met' if ok else 'NOT met'}); partials sent {out['partials_sent']:.0f};"
        f" dead letters: {out['dead_letters']:.0f}"
    )
    if "relay" in out:
        r = out["relay"]["heartbeats_per_cpu_s"]
        print(
            f"  as host relays send them: {r:,.0f}/s"
            + (f", {r / out['agent']['heartbeats_per_cpu_s']:.1f}x what agents send alone" if "agent" in out else "")
            + f" (target >= {TARGET:,}/s: {'met' if r >= TARGET else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
