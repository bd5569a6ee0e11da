"""One rank of a small DDP job (CPU, gloo) with a real fault on one rank, profiled the way the agent profiles.

    python fault_rank.py --rank R --world N --master ADDR:PORT --out DIR --case CASE --culprit C [--nic IF] [--cpus 1]

Each step: a batch from a ``torch.utils.data.DataLoader``, ``forward`` (a record_function
region), ``backward`` (DDP's gradient all-reduce runs on the reducer thread meanwhile), the
optimizer.  After two unprofiled steps, ``--steps`` steps are profiled with the agent's own
``TorchWindow`` and sampled by its ``HardwareSampler`` (a process of its own, NIC and process
CPU at ``--hz``, /proc at 100 Hz).  Written to ``--out``: ``rankR.json`` (the Chrome trace,
``host_name`` set to ``nodeR``: every rank stands for a host of its own) and
``samplesR.parquet`` (the samples, moved onto the trace's clock as the agent does).

Faults made inside the rank (``--case``, on rank ``--culprit`` only): ``dataloader`` (its
dataset takes 3 ms per sample), ``compute`` (extra matrix products in its ``forward``).
The others come from outside: ``link`` (``tc`` on its network link), ``contention``
(another process on its CPU; ``--cpus`` pins a rank).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset

from lockstep.producers.agent.profiler import TorchWindow, export_trace
from lockstep.producers.agent.sampler import HardwareSampler
from lockstep.producers.agent.trace import read_chrome_trace
from lockstep.producers.agent.window import clock_offset_us, to_trace_clock
from lockstep.schemas.records import Sampling

WIDTH = 512
WARMUP = 2


class Samples(Dataset):
    def __init__(self, n: int, delay_s: float):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)  # slow storage or decoding on this rank
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, extra: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)
        )
        self.extra = extra
        self.w = torch.randn(WIDTH, WIDTH) / WIDTH**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("forward"):
            y = self.body(x)
            if self.extra:
                with torch.no_grad():  # rank-specific extra work (a metric, a debug check)
                    h = x
                    for _ in range(self.extra):
                        h = torch.tanh(h @ self.w)
            return y


def pin(cpus: set[int]) -> None:
    """Every thread of this process (gloo's too) on ``cpus``, like ``taskset -a``."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", default="none", choices=["none", "link", "contention", "dataloader", "compute"])
    ap.add_argument("--culprit", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hz", type=float, default=2000.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nic", default="", help="the rank's network interface (sampled at --hz)")
    ap.add_argument("--cpus", default="", help="pin the rank to these CPUs (comma-separated) once it is set up")
    ap.add_argument("--go", type=Path, default=None, help="once set up, write GO.rankR and wait for GO to exist")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    culprit = args.rank == args.culprit
    addr, port = args.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=args.rank, world_size=args.world)
    model = DistributedDataParallel(Net(extra=200 if culprit and args.case == "compute" else 0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = WARMUP + args.steps
    data = DataLoader(
        Samples(args.batch * steps, 0.048 / args.batch if culprit and args.case == "dataloader" else 0.0),
        batch_size=args.batch,
        num_workers=0,
    )
    sampler = HardwareSampler(args.rank, args.hz, nic=args.nic, use_gpu=False)
    sampler.wait_ready()
    if args.go is not None:  # the harness starts the fault from outside once every rank is set up
        args.go.with_name(f"{args.go.name}.rank{args.rank}").touch()
        while not args.go.exists():
            time.sleep(0.01)
    every_cpu = os.sched_getaffinity(0)
    if args.cpus:
        pin({int(c) for c in args.cpus.split(",")})
    window = TorchWindow(Sampling(hardware_hz=args.hz))
    boundaries: dict[int, float] = {}
    batches = iter(data)
    for step in range(steps):
        if step == WARMUP:
            sampler.start()
            window.start(step)
            boundaries[step] = time.time() * 1e6
        x, y = next(batches)  # inside the step, as in most training loops
        loss = (model(x) - y).square().mean()
        with record_function("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        if WARMUP <= step < steps - 1:  # the boundary into the next step, where the agent's step() would be
            boundaries[step + 1] = time.time() * 1e6
            window.step()
    pin(every_cpu)  # the fault's window is over: the profiler's and the sampler's stop run at full speed
    prof = window.stop()
    samples, stats = sampler.stop()
    dist.barrier()
    dist.destroy_process_group()

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank{args.rank}.json"
    export_trace(prof, path)
    trace = json.loads(path.read_text())
    trace["host_name"] = f"node{args.rank}"
    path.write_text(json.dumps(trace))
    te = read_chrome_trace(path)
    pq.write_table(
        to_trace_clock(samples, clock_offset_us(te.step_bounds, boundaries)), args.out / f"samples{args.rank}.parquet"
    )
    (args.out / f"sampler{args.rank}.json").write_text(
        json.dumps({"hz": stats.hz_achieved, "cpu_share": stats.cpu_share, "tiers": stats.tiers})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
