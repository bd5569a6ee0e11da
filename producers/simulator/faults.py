"""Fault catalogue: what each injected fault does to the simulated step.

A fault names its target (workers, hosts or NICs), a severity and the step it
starts at.  ``effects`` turns the active faults into per-worker multipliers
that the step model applies; the model then lets the consequences (waits,
slower rings, changed hardware readings) emerge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .topology import Topology

# NVML clock-event reasons
SW_POWER_CAP = 0x04
SW_THERMAL = 0x20
HW_THERMAL = 0x40

FAULT_TYPES = (
    "gpu_throttle_thermal",
    "gpu_throttle_power",
    "gpu_slow",
    "pcie",
    "host_cpu_contention",
    "dataloader",
)


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    type: str
    workers: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    severity: float = 0.3  # fraction slower (or clock lost) at the culprit
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.type not in FAULT_TYPES:
            raise FaultError(f"unknown fault type {self.type!r}; known: {', '.join(FAULT_TYPES)}")
        if not 0 < self.severity < 10:
            raise FaultError(f"fault {self.type}: severity must be in (0, 10)")

    def targets(self, topo: Topology) -> np.ndarray:
        """Boolean mask of affected workers."""
        mask = np.zeros(topo.workers, dtype=bool)
        for w in self.workers:
            if not 0 <= w < topo.workers:
                raise FaultError(f"fault {self.type}: worker {w} outside 0..{topo.workers - 1}")
            mask[w] = True
        if self.hosts:
            mask |= np.isin(topo.arrays["host"], self.hosts)
        return mask


@dataclass
class Effects:
    """Per-worker multipliers and deltas applied by the step model."""

    duration_factor: np.ndarray  # (W, F)
    clock_factor: np.ndarray  # (W,)
    clock_events: np.ndarray  # (W,) uint64
    power_factor: np.ndarray
    temp_delta: np.ndarray
    cpu_self_factor: np.ndarray
    cpu_other_delta: np.ndarray
    mem_delta: np.ndarray
    disk_factor: np.ndarray
    nic_util: np.ndarray  # (W,)
    link_factor: np.ndarray = field(default_factory=lambda: np.ones(1))  # ring slowdown per link

    @classmethod
    def healthy(cls, workers: int, functions: int) -> Effects:
        one = np.ones(workers)
        zero = np.zeros(workers)
        return cls(
            duration_factor=np.ones((workers, functions)),
            clock_factor=one.copy(),
            clock_events=np.zeros(workers, dtype=np.uint64),
            power_factor=one.copy(),
            temp_delta=zero.copy(),
            cpu_self_factor=one.copy(),
            cpu_other_delta=zero.copy(),
            mem_delta=zero.copy(),
            disk_factor=one.copy(),
            nic_util=one.copy(),
        )


def effects(topo: Topology, faults: list[Fault], step: int) -> Effects:
    from .model import FUNCTIONS, IDX

    fx = Effects.healthy(topo.workers, len(FUNCTIONS))
    for f in faults:
        if step < f.start_step:
            continue
        m = f.targets(topo)
        s = f.severity
        if f.type in ("gpu_throttle_thermal", "gpu_throttle_power"):
            fx.clock_factor[m] *= 1.0 / (1.0 + s)
            if f.type == "gpu_throttle_thermal":
                fx.clock_events[m] |= np.uint64(SW_THERMAL | HW_THERMAL)
                fx.temp_delta[m] += 24.0
            else:
                fx.clock_events[m] |= np.uint64(SW_POWER_CAP)
                fx.power_factor[m] *= 0.75
        elif f.type == "gpu_slow":
            for name in ("fwd.gemm", "fwd.attention", "bwd.gemm", "bwd.attention", "optimizer.step"):
                fx.duration_factor[m, IDX[name]] *= 1.0 + s
        elif f.type == "pcie":
            fx.duration_factor[m, IDX["memcpy.h2d"]] *= 1.0 + s * 10  # copies are short; a degraded link costs a lot
        elif f.type == "host_cpu_contention":
            fx.cpu_other_delta[m] += 0.6
            for name in ("dataloader.next", "python.train_loop"):
                fx.duration_factor[m, IDX[name]] *= 1.0 + s * 10
        elif f.type == "dataloader":
            fx.duration_factor[m, IDX["dataloader.next"]] *= 1.0 + s * 10
            fx.cpu_self_factor[m] *= 1.5
    return fx
