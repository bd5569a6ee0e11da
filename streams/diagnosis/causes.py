"""Cause attribution from the function's own resource (brief 5, "Cause categories").

A suspect is one or more workers that persistently spent more *work* in one
function than their peers (or, for collectives, whose link was saturated while
its ring-mates' links burst).  Which hardware the function depends on decides
which characteristics are evidence: the SM clock for kernels, PCIe throughput
for copies, the shape of NIC or NVLink throughput for collectives, the host's
CPU, memory and disk for Python and data loading.  A cause is only named when
the evidence shown supports it: where the samples that would tell the
candidates apart are missing, the cause is ``undetermined`` (worker, function
and device still named) and the attribution says which samples would decide;
where they were taken and show nothing, ``unknown``.

| resource | evidence                                   | cause                                   |
|----------|--------------------------------------------|-----------------------------------------|
| gpu      | SM clock down, thermal / power event bits  | gpu_throttle_thermal / _power / gpu_throttle |
| gpu      | more calls, bytes or input than peers      | input_imbalance                         |
| gpu      | same clock (sampled), more time            | gpu_slow                                |
| gpu      | no SM clock samples                        | undetermined (NVML would decide)        |
| pcie     | PCIe throughput down                       | pcie (host_cpu_contention, host_memory when those deviate instead) |
| pcie     | more bytes or input                        | input_imbalance                         |
| nvlink   | link saturated (steady) while its ring-mates' burst | nvlink                         |
| nic      | the same; several hosts, one switch        | nic / switch                            |
| (either) | a collective over both: the link that shows it decides |                             |
| cpu      | other processes take the CPU               | host_cpu_contention                     |
| cpu      | (not data loading) far less CPU than the peers got, others as busy | host_cpu_contention     |
| cpu      | host memory nearly full                    | host_memory                             |
| cpu      | data loading with disk reads down (peers read) | storage                             |
| cpu      | data loading, host sampled and normal      | dataloader                              |
| cpu      | a function the peers do not run            | rank_specific_code                      |
| cpu      | several times the peers' time, same input, host CPU sampled and normal | rank_specific_code |
| cpu      | more calls, bytes or input                 | input_imbalance                         |
| cpu      | Python the peers run faster, host CPU sampled and normal | python_overhead           |
| any      | the deciding samples missing               | undetermined                            |
| any      | sampled, nothing deviates                  | unknown                                 |
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
    signal: str = "work"  # work | ratio | hardware (OUTLIER_SCHEMA's signal)
    peer_mad_us: float = math.nan
    baseline_us: float = math.nan  # the group's work in the function in the job's earlier healthy windows
    baseline_windows: int = 0


@dataclass
class Attribution:
    cause: str
    devices: list[str]
    evidence: list[Evidence]
    certainty: float  # how well the evidence supports the cause, 0..1
    undecided: str = ""  # undetermined: which samples would decide, and between what


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


#: certainty of an ``undetermined`` cause: the worker, function and device are as sure as any, the cause is not named
UNDETERMINED_CERTAINTY = 0.5


def classify(s: Suspect, policy: DiagnosisPolicy) -> Attribution:
    # the deviation of work is its robust z; a comparison by ratio has none (the ratio is value / peer value)
    ev = [Evidence(feature="work_us", value=_round(s.work_us), peer_value=_round(s.peer_work_us), deviation=None if s.signal == "ratio" else _round(s.z))]
    dev_gpu = _unique(s.devices)
    dev_host = _unique(s.hosts)
    r = s.resource
    rank_specific = 0 < s.peers and s.present <= policy.rank_specific_present * s.peers
    # several times the peers' time in one function: the worker runs code there its peers do not (logging,
    # evaluation, checkpointing on one rank), if the host is not the reason; interpreter or GC overhead slows Python
    # by a fraction
    extra_code = s.peer_work_us > 0 and s.work_us >= policy.rank_specific_ratio * s.peer_work_us

    def has(*names: str) -> bool:
        return all(math.isfinite(s.values.get(n, math.nan)) and math.isfinite(s.peer_values.get(n, math.nan)) for n in names)

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

    def undetermined(devices: list[str], needs: tuple[str, ...], between: str) -> Attribution:
        missing = [n for n in needs if not has(n)] or list(needs)
        return Attribution("undetermined", devices, ev + [_ev(s, n) for n in missing], UNDETERMINED_CERTAINTY,
                           f"no {', '.join(missing)} samples, which would tell {between}")  # fmt: skip

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
        if has("sm_clock_mhz"):
            return Attribution("gpu_slow", dev_gpu, ev + [_ev(s, "sm_clock_mhz"), _ev(s, "sm_active")], 0.9)
        return undetermined(dev_gpu, ("sm_clock_mhz",), "a throttled GPU (clock and clock-event reasons from NVML) from a slow one")
    if r == "pcie":
        pcie = [d + "/pcie" for d in dev_gpu]
        if drop("pcie_gbps", policy.throughput_drop):
            return Attribution("pcie", pcie, ev + [_ev(s, "pcie_gbps")], 1.0)
        if rise("cpu_other", policy.cpu_other_rise):
            return Attribution("host_cpu_contention", dev_host, ev + [_ev(s, "cpu_other")], 0.8)
        if memory_pressure():
            return Attribution("host_memory", dev_host, ev + [_ev(s, "mem_used_frac")], 0.8)
        if more := more_input():
            return Attribution("input_imbalance", dev_gpu, ev + more, 0.75)
        if has("pcie_gbps", "cpu_other"):
            return Attribution("unknown", pcie, ev + [_ev(s, "pcie_gbps"), _ev(s, "cpu_other")], 0.4)
        return undetermined(pcie, ("pcie_gbps", "cpu_other"), "a degraded PCIe link from a busy host")
    if r in ("nic", "nvlink"):  # a hierarchical collective runs over both: the link that shows it
        nvlink, nic = _link_down(s, "nvlink_gbps", policy), _link_down(s, "nic_gbps", policy)
        r = "nvlink" if nvlink and not nic else "nic" if nic and not nvlink else r
        metric = f"{r}_gbps"
        shape = [_ev(s, metric), _ev(s, f"{metric}_sd"), _ev(s, f"{metric}_p95")]
        if not _link_down(s, metric, policy):
            devices = [d + "/nvlink" for d in dev_gpu] if r == "nvlink" else _unique(s.nics) or dev_host
            if has(metric, f"{metric}_sd", f"{metric}_p95"):
                return Attribution("unknown", devices, ev + shape, 0.4)
            return undetermined(devices, (metric, f"{metric}_sd", f"{metric}_p95"), "whose link held the collective back (its samples steady while its ring-mates' burst)")
        if r == "nvlink":
            return Attribution("nvlink", [d + "/nvlink" for d in dev_gpu], ev + shape, 1.0)
        hosts = _unique(s.hosts)
        switches = _unique(s.switches)
        if len(hosts) > 1 and len(switches) == 1:
            return Attribution("switch", switches, ev + shape, 0.95)
        return Attribution("nic", _unique(s.nics) or dev_host, ev + shape, 1.0)
    host = ("cpu_other", "mem_used_frac")  # what tells a host's own problem from the worker's
    if r in ("cpu", "storage"):
        if rise("cpu_other", policy.cpu_other_rise):
            return Attribution("host_cpu_contention", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "cpu_self")], 1.0)
        if memory_pressure():
            return Attribution("host_memory", dev_host, ev + [_ev(s, "mem_used_frac")], 0.9)
        reads = s.peer_values.get("disk_read_mbps", 0.0) >= policy.disk_read_min_mbps  # the peers read: a drop means something
        if reads and drop("disk_read_mbps", policy.throughput_drop) and (r == "storage" or s.kind == "dataloader"):
            return Attribution("storage", dev_host, ev + [_ev(s, "disk_read_mbps")], 0.85)
        if r == "storage" or s.kind == "dataloader":
            if has(*host, "disk_read_mbps"):
                if r == "storage":
                    return Attribution("unknown", dev_host, ev + [_ev(s, "disk_read_mbps"), _ev(s, "cpu_other")], 0.4)
                return Attribution("dataloader", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "disk_read_mbps"), _ev(s, "cpu_self")], 0.9)
            return undetermined(dev_host, (*host, "disk_read_mbps"), "a slow loader from a busy host, memory pressure or slow storage")
        if rank_specific:
            return Attribution("rank_specific_code", dev_host, ev + [_present(s)], 0.9)
        if more := more_input():
            return Attribution("input_imbalance", dev_host, ev + more, 0.75)
        # CPU work that got far less of a core than on the peers while other processes took at least as much of the
        # host: the worker waited to run (a host busy anyway hides the rise of cpu_other, not the worker's starvation)
        if drop("cpu_self", policy.cpu_self_drop) and s.values.get("cpu_other", math.nan) >= s.peer_values.get("cpu_other", math.inf):
            return Attribution("host_cpu_contention", dev_host, ev + [_ev(s, "cpu_self"), _ev(s, "cpu_other")], 0.75)
        if not has(*host):
            what = "code the worker runs alone" if extra_code else "Python overhead" if s.kind == "python" else "the worker's own work"
            return undetermined(dev_host, host, f"{what} from a busy host")
        if extra_code:
            return Attribution("rank_specific_code", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "mem_used_frac")], 0.85)
        if s.kind == "python":
            return Attribution("python_overhead", dev_host, ev + [_ev(s, "calls"), _ev(s, "cpu_other"), _ev(s, "cpu_self")], 0.7)
        return Attribution("unknown", dev_host, ev + [_ev(s, "cpu_other"), _ev(s, "cpu_self")], 0.4)
    if rank_specific:
        return Attribution("rank_specific_code", dev_gpu or dev_host, ev + [_present(s)], 0.7)
    return Attribution("unknown", dev_gpu or dev_host, ev, 0.4)


def _link_down(s: Suspect, metric: str, policy: DiagnosisPolicy) -> bool:
    """The link behind ``metric`` held its collective back: saturated (spread well below its ring-mates') while its
    ring-mates burst (their spread high, or their peaks far above its own).  Its mean is no evidence: every member
    of a ring moves the same bytes in the same time."""
    v, p = s.values.get(metric, math.nan), s.peer_values.get(metric, math.nan)
    sd, psd = s.values.get(f"{metric}_sd", math.nan), s.peer_values.get(f"{metric}_sd", math.nan)
    if not (all(math.isfinite(x) and x > 0 for x in (v, p, psd)) and math.isfinite(sd)):
        return False
    peak_drop = _rel(s.values.get(f"{metric}_p95", math.nan), s.peer_values.get(f"{metric}_p95", math.nan))
    bursting = psd / p >= policy.link_burst_cv or (math.isfinite(peak_drop) and peak_drop < -policy.throughput_drop)
    return bursting and sd / v < policy.link_steady_ratio * psd / p


def _present(s: Suspect) -> Evidence:
    return Evidence(feature="workers_running_it", value=float(s.present), peer_value=float(s.peers), deviation=_round(s.present / s.peers if s.peers else math.nan))
