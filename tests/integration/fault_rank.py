"""One rank of a small DDP job (CPU, gloo) with a real fault on one rank, profiled the way the agent profiles.

    python fault_rank.py --rank R --world N --master ADDR:PORT --out DIR --case CASE --culprit C [--nic IF] [--cpus 1]

Each step: a batch from a ``torch.utils.data.DataLoader``, ``forward`` (a record_function
region), ``backward`` (DDP's gradient all-reduce runs on the reducer thread meanwhile), the
optimizer.  After two unprofiled steps, ``--steps`` steps are profiled with the agent's own
``TorchWindow`` and sampled by its ``HardwareSampler`` (a process of its own, NIC and process
CPU at ``--hz``, /proc at 100 Hz).  Written to ``--out``: ``rankR.json`` (the Chrome trace,
``host_name`` set to ``nodeR``: every rank stands for a host of its own) and
``samplesR.parquet`` (the samples, moved onto the trace's clock as the agent does) and
``connectionsR.parquet`` (its TCP connections over the steps from ``--warmup`` on, as the agent records a window's).

Faults made inside the rank (``--case``, on the ranks of ``--culprit`` only): ``dataloader`` (its
dataset takes 3 ms per sample), ``compute`` (extra matrix products in its ``forward``).
The others come from outside: ``link`` (``tc`` on its network link), ``contention``
(another process on its CPU; ``--cpus`` pins a rank).

The real-fault corpus (``real_faults.py --corpus``) adds the mechanisms of :data:`TIMED`: each is real
work of its kind (extra Python in a hook, cyclic garbage for the collector, fresh pages of fresh
allocations, pages evicted and read back, ``fsync``-ed writes, cold reads, a CPU transform, more
optimizer arithmetic, an evaluation), done until it has cost ``--severity`` of the job's healthy step
(its fastest warm-up step after the first, the slowest rank's, agreed by an all-reduce), per step or, for a function that
runs every ``--period``-th step, ``--period`` times that at each occurrence.  The other corpus mechanisms
come from outside (a cgroup's CPU quota, a busy core, ``nice``, ``tc``): for those this rank runs healthy.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset

from lockstep.producers.agent.profiler import TorchWindow, export_trace
from lockstep.producers.agent.sampler import HardwareSampler
from lockstep.producers.agent.tcpdiag import connections, snapshot
from lockstep.producers.agent.trace import read_chrome_trace
from lockstep.producers.agent.window import clock_offset_us, to_trace_clock
from lockstep.schemas.records import Sampling

WIDTH = 512
WARMUP = 2
#: mechanisms made inside the culprit rank, each costing --severity of the healthy step (see the module's docstring)
TIMED = (
    "extra_forward",
    "hook_python",
    "gc_heavy",
    "slow_optimizer",
    "rank_eval",
    "alloc_churn",
    "mmap_pageout",
    "checkpoint_k",
    "log_fsync",
    "cold_reads",
    "slow_transform",
)
#: mechanisms made from outside by the harness (the rank itself runs healthy)
OUTSIDE = ("cgroup_quota", "taskset_busy", "nice", "tbf_burst", "htb", "u32_path", "neighbour")
PAGE = mmap.PAGESIZE


class Budget:
    """Seconds a fault may cost per step: set once the healthy step is known (0 on healthy ranks)."""

    def __init__(self) -> None:
        self.s = 0.0

    def spend(self, unit, share: float = 1.0) -> None:
        """Run ``unit()`` (a small piece of the fault's real work) until ``share`` of the budget has passed."""
        if self.s <= 0:
            return
        end = time.perf_counter() + self.s * share
        while time.perf_counter() < end:
            unit()


def _cold_file(path: Path, mb: int) -> int:
    """A file of ``mb`` MiB of random bytes (the rank's shard of a dataset on disk); its descriptor."""
    if not path.exists() or path.stat().st_size != mb * 2**20:
        path.write_bytes(os.urandom(mb * 2**20))
    return os.open(path, os.O_RDONLY)


class Samples(Dataset):
    def __init__(self, n: int, delay_s: float, budget: Budget | None = None, mode: str = "", batch: int = 1):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
        self.delay_s = delay_s
        self.budget, self.mode, self.batch = budget, mode, batch
        self.fd = -1
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.x)

    def cold_read(self) -> None:
        """Drop the shard's pages from the page cache, then read a random 16 KiB of it: from the disk."""
        size = os.fstat(self.fd).st_size
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(self.fd, 16384, int(self.rng.integers(0, size // 16384)) * 16384)

    def transform(self) -> None:
        """A costly CPU transform of a sample (a spectrum and a sort, as an augmentation might do)."""
        a = self.rng.standard_normal(512)
        np.sort(np.abs(np.fft.rfft(a)))

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)  # slow storage or decoding on this rank
        if self.budget is not None and i % self.batch == 0:  # one slow sample per batch
            if self.mode == "cold_reads":
                self.budget.spend(self.cold_read)
            elif self.mode == "slow_transform":
                self.budget.spend(self.transform)
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, extra: int, budget: Budget | None = None, mode: str = "", table: Path | None = None):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)
        )
        self.extra = extra
        self.w = torch.randn(WIDTH, WIDTH) / WIDTH**0.5
        self.budget, self.mode = budget, mode
        self.h = torch.zeros(4, WIDTH)
        self.table: mmap.mmap | None = None
        self.at = 0
        if table is not None:  # an embedding table read through a file mapping (every rank has one)
            self.fd = _cold_file(table, 64)
            self.table = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)

    def matmul(self) -> None:
        with torch.no_grad():
            self.h = torch.tanh(self.h @ self.w)

    def churn(self) -> None:
        """A fresh 64 MiB buffer (above malloc's mmap threshold: new pages every time), 64 of its pages touched."""
        t = torch.empty(2**24)
        t[:: PAGE // 4][:64].fill_(1.0)
        self.at += 1

    def page_in(self) -> None:
        """Evict 64 KiB of the mapped table from memory (as reclaim under pressure does), then read it back."""
        assert self.table is not None
        off = (self.at % 1024) * 65536
        self.table.madvise(mmap.MADV_PAGEOUT if hasattr(mmap, "MADV_PAGEOUT") else mmap.MADV_DONTNEED, off, 65536)
        os.posix_fadvise(self.fd, off, 65536, os.POSIX_FADV_DONTNEED)
        sum(self.table[off : off + 65536 : PAGE])
        self.at += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("forward"):
            y = self.body(x)
            if self.table is not None:  # every rank reads a few rows of its table
                off = (self.at % 64) * 2**20
                sum(self.table[off : off + 65536 : PAGE])
            if self.extra:
                with torch.no_grad():  # rank-specific extra work (a metric, a debug check)
                    h = x
                    for _ in range(self.extra):
                        h = torch.tanh(h @ self.w)
            if self.budget is not None:
                if self.mode == "extra_forward":
                    self.budget.spend(self.matmul)
                elif self.mode == "alloc_churn":
                    self.budget.spend(self.churn)
                elif self.mode == "mmap_pageout":
                    self.budget.spend(self.page_in)
                elif self.mode == "gc_heavy":  # Python bookkeeping that leaves cycles behind: the collector runs often
                    self.budget.spend(cyclic_garbage)
            return y


def python_work() -> None:
    """Plain Python (a hook that inspects the outputs, logs, keeps statistics)."""
    total = 0
    for i in range(300):
        total += i * i % 7


def cyclic_garbage() -> None:
    """Objects in reference cycles: only the cyclic collector frees them."""
    for _ in range(30):
        a: dict = {"self": None, "data": list(range(8))}
        a["self"] = a


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
    ap.add_argument(
        "--case", default="none", choices=["none", "link", "contention", "dataloader", "compute", *TIMED, *OUTSIDE]
    )
    ap.add_argument("--culprit", default="-1", help="the culprit rank, or several, comma-separated")
    ap.add_argument("--severity", type=float, default=0.0, help="what a TIMED fault costs: a share of the healthy step")
    ap.add_argument("--period", type=int, default=3, help="checkpoint_k, rank_eval: the function runs every k-th step")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="unprofiled steps first (the healthy step: from 3)")
    ap.add_argument("--scratch", type=Path, default=None, help="folder for the rank's files (default: --out)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hz", type=float, default=2000.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nic", default="", help="the rank's network interface (sampled at --hz)")
    ap.add_argument("--cpus", default="", help="pin the rank to these CPUs (comma-separated) once it is set up")
    ap.add_argument("--go", type=Path, default=None, help="once set up, write GO.rankR and wait for GO to exist")
    ap.add_argument("--go-after-warmup", action="store_true", help="--go's wait after the warm-up steps, not before")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    culprit = args.rank in {int(c) for c in args.culprit.split(",")}
    timed = culprit and args.case in TIMED
    budget = Budget()
    scratch = args.scratch or args.out
    scratch.mkdir(parents=True, exist_ok=True)
    addr, port = args.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=args.rank, world_size=args.world)
    net = Net(
        extra=200 if culprit and args.case == "compute" else 0,
        budget=budget if timed else None,
        mode=args.case,
        table=scratch / f"table{args.rank}.bin" if args.case == "mmap_pageout" else None,
    )
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if timed and args.case == "hook_python":  # runs inside DDP's forward, after the module's own
        net.register_forward_hook(lambda *_: budget.spend(python_work))
    if timed and args.case == "slow_optimizer":  # runs inside Optimizer.step: more arithmetic on the gradients
        grads = [p for p in model.parameters() if p.dim() == 2]  # one weight's gradient norm a unit

        def norms() -> None:
            net.at += 1
            g = grads[net.at % len(grads)].grad
            if g is not None:
                torch.linalg.vector_norm(g[:128])

        opt.register_step_pre_hook(lambda *_: budget.spend(norms))
    if timed and args.case == "gc_heavy":
        gc.set_threshold(100, 5, 5)
    steps = args.warmup + args.steps
    samples = Samples(
        args.batch * steps,
        0.048 / args.batch if culprit and args.case == "dataloader" else 0.0,
        budget if timed else None,
        args.case,
        args.batch,
    )
    if timed and args.case == "cold_reads":
        samples.fd = _cold_file(scratch / f"shard{args.rank}.bin", 64)
    data = DataLoader(samples, batch_size=args.batch, num_workers=0)
    log = (scratch / f"metrics{args.rank}.log").open("a")
    slow_log = os.open(scratch / f"metrics{args.rank}.sync", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    ckpt = scratch / f"ckpt{args.rank}.pt"
    ckpt_fd = os.open(scratch / f"ckpt{args.rank}.extra", os.O_WRONLY | os.O_CREAT)
    chunk = os.urandom(64 * 1024)
    eval_x = torch.randn(args.batch, WIDTH)

    def fsync_line() -> None:
        os.write(slow_log, b"step metrics: loss, lr, grad norm\n")
        os.fsync(slow_log)

    def fsync_chunk() -> None:
        os.pwrite(ckpt_fd, chunk, 0)
        os.fsync(ckpt_fd)

    def evaluate() -> None:
        with torch.no_grad():
            net.body(eval_x)

    sampler = HardwareSampler(args.rank, args.hz, nic=args.nic, use_gpu=False)
    sampler.wait_ready()

    def ready() -> None:  # the harness starts the fault from outside once every rank is ready
        if args.go is not None:
            args.go.with_name(f"{args.go.name}.rank{args.rank}").write_text(json.dumps({"healthy_step_us": healthy_us}))
            while not args.go.exists():
                time.sleep(0.01)

    healthy_us = 0.0
    if not args.go_after_warmup:
        ready()
    every_cpu = os.sched_getaffinity(0)
    if args.cpus:
        pin({int(c) for c in args.cpus.split(",")})
    window = TorchWindow(Sampling(hardware_hz=args.hz))
    boundaries: dict[int, float] = {}
    batches = iter(data)
    warm: list[float] = []
    # with --go-after-warmup (the corpus) the profiler and the sampler run from step 1, so that the healthy step is
    # measured under their cost too; the fixture keeps the steps from --warmup on
    profile_from = 1 if args.go_after_warmup else args.warmup
    tcp_before = None
    for step in range(steps):
        t0 = time.perf_counter()
        if step == args.warmup:  # the TCP connections over the steps the fixture keeps, as the agent takes a window's
            tcp_before = snapshot()
        if step == profile_from:
            sampler.start()
            window.start(step)
            boundaries[step] = time.time() * 1e6
        periodic = step % args.period == 0
        x, y = next(batches)  # inside the step, as in most training loops
        loss = (model(x) - y).square().mean()
        with record_function("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        if args.case == "log_fsync":  # every rank logs its metrics; the culprit's log is written through (fsync)
            with record_function("log_metrics"):
                log.write(f"step {step} loss {float(loss):.4f}\n")
                log.flush()
                if timed:
                    budget.spend(fsync_line)
        if (
            args.case == "checkpoint_k" and periodic
        ):  # every rank saves its state every k-th step; the culprit's disk is slow
            with record_function("save_checkpoint"):
                torch.save(model.state_dict(), ckpt)
                if timed:
                    budget.spend(fsync_chunk, args.period)
        if args.case == "rank_eval" and timed and periodic:  # only the culprit evaluates (rank-specific evaluation)
            with record_function("evaluate"):
                budget.spend(evaluate, args.period)
        if step < args.warmup:
            warm.append(time.perf_counter() - t0)
        if step == args.warmup - 1:
            # every rank agrees on the healthy step: the slowest rank's fastest warm-up step after the profiler started
            healthy = torch.tensor([float(np.min(warm[profile_from + 1 :] or warm[1:] or warm))])
            dist.all_reduce(healthy, op=dist.ReduceOp.MAX)
            budget.s = args.severity * float(healthy) if timed else 0.0
            healthy_us = float(healthy) * 1e6
            if args.go_after_warmup:
                ready()
        if profile_from <= step < steps - 1:  # the boundary into the next step, where the agent's step() would be
            boundaries[step + 1] = time.time() * 1e6
            window.step()
    conns = connections(args.rank, tcp_before, snapshot())
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
    if conns is not None:
        pq.write_table(conns, args.out / f"connections{args.rank}.parquet")
    (args.out / f"sampler{args.rank}.json").write_text(
        json.dumps(
            {
                "hz": stats.hz_achieved,
                "cpu_share": stats.cpu_share,
                "tiers": stats.tiers,
                "healthy_step_us": float(healthy) * 1e6,
                "budget_us": budget.s * 1e6,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
