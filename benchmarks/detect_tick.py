"""The detect stage's timer at many jobs: one tick's cost at 100,000 jobs against 100 jobs, in the same process.

    .venv/bin/python benchmarks/detect_tick.py [--jobs 100 100000] [--ticks 20] [--json]

Each job sends its heartbeats of three steps (as the heartbeat stage's partials, one shard, through the stage's
``on_records``: decode, detector, series), a second apart; then the stage's timer (``on_timer``, what the processor
runs every 0.5 s: hang and lateness ticks, endings, idle jobs, the series, the gauges) runs ``--ticks`` times at
0.5 s intervals with no new heartbeat, the first of them after every job's steps closed (and the step-time series'
last steps, 10 s later: until then each job has a step of the series due).  Printed per job count: the
median tick, the jobs its checks visited per tick, and the process's memory growth per job (``ru_maxrss`` before and
after the feed; a rough figure).  Before issue 22's fix a tick visited every job: 16.1 s a tick at 100,000 jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time

from lockstep.kafka import Topics
from lockstep.metrics import Metrics
from lockstep.schemas.records import StepPartial, encode
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput
from lockstep.streams.stages.base import Partition, RecordIn
from lockstep.streams.stages.detect import DetectStage

T0 = 1.8e9
TOPICS = Topics.named("bench")


def partial(job: str, step: int) -> bytes:
    sent = T0 + step
    return encode(
        StepPartial(
            job=job,
            step=step,
            shard=0,
            partition=0,
            workers=8,
            slowest_s=0.2,
            median_s=0.19,
            clock_worker=0,
            clock_sent_at=sent,
            newest_sent_at=sent,
            highest=step,
            members=8,
            world_size=8,
        )
    )


def measure(jobs: int, ticks: int) -> dict[str, float]:
    out = MemoryOutput(1)
    clock = [T0]
    stage = DetectStage(TOPICS, out, {}, Policy(), Metrics(), clock=lambda: clock[0])
    source = Partition(TOPICS.partials, 0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    async def go() -> list[tuple[float, int]]:
        offset = 0
        for step in range(3):
            clock[0] = T0 + step + 0.05
            batch = []
            for j in range(jobs):
                batch.append(RecordIn(source, offset, None, partial(f"job{j}", step)))
                offset += 1
            for i in range(0, len(batch), 1000):
                await stage.on_records(batch[i : i + 1000])
        out.sent.clear()
        out.acknowledged.clear()
        now = T0 + 3.0
        await stage.on_timer(now)  # the timer's share of what the heartbeats changed: each changed job once
        now += stage.series.max_age_s
        await stage.on_timer(now)  # the series' last open steps closed and published
        rows = []
        for _ in range(ticks):
            now += 0.5
            before = stage.detector.visited
            t = time.perf_counter()
            await stage.on_timer(now)
            rows.append((time.perf_counter() - t, stage.detector.visited - before))
        return rows

    rows = asyncio.run(go())
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "jobs": jobs,
        "tick_ms": statistics.median(r[0] for r in rows) * 1e3,
        "visited_per_tick": statistics.median(r[1] for r in rows),
        "kib_per_job": max(0, rss1 - rss0) / jobs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, nargs="+", default=[100, 100_000])
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = [measure(n, a.ticks) for n in sorted(a.jobs)]
    if a.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        print(
            f"{r['jobs']:>8} jobs: tick {r['tick_ms']:8.3f} ms (median of {a.ticks}), "
            f"{r['visited_per_tick']:.0f} jobs visited a tick, ~{r['kib_per_job']:.1f} KiB a job"
        )
    if len(results) > 1:
        print(
            f"tick at {results[-1]['jobs']} jobs / at {results[0]['jobs']} jobs: {results[-1]['tick_ms'] / results[0]['tick_ms']:.1f}x"
        )


if __name__ == "__main__":
    main()
