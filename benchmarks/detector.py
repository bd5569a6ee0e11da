"""Detector throughput: heartbeats per second one processor core judges (the pure core only).

    .venv/bin/python benchmarks/detector.py [--workers 10000] [--steps 60] [--repeat 5] [--json]

Feeds one job's heartbeats (every worker, every step, healthy then 30% slower) through
SlowdownDetector.observe, once per rule (``cusum``, the default, and ``median``, the rule before
issue 15), the rules taking turns in the same process; prints each rule's median rate over the
repeats and the ratio.  A second case, many small jobs (8 workers each), weighs the per-step work
(the rule runs once per complete step) against the per-heartbeat work.  The faust shell around it
(decode, Kafka) costs more per record than the detector; this is the detector's share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from lockstep.app.detector_eval import MEDIAN_RULE
from lockstep.schemas.records import StepHeartbeat
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import Policy

RULES = ("cusum", "median")


def heartbeats(jobs: int, workers: int, steps: int) -> list[StepHeartbeat]:
    rng = np.random.default_rng(0)
    times = 0.5 * rng.normal(1.0, 0.01, (jobs, steps, workers))
    times[:, steps // 2 :] *= 1.3
    return [
        StepHeartbeat(
            job=f"bench{j}",
            worker=w,
            step=s,
            step_time_s=float(times[j, s, w]),
            host=f"h{w // 8}",
            sent_at=1000.0 + 0.5 * s,
            world_size=workers,
        )
        for s in range(steps)
        for j in range(jobs)
        for w in range(workers)
    ]


def run(rule: str, hbs: list[StepHeartbeat]) -> tuple[float, int]:
    # each rule as it ships (the median rule with its 15% threshold); no fleet limit: a refused window would
    # measure the limit's check, not the rules
    kw = MEDIAN_RULE if rule == "median" else {}
    policy = Policy(detector=dataclasses.replace(Policy().detector, max_windows_fleet=1_000_000, **kw))
    det = SlowdownDetector(policy)
    t0 = time.perf_counter()
    triggers = 0
    for h in hbs:
        triggers += len(det.observe(h, now=h.sent_at + 0.05))
    return len(hbs) / (time.perf_counter() - t0), triggers


def measure(hbs: list[StepHeartbeat], repeat: int) -> dict:
    rates: dict[str, list[float]] = {r: [] for r in RULES}
    triggers: dict[str, int] = {}
    for _ in range(repeat):
        for rule in RULES:  # taking turns: both see the same machine load
            rate, triggers[rule] = run(rule, hbs)
            rates[rule].append(rate)
    med = {r: statistics.median(v) for r, v in rates.items()}
    return {"rates": rates, "median": med, "triggers": triggers, "ratio": med["cusum"] / med["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    small_jobs = max(1, a.workers // 8)
    cases = {
        f"1 job x {a.workers} workers x {a.steps} steps": heartbeats(1, a.workers, a.steps),
        f"{small_jobs} jobs x 8 workers x {a.steps} steps": heartbeats(small_jobs, 8, a.steps),
    }
    out = {name: measure(hbs, a.repeat) for name, hbs in cases.items()}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for name, m in out.items():
        print(f"detector, {name}, median of {a.repeat} runs on one core:")
        for rule in RULES:
            r = m["rates"][rule]
            print(
                f"  {rule:6s}  {m['median'][rule]:>11,.0f} heartbeats/s  ({min(r):,.0f}..{max(r):,.0f}); triggers per run: {m['triggers'][rule]}"
            )
        print(f"  cusum / median: {m['ratio']:.2f}")


if __name__ == "__main__":
    main()
