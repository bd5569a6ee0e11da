"""A small DDP training job (CPU, gloo) instrumented with the agent in one line; used by test_torch_agent.py.

Every rank runs ``preprocess`` before its forward pass; rank ``SLOW_RANK`` takes
``SLOW_MS`` longer in it (a rank-specific slowdown, like logging on rank 0), or, with
``SLOW_REGION=slow_only``, spends them in a region of that name that no other rank runs.  The
job trains until ``STOP_FILE`` exists, then writes the agent's report to ``OUT_DIR``.
"""

import os
import sys
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lockstep.producers.agent

torch.set_num_threads(1)
rank = int(os.environ["RANK"])
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "40"))
SLOW_REGION = os.environ.get("SLOW_REGION", "preprocess")
STOP_FILE = Path(os.environ["STOP_FILE"])
OUT_DIR = Path(os.environ["OUT_DIR"])
MAX_S = float(os.environ.get("MAX_S", "120"))


def preprocess(x: torch.Tensor) -> torch.Tensor:
    slow = rank == SLOW_RANK
    with torch.profiler.record_function("preprocess"):
        time.sleep((5 + (SLOW_MS if slow and SLOW_REGION == "preprocess" else 0)) / 1000)
    if slow and SLOW_REGION != "preprocess":
        with torch.profiler.record_function(SLOW_REGION):
            time.sleep(SLOW_MS / 1000)
    return x * 2


def main() -> int:
    dist.init_process_group("gloo")
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = lockstep.producers.agent.attach(job=os.environ["JOB"])  # the one line (plus agent.step() below)
    t0 = time.monotonic()
    while True:
        stop = torch.tensor([float(STOP_FILE.exists() or time.monotonic() - t0 > MAX_S)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            break
        x = preprocess(torch.randn(64, 256))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)
        agent.step()
    agent.close()
    report = agent.report()
    (OUT_DIR / f"rank{rank}.json").write_bytes(msgspec.json.encode(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
