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
| cpu      | (not data loading) far less CPU than the peers got (they use >= 0.1 core in it), others as busy | host_cpu_contention |
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
from collections.abc import Callable
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
    holds_step: bool = False  # its work (the step minus its waits) was the step's highest in most flagged steps


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


#: a function is CPU work where the peers use at least this share of a core in it (``cpu_self``): only then can a worker's
#: lower share say that it waited to run.  A live job's 4 ms sleep ran at 0.05 of a core on the peers, 0.015 on the
#: rank that slept 34 ms (no starvation: its own code); forward, CPU work, at 0.19 on the peers of a rank starved by
#: another process, four ranks and a busy loop sharing two loaded cores (``tests/data/real/contention.parquet``)
CPU_BOUND_MIN = 0.1

#: certainty of an ``undetermined`` cause: the worker, function and device are as sure as any, the cause is not named
#: (the cause says so); the finding's confidence is about where the fault is, and a localised fault must page
UNDETERMINED_CERTAINTY = 0.8


def classify(s: Suspect, policy: DiagnosisPolicy) -> Attribution:
    """The cause of ``s``, decided by the rules of the function's own resource (the table above, one function per
    resource)."""
    return RULES.get(s.resource, _other)(_Facts(s, policy))


@dataclass(frozen=True)
class _Facts:
    """One suspect's evidence as the rules read it."""

    s: Suspect
    policy: DiagnosisPolicy

    def work(self) -> list[Evidence]:
        """The evidence every attribution starts with: the work against the peers' (a new list)."""
        s = self.s
        # the deviation of work is its robust z; a comparison by ratio has none (the ratio is value / peer value)
        z = None if s.signal == "ratio" else _round(s.z)
        return [Evidence(feature="work_us", value=_round(s.work_us), peer_value=_round(s.peer_work_us), deviation=z)]

    def ev(self, *names: str) -> list[Evidence]:
        """The work, then these characteristics against the peers'."""
        return self.work() + [_ev(self.s, n) for n in names]

    @property
    def gpus(self) -> list[str]:
        return _unique(self.s.devices)

    @property
    def hosts(self) -> list[str]:
        return _unique(self.s.hosts)

    @property
    def rank_specific(self) -> bool:
        """Few of the peers run the function at all."""
        return self.s.peers > 0 and self.s.present <= self.policy.rank_specific_present * self.s.peers

    @property
    def extra_code(self) -> bool:
        """Several times the peers' time in one function: the worker runs code there its peers do not (logging,
        evaluation, checkpointing on one rank), if the host is not the reason; interpreter or GC overhead slows
        Python by a fraction."""
        s = self.s
        return s.peer_work_us > 0 and s.work_us >= self.policy.rank_specific_ratio * s.peer_work_us

    def has(self, *names: str) -> bool:
        v, p = self.s.values, self.s.peer_values
        return all(math.isfinite(v.get(n, math.nan)) and math.isfinite(p.get(n, math.nan)) for n in names)

    def drop(self, name: str, limit: float) -> bool:
        d = _rel(self.s.values.get(name, math.nan), self.s.peer_values.get(name, math.nan))
        return math.isfinite(d) and d < -limit

    def rise(self, name: str, limit: float) -> bool:
        v, p = self.s.values.get(name, math.nan), self.s.peer_values.get(name, math.nan)
        return math.isfinite(v) and math.isfinite(p) and v - p > limit

    def more_input(self) -> list[Evidence]:
        """The function's calls or bytes, or the worker's input batch, well above the peers': the evidence, else []."""
        s = self.s
        rising = [
            c
            for c in ("calls", "bytes", "input_bytes")
            if _rel(s.values.get(c, math.nan), s.peer_values.get(c, math.nan)) > self.policy.input_rise
        ]
        return [_ev(s, c) for c in rising]

    def memory_pressure(self) -> bool:
        return self.s.values.get("mem_used_frac", 0.0) > self.policy.mem_high and self.rise("mem_used_frac", 0.05)

    def undetermined(self, devices: list[str], needs: tuple[str, ...], between: str) -> Attribution:
        missing = [n for n in needs if not self.has(n)] or list(needs)
        return Attribution(
            "undetermined",
            devices,
            self.ev(*missing),
            UNDETERMINED_CERTAINTY,
            f"no {', '.join(missing)} samples, which would tell {between}",
        )


