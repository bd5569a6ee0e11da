"""What the hang answer costs while the job runs (issue 26): nothing is sampled until a hang trigger, so the cost is
the trackers' per-call work, measured here against the same calls unwrapped (CPU PyTorch; medians of 7 runs).

    python benchmarks/bench_hang.py

- a collective: a 1-rank gloo ``all_reduce`` of one float, unwrapped and through the agent's counter
  (:class:`~lockstep.producers.agent.hang.CollectiveTracker`), and the counter's wrapper around a no-op alone;
- a ``record_function`` region entered and left, before and after the region tracker's patch;
- the answer itself (stack, region, collective, encoded), taken once per hang trigger, for scale.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
import timeit

import torch
import torch.distributed as dist

from lockstep.broker import free_port
from lockstep.producers.agent.hang import CollectiveTracker, HangResponder, RegionTracker
from lockstep.producers.agent.redact import Redaction
from lockstep.schemas.records import ProfileTrigger, WorkerMeta, encode


def per_call_ns(fn, number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=7)) / number * 1e9


def main() -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="env://")
    t = torch.zeros(1)
    plain = dist.all_reduce

    def noop(*a, **kw):
        return None

    tracker = CollectiveTracker()
    wrapped_noop = tracker.wrap("all_reduce", noop)
    n = 200_000
    noop_ns, wrapped_noop_ns = per_call_ns(lambda: noop(t), n), per_call_ns(lambda: wrapped_noop(t), n)
    plain_ns = per_call_ns(lambda: plain(t), 20_000)
    tracker.install()
    wrapped_ns = per_call_ns(lambda: dist.all_reduce(t), 20_000)

    def region():
        with torch.profiler.record_function("r"):
            pass

    region_ns = per_call_ns(region, 50_000)
    RegionTracker(threading.get_ident()).install()
    region_tracked_ns = per_call_ns(region, 50_000)

    responder = HangResponder(WorkerMeta(rank=0, host="h"), Redaction.parse("paths=strip,stacks=keep"))
    trig = ProfileTrigger(job="j", window="w", start_step=1, steps=1, expected_workers=1, kind="hang")
    t0 = time.perf_counter()
    reps = [responder.report(trig, 1) for _ in range(200)]
    answer_us = (time.perf_counter() - t0) / 200 * 1e6
    print(
        f"counter wrapper around a no-op:      +{wrapped_noop_ns - noop_ns:6.0f} ns per call ({noop_ns:.0f} -> {wrapped_noop_ns:.0f})"
    )
    print(f"gloo all_reduce (1 rank, 1 float):  {plain_ns:8.0f} ns unwrapped, {wrapped_ns:.0f} ns counted")
    print(f"record_function enter+exit:         {region_ns:8.0f} ns, {region_tracked_ns:.0f} ns tracked")
    print(f"one answer (stack, encoded):        {answer_us:8.0f} us, {len(encode(reps[0]))} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
