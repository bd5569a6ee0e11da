"""Fault catalogue: what each injected fault changes, what betrays it, and what a diagnosis should say.

A fault names its target (workers, hosts, NICs, switches, a pipeline stage or a
function), a ``severity`` and the step it starts at.  :func:`effects` turns the
active faults into per-worker changes the step model applies (a lower SM clock,
a slower link, a busier host); the consequences (longer kernels, waits at the
next collective on every other worker, a slower ring) emerge in the model.
:meth:`Fault.truth` is the finding a perfect diagnosis would make.

Severity, and the signals that tell each fault apart (``peers``: workers of the
same peer group, i.e. the same pipeline stage and role, in the same step):

``gpu_throttle_thermal`` (workers): SM clock / (1 + s).  Compute kernels and the
    optimizer take (1 + s)x on the culprit; ``sm_clock_mhz`` below peers;
    ``clock_events`` has SW/HW thermal slowdown (0x20 | 0x40); ``gpu_temp_c``
    about +22 C; power lower with the clock.  Everyone else waits at the next
    collective.  Finding: the GPU, a compute kernel, ``gpu_throttle_thermal``.
``gpu_throttle_power`` (workers): the same with ``clock_events`` SW power cap
    (0x04) and power lower (the GPU sits at its lowered cap), temperature normal.
``gpu_slow`` (workers): compute kernels (1 + s)x at the *same* SM clock, no
    clock-event bits, same ``sm_active``, same ``calls``, same input bytes.
``nvlink`` (workers): the GPU's NVLink runs at 1 / (1 + s).  Every collective
    whose group lives inside the host (``nccl:all_reduce[tp]``; the intra-host
    phase of ``[dp]`` and ``[ep]``) runs at the slowest member's link, so all
    members of the culprit's groups are equally slow in it (peers on other hosts
    are not); only the culprit's ``nvlink_gbps`` (rate while transferring) is low.
    Finding: the GPU's NVLink (device ``host/gpuN``), that collective, ``nvlink``.
``pcie`` (workers): PCIe throughput / (1 + 10 s) (a x16 link trained at x4 is
    s = 0.3): ``memcpy.h2d`` longer with ``pcie_gbps`` low at unchanged ``bytes``.
``nic`` (nics, e.g. ``node0003/bond1``): the bond's capacity / (1 + s).  Every
    inter-node collective and pipeline send/recv that crosses it is bounded by
    it: *all* members of the ring are equally slow, so timing does not localise
    it (the wait estimate absorbs it); the localising signal is ``nic_gbps`` of
    the workers behind that bond (their rate while transferring) far below
    everyone else's.  Finding: the bond, ``nccl:all_reduce[dp]`` (or the p2p /
    all-to-all), ``nic``.
``switch`` (switches, e.g. ``leaf001``): the same for every bond of every host
    behind the leaf switch (a congested uplink).  Several hosts with low
    ``nic_gbps``, all behind one switch.  Finding: the switch, ``switch``.
``host_cpu_contention`` (hosts): other processes take ``cpu_other`` +0.3 + s;
    the loaders need (1 + s)x the step's compute time per batch, so
    ``dataloader.next`` stalls about s x step on every worker of the host;
    Python is (1 + 2 s)x slower.  ``cpu_other`` high, ``cpu_self`` lower.
``host_memory`` (hosts): ``mem_used_frac`` about 0.97; page-cache misses and
    swapping make the loaders (1 + s)x slower and Python (1 + s)x; disk reads
    double; ``cpu_other`` barely moves.
``storage`` (hosts): reads slow: the loaders need (1 + s)x the step, so
    ``dataloader.next`` stalls; ``disk_read_mbps`` far below peers, ``cpu_other``
    and ``mem_used_frac`` normal.
``dataloader`` (workers): the worker's loader is too slow (decoding, pin_memory,
    too few workers): ``dataloader.next`` stalls about s x step; ``cpu_self`` of
    the loader high; disk, ``cpu_other`` and memory normal.
``input_imbalance`` (workers): the worker gets (1 + s)x the tokens (longer
    sequences): GEMMs (1 + s)x, attention (1 + s)^2 x at the same clock, and its
    ``memcpy.h2d`` moves (1 + s)x the ``bytes`` at an unchanged ``pcie_gbps``.
    The bytes of the copy separate it from ``gpu_slow``.
``pipeline_imbalance`` (stage): the stage holds max(1, round(s x layers per
    stage)) extra layers: its layer kernels have more ``calls`` and more work
    than the other stages' (no outlier *inside* the stage's peer group); the other
    stages wait in ``nccl:send_recv[pp]``.  Finding of scope ``group``
    (``{"pp": stage}``), a layer kernel, ``pipeline_imbalance``.
``rank_specific_code`` (workers, ``function``, default ``python.log_metrics``):
    the function costs an extra s x step on the culprit only (logging or
    evaluation on rank 0); no hardware deviates.
``regression`` (``function``): every worker's function takes (1 + s)x from
    ``start_step`` on: no outlier in the window, only against the job's earlier
    healthy window (the scenario's ``baseline``).  Finding of scope ``job``.
``clock_skew`` (hosts): the hosts' wall clocks are s seconds off.  Only
    ``sent_at`` changes; step-relative summaries are identical.  No finding.
``missing_worker`` (workers): the worker's agent is gone: no heartbeats and no
    feature batches from ``start_step`` on.  Coverage drops; no finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...schemas.errors import LockstepError
from .model import (
    COMPUTE_KERNELS,
    CPU_FUNCTIONS,
    HW_THERMAL,
    IDX,
    LAYER_KERNELS,
    SAMPLED,
    SW_POWER_CAP,
    SW_THERMAL,
    Effects,
)
from .topology import Topology, TopologyError


class FaultError(LockstepError, ValueError):
    pass


@dataclass(frozen=True)
class FaultKind:
    target: str  # workers | hosts | nics | switches | stage | function
    cause: str | None  # expected Finding.cause; None: no finding expected
    scope: str | None  # expected Finding.scope
    functions: tuple[str, ...] = ()  # acceptable Finding.function ("" : the fault's own ``function``)
    by_device: bool = False  # a finding that names the right device localises it even if it lists more workers
    #: hardware samples that tell the cause from the others that slow the same function the same way: without
    #: them a perfect diagnosis names worker, function and device with the cause ``undetermined``
    needs: tuple[str, ...] = ()


_INTER_NODE = ("nccl:all_reduce[dp]", "nccl:send_recv[pp]", "nccl:all_to_all[ep]", "nccl:all_reduce[mp]")
_INTRA_NODE = ("nccl:all_reduce[tp]", "nccl:all_reduce[dp]", "nccl:all_to_all[ep]", "nccl:all_reduce[mp]")
_INPUT = (
    "fwd.gemm",
    "fwd.attention",
    "bwd.gemm",
    "bwd.attention",
    "fwd.embedding",
    "fwd.loss",
    "moe.expert_gemm",
    "memcpy.h2d",
)

CATALOGUE: dict[str, FaultKind] = {
    "gpu_throttle_thermal": FaultKind(
        "workers", "gpu_throttle_thermal", "worker", COMPUTE_KERNELS, needs=("sm_clock_mhz",)
    ),
    "gpu_throttle_power": FaultKind(
        "workers", "gpu_throttle_power", "worker", COMPUTE_KERNELS, needs=("sm_clock_mhz",)
    ),
    "gpu_slow": FaultKind("workers", "gpu_slow", "worker", COMPUTE_KERNELS, needs=("sm_clock_mhz",)),
    "nvlink": FaultKind("workers", "nvlink", "worker", _INTRA_NODE, by_device=True, needs=("nvlink_gbps",)),
    "pcie": FaultKind("workers", "pcie", "worker", ("memcpy.h2d",), needs=("pcie_gbps",)),
    "nic": FaultKind("nics", "nic", "worker", _INTER_NODE, by_device=True, needs=("nic_gbps",)),
    "switch": FaultKind("switches", "switch", "worker", _INTER_NODE, by_device=True, needs=("nic_gbps",)),
    "host_cpu_contention": FaultKind(
        "hosts", "host_cpu_contention", "worker", CPU_FUNCTIONS, by_device=True, needs=("cpu_other",)
    ),
    "host_memory": FaultKind("hosts", "host_memory", "worker", CPU_FUNCTIONS, by_device=True, needs=("mem_used_frac",)),
    "storage": FaultKind("hosts", "storage", "worker", ("dataloader.next",), by_device=True, needs=("disk_read_mbps",)),
    "dataloader": FaultKind(
        "workers", "dataloader", "worker", ("dataloader.next",), needs=("cpu_other", "disk_read_mbps", "mem_used_frac")
    ),
    "input_imbalance": FaultKind("workers", "input_imbalance", "worker", _INPUT),
    "pipeline_imbalance": FaultKind("stage", "pipeline_imbalance", "group", LAYER_KERNELS),
    # the peers run the function too: only the host's CPU samples rule contention out
    "rank_specific_code": FaultKind("workers", "rank_specific_code", "worker", ("",), needs=("cpu_other",)),
    "regression": FaultKind("function", "regression", "job", ("",)),
    "clock_skew": FaultKind("hosts", None, None),
    "missing_worker": FaultKind("workers", None, None),
}
FAULT_TYPES = tuple(CATALOGUE)


@dataclass
class Truth:
    """What a perfect diagnosis of one fault says.  ``cause`` None: it must say nothing."""

    fault: str
    cause: str | None
    scope: str | None
    workers: list[int]
    hosts: list[str]
    devices: list[str]
    functions: list[str]
    group: dict[str, str] | None = None
    by_device: bool = False
    severity: float = 0.0
    impact: float = float("nan")  # step-time share removing the fault saves, measured by re-simulation

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Fault:
    type: str
    workers: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    stage: int | None = None
    function: str = ""
    severity: float = 0.3
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.type not in CATALOGUE:
            raise FaultError(f"unknown fault type {self.type!r}; known: {', '.join(FAULT_TYPES)}")
        if not 0 < self.severity < 10:
            raise FaultError(f"fault {self.type}: severity must be in (0, 10)")
        kind = CATALOGUE[self.type]
        if self.type == "rank_specific_code" and not self.function:
            object.__setattr__(self, "function", "python.log_metrics")
        given = {
            "workers": bool(self.workers),
            "hosts": bool(self.hosts),
            "nics": bool(self.nics),
            "switches": bool(self.switches),
            "stage": self.stage is not None,
            "function": bool(self.function),
        }
        if not given[kind.target]:
            raise FaultError(f"fault {self.type}: say which {kind.target} it hits ({kind.target}: ...)")
        if self.function and self.function not in IDX:
            raise FaultError(f"fault {self.type}: unknown function {self.function!r}; known: {', '.join(IDX)}")

    @property
    def kind(self) -> FaultKind:
        return CATALOGUE[self.type]

    def targets(self, topo: Topology) -> np.ndarray:
        """Boolean mask of the workers the fault hits."""
        a = topo.arrays
        mask = np.zeros(topo.workers, dtype=bool)
        try:
            for w in self.workers:
                if not 0 <= w < topo.workers:
                    raise FaultError(f"fault {self.type}: worker {w} outside 0..{topo.workers - 1}")
                mask[w] = True
            for h in self.hosts:
                if not 0 <= h < topo.hosts:
                    raise FaultError(f"fault {self.type}: host {h} outside 0..{topo.hosts - 1}")
            mask |= np.isin(a["host"], self.hosts)
            mask |= np.isin(a["nic"], [topo.nic_index(n) for n in self.nics])
            mask |= np.isin(a["switch"], [topo.switch_index(s) for s in self.switches])
        except TopologyError as exc:
            raise FaultError(f"fault {self.type}: {exc}") from None
        if self.stage is not None:
            if not 0 <= self.stage < topo.pp:
                raise FaultError(f"fault {self.type}: stage {self.stage} outside 0..{topo.pp - 1}")
            mask |= a["pp"] == self.stage
        if self.type == "regression":
            mask[:] = True
        return mask

    def truth(self, topo: Topology, hardware: str = "nvml") -> Truth:
        """What a perfect diagnosis says, given what the workers' samplers see (``hardware``, :data:`SAMPLED`)."""
        k = self.kind
        m = self.targets(topo)
        workers = [int(w) for w in np.flatnonzero(m)]
        hosts = sorted({topo.host_name(int(h)) for h in topo.arrays["host"][m]})
        if self.type == "nic":
            devices = list(self.nics)
        elif self.type == "switch":
            devices = list(self.switches)
        elif k.target == "hosts" or self.type in ("dataloader", "rank_specific_code"):
            devices = hosts
        elif k.target == "workers":
            devices = [topo.device_name(w) for w in workers]
        else:
            devices = []
        functions = [self.function if f == "" else f for f in k.functions]
        cause = k.cause if k.cause is None or set(k.needs) <= SAMPLED[hardware] else "undetermined"
        return Truth(
            fault=self.type,
            cause=cause,
            scope=k.scope,
            workers=workers if k.scope in ("worker", "group") else [],
            hosts=hosts if k.scope in ("worker", "group") else [],
            devices=devices if k.cause else [],
            functions=functions,
            group={"pp": str(self.stage)} if self.type == "pipeline_imbalance" else None,
            by_device=k.by_device,
            severity=self.severity,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for name in ("workers", "hosts", "nics", "switches"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        if self.stage is not None:
            out["stage"] = self.stage
        if self.function and not (self.type == "rank_specific_code" and self.function == "python.log_metrics"):
            out["function"] = self.function
        out["severity"] = self.severity
        out["start_step"] = self.start_step
        return out


def effects(topo: Topology, faults: tuple[Fault, ...] | list[Fault], step: int, layers_per_stage: int) -> Effects:
    """The active faults' changes at ``step``, combined (two faults on one worker compound)."""
    fx = Effects.healthy(topo)
    for f in faults:
        if step < f.start_step:
            continue
        m = f.targets(topo)
        s = f.severity
        t = f.type
        if t in ("gpu_throttle_thermal", "gpu_throttle_power"):
            fx.clock_factor[m] /= 1.0 + s
            if t == "gpu_throttle_thermal":
                fx.clock_events[m] |= np.uint64(SW_THERMAL | HW_THERMAL)
                fx.temp_delta[m] += 22.0
            else:
                fx.clock_events[m] |= np.uint64(SW_POWER_CAP)
        elif t == "gpu_slow":
            fx.gpu_factor[m] *= 1.0 + s
        elif t == "nvlink":
            fx.nvlink_factor[m] /= 1.0 + s
        elif t == "pcie":
            fx.pcie_factor[m] /= 1.0 + 10.0 * s
        elif t in ("nic", "switch"):
            fx.nic_factor[m] /= 1.0 + s
        elif t == "host_cpu_contention":
            fx.cpu_other_delta[m] += min(0.9, 0.3 + s)
            fx.cpu_self_factor[m] *= 0.8
            fx.loader_excess[m] += 0.5 + s
            fx.python_factor[m] *= 1.0 + 2.0 * s
        elif t == "host_memory":
            fx.mem_floor[m] = 0.97
            fx.cpu_other_delta[m] += 0.03
            fx.loader_excess[m] += 0.5 + s
            fx.python_factor[m] *= 1.0 + s
            fx.disk_factor[m] *= 2.0
        elif t == "storage":
            fx.loader_excess[m] += 0.5 + s
            fx.disk_factor[m] /= 2.0 + 10.0 * s
            fx.cpu_self_factor[m] *= 0.5
        elif t == "dataloader":
            fx.loader_excess[m] += 0.5 + s
            fx.cpu_self_factor[m] *= 1.5
        elif t == "input_imbalance":
            fx.tokens[m] *= 1.0 + s
        elif t == "pipeline_imbalance":
            fx.extra_layers[f.stage] += max(1, round(s * layers_per_stage))
        elif t == "rank_specific_code":
            fx.extra_us[m, IDX[f.function]] += s
        elif t == "regression":
            fx.fn_factor[:, IDX[f.function]] *= 1.0 + s
        elif t == "clock_skew":
            fx.clock_offset_s[m] += s
        elif t == "missing_worker":
            fx.missing[m] = True
    return fx