def _gpu(f: _Facts) -> Attribution:
    """Kernels: a throttled clock (and its reasons), more input, or a GPU slow at the same clock."""
    s, policy = f.s, f.policy
    if f.drop("sm_clock_mhz", policy.clock_drop):
        bits = s.clock_events & ~s.peer_clock_events
        if bits & THERMAL_BITS:
            cause, extra = "gpu_throttle_thermal", ["gpu_temp_c"]
        elif bits & POWER_BITS:
            cause, extra = "gpu_throttle_power", ["gpu_power_w"]
        else:
            cause, extra = "gpu_throttle", []
        events = Evidence(
            feature="clock_events",
            value=float(s.clock_events),
            peer_value=float(s.peer_clock_events),
            deviation=float(bits),
        )
        return Attribution(cause, f.gpus, [*f.ev("sm_clock_mhz", *extra), events], 1.0 if bits else 0.85)
    if more := f.more_input():
        return Attribution("input_imbalance", f.gpus, f.work() + more, 0.9)
    if f.has("sm_clock_mhz"):
        return Attribution("gpu_slow", f.gpus, f.ev("sm_clock_mhz", "sm_active"), 0.9)
    return f.undetermined(
        f.gpus, ("sm_clock_mhz",), "a throttled GPU (clock and clock-event reasons from NVML) from a slow one"
    )


def _pcie(f: _Facts) -> Attribution:
    """Host/device copies: the link's throughput, else the host (CPU, memory), else more input."""
    policy = f.policy
    pcie = [d + "/pcie" for d in f.gpus]
    if f.drop("pcie_gbps", policy.throughput_drop):
        return Attribution("pcie", pcie, f.ev("pcie_gbps"), 1.0)
    if f.rise("cpu_other", policy.cpu_other_rise):
        return Attribution("host_cpu_contention", f.hosts, f.ev("cpu_other"), 0.8)
    if f.memory_pressure():
        return Attribution("host_memory", f.hosts, f.ev("mem_used_frac"), 0.8)
    if more := f.more_input():
        return Attribution("input_imbalance", f.gpus, f.work() + more, 0.75)
    if f.has("pcie_gbps", "cpu_other"):
        return Attribution("unknown", pcie, f.ev("pcie_gbps", "cpu_other"), 0.4)
    return f.undetermined(pcie, ("pcie_gbps", "cpu_other"), "a degraded PCIe link from a busy host")


def _link(f: _Facts) -> Attribution:
    """Collectives: the link saturated while its ring-mates' burst; a hierarchical collective runs over NVLink and
    the NICs, and the link that shows it decides; several hosts behind one switch name the switch."""
    s, policy = f.s, f.policy
    nvlink, nic = _link_down(s, "nvlink_gbps", policy), _link_down(s, "nic_gbps", policy)
    r = "nvlink" if nvlink and not nic else "nic" if nic and not nvlink else s.resource
    metric = f"{r}_gbps"
    shape = (metric, f"{metric}_sd", f"{metric}_p95")
    if not _link_down(s, metric, policy):
        devices = [d + "/nvlink" for d in f.gpus] if r == "nvlink" else _unique(s.nics) or f.hosts
        if f.has(*shape):
            return Attribution("unknown", devices, f.ev(*shape), 0.4)
        return f.undetermined(
            devices, shape, "whose link held the collective back (its samples steady while its ring-mates' burst)"
        )
    if r == "nvlink":
        return Attribution("nvlink", [d + "/nvlink" for d in f.gpus], f.ev(*shape), 1.0)
    switches = _unique(s.switches)
    if len(f.hosts) > 1 and len(switches) == 1:
        return Attribution("switch", switches, f.ev(*shape), 0.95)
    return Attribution("nic", _unique(s.nics) or f.hosts, f.ev(*shape), 1.0)


#: what tells a host's own problem from the worker's
HOST = ("cpu_other", "mem_used_frac")


