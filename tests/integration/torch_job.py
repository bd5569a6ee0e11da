"""A small real DDP job (CPU, gloo) with torch.profiler writing one Chrome trace per rank.

    python torch_job.py OUT_DIR --ranks 4 --slow-rank 2 --slow-ms 25 --steps 6

One rank runs ``slow_function`` (a named region that sleeps) every step; the
others wait for it in the gradient all-reduce.  Used by the integration test of
``lockstep diagnose``; also handy to produce traces by hand.
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def slow_function(ms: float) -> None:
    time.sleep(ms / 1000.0)


def rank_main(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=args.steps)

    def write(prof) -> None:
        prof.export_chrome_trace(os.path.join(args.out, f"rank{rank}.json"))

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule, on_trace_ready=write
    ) as prof:
        for _ in range(args.steps + 2):
            with torch.profiler.record_function("data.load"):
                xb = x + 0
            if rank == args.slow_rank:
                with torch.profiler.record_function("slow_function"):
                    slow_function(args.slow_ms)
            loss = ((model(xb) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--slow-rank", type=int, default=2)
    ap.add_argument("--slow-ms", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)  # the profiler writes nothing, and says so only in its log, into no folder
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
