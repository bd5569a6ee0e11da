"""A small DDP training job (CPU, gloo) that hangs on one rank; it knows nothing of Lockstep (``lockstep agent run``).

Started by ``torchrun``.  At step ``HANG_AT``, rank ``HANG_RANK`` stops where ``HANG_MODE`` says:

- ``dataload``: its dataset's ``__getitem__`` never returns (a read that never completes);
- ``spin``: a Python loop inside the region ``rank_specific_metrics`` that never ends (it holds the GIL, which the
  interpreter hands over every switch interval);
- ``kill``: the process kills itself with SIGKILL (``os.kill``).

The other ranks go on into the step's backward pass, where DDP's gradient all-reduce waits for the stuck rank.
Each step begins with an all-reduce of a stop flag (``STOP_FILE``), a collective in Python that the agent counts.
Each rank writes its pid to ``OUT_DIR/pid.<rank>`` and rank 0 writes each step's end to ``OUT_DIR/steps.txt``.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_MODE = os.environ.get("HANG_MODE", "dataload")
HANG_AT = int(os.environ.get("HANG_AT", "60"))
STOP_FILE = Path(os.environ["STOP_FILE"])
OUT_DIR = Path(os.environ["OUT_DIR"])
MAX_STEPS = int(os.environ.get("MAX_STEPS", "3000"))
STEP = [0]  # the step now running (the dataset reads it)


class Samples(Dataset):
    def __init__(self, rank: int):
        self.rank = rank

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rank == HANG_RANK and HANG_MODE == "dataload" and STEP[0] >= HANG_AT:
            while True:  # a read that never completes
                time.sleep(1.0)
        return torch.randn(128)


def spin() -> int:
    n = 0
    while True:  # never ends; pure Python, so it holds the GIL between switch intervals
        n += 1
    return n


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (OUT_DIR / f"pid.{rank}").write_text(str(os.getpid()))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(DataLoader(Samples(rank), batch_size=16, num_workers=0))
    log = open(OUT_DIR / "steps.txt", "w") if rank == 0 else None  # noqa: SIM115 - closed at the end
    step = 0
    while step < MAX_STEPS:
        STEP[0] = step
        stop = torch.tensor([float(STOP_FILE.exists())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            break
        x = next(batches)
        if rank == HANG_RANK and step >= HANG_AT:
            if HANG_MODE == "spin":
                with torch.profiler.record_function("rank_specific_metrics"):
                    spin()
            elif HANG_MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
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
