"""What the hang answer costs while the job runs (issue 26): nothing is sampled until a hang trigger, so the cost is
the trackers' per-call work, measured here against the same calls unwrapped, alternately (CPU PyTorch; medians).

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


def abab(a, b, number: int, rounds: int = 9) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` per call, measured alternately (the machine's load changes between blocks)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(timeit.timeit(a, number=number) / number * 1e9)
        tb.append(timeit.timeit(b, number=number) / number * 1e9)
    return statistics.median(ta), statistics.median(tb)


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
    noop_ns, wrapped_noop_ns = abab(lambda: noop(t), lambda: wrapped_noop(t), 100_000)
    counted = tracker.wrap("all_reduce", plain)
    plain_ns, wrapped_ns = abab(lambda: plain(t), lambda: counted(t), 5_000)

    def region():
        with torch.profiler.record_function("r"):
            pass

    rf = torch.autograd.profiler.record_function
    enter, exit_ = rf.__enter__, rf.__exit__
    RegionTracker(threading.get_ident()).install()
    tracked_enter, tracked_exit = rf.__enter__, rf.__exit__

    def untracked():
        rf.__enter__, rf.__exit__ = enter, exit_

    def tracked():
        rf.__enter__, rf.__exit__ = tracked_enter, tracked_exit

    ta, tb = [], []
    for _ in range(9):
        untracked()
        ta.append(per_call_ns(region, 5_000))
        tracked()
        tb.append(per_call_ns(region, 5_000))
    region_ns, region_tracked_ns = statistics.median(ta), statistics.median(tb)

    responder = HangResponder(WorkerMeta(rank=0, host="h"), Redaction.parse("paths=strip,stacks=keep"))
    trig = ProfileTrigger(job="j", window="w", start_step=1, steps=1, expected_workers=1, kind="hang")
    t0 = time.perf_counter()
    reps = [responder.report(trig, 1) for _ in range(200)]
    answer_us = (time.perf_counter() - t0) / 200 * 1e6
    print(f"collective counter around a no-op: {noop_ns:8.0f} -> {wrapped_noop_ns:.0f} ns per call")
    print(f"gloo all_reduce (1 rank, 1 float):  {plain_ns:8.0f} ns unwrapped, {wrapped_ns:.0f} ns counted")
    print(f"record_function enter+exit:         {region_ns:8.0f} ns, {region_tracked_ns:.0f} ns tracked")
    print(f"one answer (stack, encoded):        {answer_us:8.0f} us, {len(encode(reps[0]))} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