def _host(f: _Facts) -> Attribution:
    """CPU work and storage: the host (other processes, memory), data loading and storage, then the worker's own
    code (:func:`_own_code`)."""
    s, policy = f.s, f.policy
    if f.rise("cpu_other", policy.cpu_other_rise):
        return Attribution("host_cpu_contention", f.hosts, f.ev("cpu_other", "cpu_self"), 1.0)
    if f.memory_pressure():
        return Attribution("host_memory", f.hosts, f.ev("mem_used_frac"), 0.9)
    if s.resource != "storage" and s.kind != "dataloader":
        return _own_code(f)
    reads = (
        s.peer_values.get("disk_read_mbps", 0.0) >= policy.disk_read_min_mbps
    )  # the peers read: a drop means something
    if reads and f.drop("disk_read_mbps", policy.throughput_drop):
        return Attribution("storage", f.hosts, f.ev("disk_read_mbps"), 0.85)
    if not f.has(*HOST, "disk_read_mbps"):
        return f.undetermined(
            f.hosts, (*HOST, "disk_read_mbps"), "a slow loader from a busy host, memory pressure or slow storage"
        )
    if s.resource == "storage":
        return Attribution("unknown", f.hosts, f.ev("disk_read_mbps", "cpu_other"), 0.4)
    return Attribution("dataloader", f.hosts, f.ev("cpu_other", "disk_read_mbps", "cpu_self"), 0.9)


def _own_code(f: _Facts) -> Attribution:
    """CPU work other than loading on a host that is not the reason: code on few ranks, more input, a worker that
    waited to run, code its peers do not run, Python overhead."""
    s, policy = f.s, f.policy
    if f.rank_specific:
        return Attribution("rank_specific_code", f.hosts, [*f.work(), _present(s)], 0.9)
    if more := f.more_input():
        return Attribution("input_imbalance", f.hosts, f.work() + more, 0.75)
    # CPU work that got far less of a core than on the peers while other processes took at least as much of the
    # host: the worker waited to run (a host busy anyway hides the rise of cpu_other, not the worker's starvation).
    # CPU work: the peers use at least CPU_BOUND_MIN of a core in it; in a function that sleeps or blocks everywhere
    # (0.05 of a core on the peers), less CPU says nothing of a wait to run
    if (
        f.drop("cpu_self", policy.cpu_self_drop)
        and s.peer_values.get("cpu_self", math.nan) >= CPU_BOUND_MIN
        and s.values.get("cpu_other", math.nan) >= s.peer_values.get("cpu_other", math.inf)
    ):
        return Attribution("host_cpu_contention", f.hosts, f.ev("cpu_self", "cpu_other"), 0.75)
    if not f.has(*HOST):
        what = (
            "code the worker runs alone"
            if f.extra_code
            else "Python overhead"
            if s.kind == "python"
            else "the worker's own work"
        )
        return f.undetermined(f.hosts, HOST, f"{what} from a busy host")
    if f.extra_code:
        return Attribution("rank_specific_code", f.hosts, f.ev("cpu_other", "mem_used_frac"), 0.85)
    if s.kind == "python":
        return Attribution("python_overhead", f.hosts, f.ev("calls", "cpu_other", "cpu_self"), 0.7)
    return Attribution("unknown", f.hosts, f.ev("cpu_other", "cpu_self"), 0.4)


def _other(f: _Facts) -> Attribution:
    """Any other resource: code few ranks run, else unknown."""
    if f.rank_specific:
        return Attribution("rank_specific_code", f.gpus or f.hosts, [*f.work(), _present(f.s)], 0.7)
    return Attribution("unknown", f.gpus or f.hosts, f.work(), 0.4)


#: the function's resource -> the rules that name its cause
RULES: dict[str, Callable[[_Facts], Attribution]] = {
    "gpu": _gpu,
    "pcie": _pcie,
    "nic": _link,
    "nvlink": _link,
    "cpu": _host,
    "storage": _host,
}


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
    return Evidence(
        feature="workers_running_it",
        value=float(s.present),
        peer_value=float(s.peers),
        deviation=_round(s.present / s.peers if s.peers else math.nan),
    )
