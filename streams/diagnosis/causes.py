"""Cause attribution from the function's own resource (brief 5, "Cause categories").

A suspect is one or more workers that persistently spent more *work* in one
function than their peers (or, for collectives, moved data well below their
peers' link throughput).  Which hardware the function depends on decides
which characteristics are evidence: the SM clock for kernels, PCIe throughput
for copies, NIC or NVLink throughput for collectives, the host's CPU, memory
and disk for Python and data loading.  Without hardware samples the cause
comes from timing alone and ``certainty`` is lower.

| resource | evidence                                   | cause                                   |
|----------|--------------------------------------------|-----------------------------------------|
| gpu      | SM clock down, thermal / power event bits  | gpu_throttle_thermal / _power / gpu_throttle |
| gpu      | more calls, bytes or input than peers      | input_imbalance                         |
| gpu      | same clock, more time                      | gpu_slow                                |
| pcie     | PCIe throughput down                       | pcie (host_cpu_contention, host_memory when those deviate instead) |
| nvlink   | NVLink throughput down                     | nvlink                                  |
| nic      | NIC throughput down; several hosts, one switch | nic / switch                        |
| (either) | a collective over both: the link that dropped decides |                              |
| cpu      | other processes take the CPU               | host_cpu_contention                     |
| cpu      | host memory nearly full                    | host_memory                             |
| cpu      | data loading with disk reads down          | storage                                 |
| cpu      | data loading otherwise                     | dataloader                              |
| cpu      | a function the peers do not run            | rank_specific_code                      |
| cpu      | several times the peers' time, same input  | rank_specific_code                      |
| cpu      | more calls, bytes or input                 | input_imbalance                         |
| cpu      | Python the peers run faster                | python_overhead                         |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...schemas.records import Evidence
from ..policy import DiagnosisPolicy

# NVML clock-event (throttle) reason bits
THERMAL_BITS = 0x20 | 0x40  # SW / HW thermal slowdown
POWER_BITS = 0x04 | 0x80  # SW power cap / HW power brake


@dataclass
class Suspect:
    function: str
    kind: str
    resource: str
    workers: list[int]
    hosts: list[str]
    devices: list[str]
    nics: list[str]
    switches: list[str]
    peers: int  # workers in the peer group
    z: float
    work_us: float
    peer_work_us: float
    excess_us: float
    has_hardware: bool
    clock_events: int
    peer_clock_events: int
    values: dict[str, float] = field(default_factory=dict)  # evidence column -> median over steps
    peer_values: dict[str, float] = field(default_factory=dict)
    present: int = 0  # peers (the suspect included) that ran the function
    signal: str = "work"  # work | hardware
    peer_mad_us: float = math.nan


@dataclass
class Attribution:
    cause: str
    devices: list[str]
    evidence: list[Evidence]
    certainty: float  # how well the evidence supports the cause, 0..1


def _rel(v: float, p: float) -> float:
    if not (math.isfinite(v) and math.isfinite(p)) or p == 0:
        return math.nan
    return (v - p) / abs(p)


def _ev(s: Suspect, name: str) -> Evidence:
    v, p = s.values.get(name, math.nan), s.peer_values.get(name, math.nan)
    return Evidence(feature=name, value=_round(v), peer_value=_round(p), deviation=_round(_rel(v, p)))


def _round(x: float) -> float | None:
    return float(round(x, 4)) if math.isfinite(x) else None


def _unique(xs: list[str]) -> list[str]:
    return sorted({x for x in xs if x})


def classify(s: Suspect, policy: DiagnosisPolicy) -> Attribution:
    ev = [Evidence(feature="work_us", value=_round(s.work_us), peer_value=_round(s.peer_work_us), deviation=_round(s.z))]
    dev_gpu = _unique(s.devices)
    dev_host = _unique(s.hosts)
    r = s.resource
    hw = 1.0 if s.has_hardware else 0.75  # timing alone is weaker evidence
    rank_specific = 0 < s.peers and s.present <= policy.rank_specific_present * s.peers
    # several times the peers' time in one function, the host healthy: the worker runs code there its peers do not
    # (logging, evaluation, checkpointing on one rank); interpreter or GC overhead slows Python by a fraction
    extra_code = s.peer_work_us > 0 and s.work_us >= policy.rank_specific_ratio * s.peer_work_us

    def drop(name: str, limit: float) -> bool:
        d = _rel(s.values.get(name, math.nan), s.peer_values.get(name, math.nan))
        return math.isfinite(d) and d < -limit

    def rise(name: str, limit: float) -> bool:
        v, p = s.values.get(name, math.nan), s.peer_values.get(name, math.nan)
        return math.isfinite(v) and math.isfinite(p) and v - p > limit

    def more_input() -> list[Evidence]:
        """The function's calls or bytes, or the worker's input batch, well above the peers': the evidence, else []."""
        return [_ev(s, c) for c in ("calls", "bytes", "input_bytes") if _rel(s.values.get(c, math.nan), s.peer_values.get(c, math.nan)) > policy.input_rise]

    def memory_pressure() -> bool:
        return s.values.get("mem_used_frac", 0.0) > policy.mem_high and rise("mem_used_frac", 0.05)

    if r == "gpu":
        if drop("sm_clock_mhz", policy.clock_drop):
            bits = s.clock_events & ~s.peer_clock_events
            if bits & THERMAL_BITS:
                cause, extra = "gpu_throttle_thermal", [_ev(s, "gpu_temp_c")]
            elif bits & POWER_BITS:
                cause, extra = "gpu_throttle_power", [_ev(s, "gpu_power_w")]
            else:
                cause, extra = "gpu_throttle", []
            ev += [_ev(s, "sm_clock_mhz"), *extra]
            ev.append(Evidence(feature="clock_events", value=float(s.clock_events), peer_value=float(s.peer_clock_events), deviation=float(bits)))
            return Attribution(cause, dev_gpu, ev, 1.0 if bits else 0.85)
        if more := more_input():
            return Attribution("input_imbalance", dev_gpu, ev + more, 0.9)
        if math.isfinite(s.values.get("sm_clock_mhz", math.nan)):
            return Attribution("gpu_slow", dev_gpu, ev + [_ev(s, "sm_clock_mhz"), _ev(s, "sm_active")], 0.9)
        return Attribution("gpu_slow", dev_gpu, ev, 0.6)
    if r == "pcie":
        pcie = [d + "/pcie" for d in dev_gpu]
        if drop("pcie_gbps", policy.throughput_drop):
            return Attribution("pcie", pcie, ev + [_ev(s, "pcie_gbps")], 1.0)
        if rise("cpu_other", policy.cpu_other_rise):
            return Attribution("host_cpu_contention", dev_host, ev + [_ev(s, "cpu_other")], 0.8)
        if memory_pressure():
            return Attribution("host_memory", dev_host, ev + [_ev(s, "mem_used_frac")], 0.8)
        return Attribution("pcie", pcie, ev + [_ev(s, "pcie_gbps")], 0.6 * hw)
    if r in ("nic", "nvlink"):  # a hierarchical collective runs over both: the link whose throughput dropped
        nvlink, nic = drop("nvlink_gbps", policy.throughput_drop), drop("nic_gbps", policy.throughput_drop)
        r = "nvlink" if nvlink and not nic else "nic" if nic and not nvlink else r
    if r == "nvlink":
        certain = drop("nvlink_gbps", policy.throughput_drop)
        return Attribution("nvlink", [d + "/nvlink" for d in dev_gpu], ev + [_ev(s, "nvlink_gbps")], 1.0 if certain else 0.6)
    if r == "nic":
        certain = drop("nic_gbps", policy.throughput_drop)
        hosts = _unique(s.hosts)
        switches = _unique(s.switches)
        if len(hosts) > 1 and len(switches) == 1:
            return Attribution("switch", switches, ev + [_ev(s, "nic_gbps")], 0.95 if certain else 0.6)
        return Attribution("nic", _unique(s.nics) or dev_host, ev + [_ev(s, "nic_gbps")], 1.0 if certain else 0.6)
    if r in ("cpu", "storage"):
        if rise("cpu_other", policy.cpu_other_rise):
            return Attribution("host_cpu_contention", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "cpu_self")], 1.0)
        if memory_pressure():
            return Attribution("host_memory", dev_host, ev + [_ev(s, "mem_used_frac")], 0.9)
        if r == "storage" or (s.kind == "dataloader" and drop("disk_read_mbps", policy.throughput_drop)):
            return Attribution("storage", dev_host, ev + [_ev(s, "disk_read_mbps")], 0.85 if drop("disk_read_mbps", policy.throughput_drop) else 0.6)
        if s.kind == "dataloader":
            return Attribution("dataloader", dev_host, ev + [_ev(s, "cpu_self")], 0.9 * hw)
        if rank_specific:
            return Attribution("rank_specific_code", dev_host, ev + [_present(s)], 0.9)
        more = more_input()
        if extra_code and not more:
            return Attribution("rank_specific_code", dev_host, ev + [_present(s)], 0.85)
        if more:
            return Attribution("input_imbalance", dev_host, ev + more, 0.75)
        if s.kind == "python":
            return Attribution("python_overhead", dev_host, ev + [_ev(s, "calls"), _ev(s, "cpu_self")], 0.7 * hw)
        if not s.has_hardware:  # CPU work slower than on the peers, nothing to tell why: contention is likeliest
            return Attribution("host_cpu_contention", dev_host, ev, 0.45)
        return Attribution("unknown", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "cpu_self")], 0.4)
    if rank_specific:
        return Attribution("rank_specific_code", dev_gpu or dev_host, ev + [_present(s)], 0.7)
    return Attribution("unknown", dev_gpu or dev_host, ev, 0.4)


def _present(s: Suspect) -> Evidence:
    return Evidence(feature="workers_running_it", value=float(s.present), peer_value=float(s.peers), deviation=_round(s.present / s.peers if s.peers else math.nan))
