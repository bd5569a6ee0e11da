"""A synchronous data-parallel step, simulated for every worker at once.

Each step: data loading (CPU), host-to-device copy (PCIe), forward and backward
kernels (GPU; slower when the SM clock drops), a gradient all-reduce (every
worker waits for the last arrival; the ring runs at its slowest link), the
optimizer and a little Python.  Waits and critical path emerge from the
timeline; nothing is labelled.  Arrays are (workers, functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .faults import Effects
from .topology import Topology

BASE_CLOCK_MHZ = 1980.0


@dataclass(frozen=True)
class Function:
    name: str
    kind: str
    resource: str
    base_us: float
    bytes: float = float("nan")


FUNCTIONS: tuple[Function, ...] = (
    Function("dataloader.next", "dataloader", "cpu", 3_000.0),
    Function("memcpy.h2d", "memcpy", "pcie", 1_500.0, bytes=37.5e6),
    Function("fwd.gemm", "compute", "gpu", 40_000.0),
    Function("fwd.attention", "compute", "gpu", 20_000.0),
    Function("bwd.gemm", "compute", "gpu", 80_000.0),
    Function("bwd.attention", "compute", "gpu", 40_000.0),
    Function("nccl:all_reduce[dp]", "collective", "nic", 25_000.0, bytes=1.0e9),
    Function("optimizer.step", "optimizer", "gpu", 8_000.0),
    Function("python.train_loop", "python", "cpu", 400.0),
)
F = len(FUNCTIONS)
IDX = {f.name: i for i, f in enumerate(FUNCTIONS)}
KIND = np.array([f.kind for f in FUNCTIONS], dtype=object)
GPU_BOUND = np.array([f.resource == "gpu" for f in FUNCTIONS])
SIGMA = np.array([{"compute": 0.005, "optimizer": 0.005, "memcpy": 0.02, "collective": 0.01}.get(f.kind, 0.05) for f in FUNCTIONS])
BEFORE_ALLREDUCE = [IDX[n] for n in ("dataloader.next", "memcpy.h2d", "fwd.gemm", "fwd.attention", "bwd.gemm", "bwd.attention")]
AFTER_ALLREDUCE = [IDX[n] for n in ("optimizer.step", "python.train_loop")]
AR = IDX["nccl:all_reduce[dp]"]


@dataclass
class SimulatedStep:
    """One step of every worker: per-(worker, function) characteristics and per-worker step time."""

    step: int
    total_us: np.ndarray  # (W, F)
    critical_us: np.ndarray
    wait_us: np.ndarray  # NaN: not measured locally (as on a real host)
    first_start_us: np.ndarray
    calls: np.ndarray
    bytes: np.ndarray
    hw: dict[str, np.ndarray]  # metric -> (W, F), NaN where not applicable
    clock_events: np.ndarray  # (W, F) uint64
    step_time_us: np.ndarray  # (W,)


def simulate_step(topo: Topology, step: int, rng: np.random.Generator, fx: Effects) -> SimulatedStep:
    W = topo.workers
    base = np.array([f.base_us for f in FUNCTIONS])
    # kernels are nearly deterministic; host-side work (loading, Python) varies more
    jitter = rng.lognormal(0.0, 1.0, size=(W, F)) ** SIGMA[None, :]
    # transient hiccups: one function of a rare worker-step takes 1.5x (persistence must filter them)
    hiccup = rng.random((W, F)) < 0.002
    jitter = np.where(hiccup, jitter * 1.5, jitter)

    clock = BASE_CLOCK_MHZ * fx.clock_factor * rng.normal(1.0, 0.003, size=W)
    dur = base[None, :] * jitter * fx.duration_factor
    dur[:, GPU_BOUND] *= (BASE_CLOCK_MHZ / clock)[:, None]

    # timeline within the step: work before the all-reduce, then everyone waits for the last arrival
    arrival = dur[:, BEFORE_ALLREDUCE].sum(axis=1)
    first_start = np.zeros((W, F))
    first_start[:, BEFORE_ALLREDUCE] = np.cumsum(dur[:, BEFORE_ALLREDUCE], axis=1) - dur[:, BEFORE_ALLREDUCE]
    transfer = base[AR] * float(np.max(fx.link_factor)) * rng.lognormal(0.0, 0.01)
    wait = arrival.max() - arrival
    dur[:, AR] = wait + transfer
    first_start[:, AR] = arrival
    t = arrival.max() + transfer
    for i in AFTER_ALLREDUCE:
        first_start[:, i] = t
        t = t + dur[:, i]
    step_time = t

    bytes_ = np.tile(np.array([f.bytes for f in FUNCTIONS]), (W, 1))
    calls = np.ones((W, F), dtype=np.int32)
    calls[:, IDX["fwd.gemm"]] = 96
    calls[:, IDX["bwd.gemm"]] = 192
    calls[:, IDX["fwd.attention"]] = 48
    calls[:, IDX["bwd.attention"]] = 48
    hw = _hardware(topo, rng, fx, dur, transfer, bytes_, clock)
    wait_local = np.full((W, F), np.nan)
    return SimulatedStep(
        step=step,
        total_us=dur,
        critical_us=dur.copy(),
        wait_us=wait_local,
        first_start_us=first_start,
        calls=calls,
        bytes=bytes_,
        hw=hw,
        clock_events=np.where(GPU_BOUND[None, :], fx.clock_events[:, None], 0).astype(np.uint64),
        step_time_us=step_time,
    )


def _hardware(topo, rng, fx: Effects, dur, transfer, bytes_, clock) -> dict[str, np.ndarray]:
    W = topo.workers
    nan = np.full((W, F), np.nan)
    gpu = GPU_BOUND[None, :]
    n = lambda s: rng.normal(1.0, s, size=(W, F))  # noqa: E731
    hw = {
        "sm_clock_mhz": np.where(gpu, clock[:, None] * n(0.002), nan),
        "sm_active": np.where(gpu, 0.85 * n(0.02), nan),
        "gpu_power_w": np.where(gpu, 600.0 * fx.power_factor[:, None] * n(0.02), nan),
        "gpu_temp_c": np.where(gpu, (65.0 + fx.temp_delta[:, None]) * n(0.02), nan),
        "pcie_gbps": nan.copy(),
        "nvlink_gbps": nan.copy(),
        "nic_gbps": nan.copy(),
        "cpu_self": np.where(KIND[None, :] == "dataloader", 1.0 * fx.cpu_self_factor[:, None], 0.3) * n(0.05),
        "cpu_other": np.clip(0.05 + fx.cpu_other_delta[:, None] + rng.normal(0, 0.01, (W, F)), 0, 1),
        "mem_used_frac": np.clip(0.4 + fx.mem_delta[:, None] + rng.normal(0, 0.01, (W, F)), 0, 1),
        "disk_read_mbps": np.where(KIND[None, :] == "dataloader", 200.0 * fx.disk_factor[:, None] * n(0.05), nan),
    }
    h2d = IDX["memcpy.h2d"]
    hw["pcie_gbps"][:, h2d] = bytes_[:, h2d] / dur[:, h2d] / 1e3  # bytes/us -> GB/s
    hw["nic_gbps"][:, AR] = bytes_[:, AR] / transfer / 1e3 * fx.nic_util[:]
    return hw
