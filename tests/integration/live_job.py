"""A small DDP training job (CPU, gloo) that knows nothing of Lockstep: ``lockstep agent run`` attaches the agent.

Started by ``torchrun`` (``python -m torch.distributed.run``).  From step ``FAULT_AT`` on, rank ``SLOW_RANK`` (none:
-1) spends ``SLOW_MS`` more per step in the function ``SLOW_REGION`` (a ``record_function`` region that the other
ranks run in a fraction of the time, or not at all with ``SLOW_REGION=slow_only``); the fault is switched on by a
file rather than a step when ``FAULT_FILE`` is set.  The job trains until ``STOP_FILE`` exists or ``MAX_STEPS``, and
rank 0 writes each step's end time to ``OUT_DIR/steps.txt`` (onset-to-finding is measured from it).
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

torch.set_num_threads(1)
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "30"))
SLOW_REGION = os.environ.get("SLOW_REGION", "preprocess")
FAULT_AT = int(os.environ.get("FAULT_AT", "150"))
STOP_FILE = Path(os.environ["STOP_FILE"])
OUT_DIR = Path(os.environ["OUT_DIR"])
MAX_STEPS = int(os.environ.get("MAX_STEPS", "3000"))


def preprocess(x: torch.Tensor, slow: bool) -> torch.Tensor:
    with torch.profiler.record_function("preprocess"):
        time.sleep((4 + (SLOW_MS if slow and SLOW_REGION == "preprocess" else 0)) / 1000)
    if slow and SLOW_REGION != "preprocess":
        with torch.profiler.record_function(SLOW_REGION):
            time.sleep(SLOW_MS / 1000)
    return x * 2


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = open(OUT_DIR / "steps.txt", "w") if rank == 0 else None  # noqa: SIM115 - closed at the end
    step = 0
    while step < MAX_STEPS:
        stop = torch.tensor([float(STOP_FILE.exists())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            break
        slow = rank == SLOW_RANK and step >= FAULT_AT
        x = preprocess(torch.randn(32, 128), slow)
        model(x).square().mean().backward()
        opt.step()  # the agent's hook: the end of a training step
        opt.zero_grad()
        time.sleep(0.02)
        if log is not None:
            log.write(f"{step} {time.time():.3f}\n")
            log.flush()
        step += 1
    if log is not None:
        log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
