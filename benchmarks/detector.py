"""Detector throughput: heartbeats per second one processor core judges (the pure core only).

    .venv/bin/python benchmarks/detector.py [--workers 10000] [--steps 60] [--repeat 5]

Feeds one job's heartbeats (every worker, every step, healthy then 30% slower) through
SlowdownDetector.observe and prints the median rate over the repeats.  The faust shell
around it (decode, Kafka) costs more per record than the detector; this is the detector's share.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from lockstep.schemas.records import StepHeartbeat
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import Policy


def run(workers: int, steps: int) -> tuple[float, int]:
    det = SlowdownDetector(Policy())
    rng = np.random.default_rng(0)
    times = 0.5 * rng.normal(1.0, 0.01, (steps, workers))
    times[steps // 2 :] *= 1.3
    hbs = [
        StepHeartbeat(job="bench", worker=w, step=s, step_time_s=float(times[s, w]), host=f"h{w // 8}", sent_at=1000.0 + 0.5 * s)
        for s in range(steps)
        for w in range(workers)
    ]
    t0 = time.perf_counter()
    triggers = 0
    for h in hbs:
        triggers += len(det.observe(h, now=h.sent_at + 0.05))
    return len(hbs) / (time.perf_counter() - t0), triggers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rates, triggers = zip(*(run(a.workers, a.steps) for _ in range(a.repeat)))
    print(f"detector: {a.workers} workers x {a.steps} steps, median {statistics.median(rates):,.0f} heartbeats/s on one core "
          f"({min(rates):,.0f}..{max(rates):,.0f} over {a.repeat} runs); triggers per run: {triggers[0]}")


if __name__ == "__main__":
    main()
