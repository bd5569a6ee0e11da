"""What each evidence feature means, its unit, and numbers for people (pure; the CLI tables and the report).

Evidence features are function-table columns (schemas/arrow/function_table.txt) or figures the
diagnosis derives (``work_us``, ``share``, ...); ``work_us[fn]`` is ``work_us`` of another function.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    label: str
    unit: str  # us | MHz | °C | W | GB/s | MB/s | B | cores | share | bits | "" (a count)
    meaning: str


FEATURES: dict[str, Feature] = {
    "work_us": Feature(
        "work", "us", "time of the function on the worker's critical path per step, waits for peers excluded"
    ),
    "group_work_us": Feature("group work", "us", "the group's work per step (median over its workers)"),
    "calls": Feature("calls", "", "executions of the function per step"),
    "bytes": Feature("bytes moved", "B", "bytes the function moved per step (collectives, copies, reads)"),
    "input_bytes": Feature("input batch", "B", "bytes the worker copied to its device per step: the size of its input"),
    "sm_clock_mhz": Feature("SM clock", "MHz", "the GPU's streaming-multiprocessor clock while the function ran"),
    "sm_active": Feature("SM active", "share", "share of the time the GPU's SMs were busy while the function ran"),
    "gpu_power_w": Feature("GPU power", "W", "board power while the function ran"),
    "gpu_temp_c": Feature("GPU temperature", "°C", "GPU temperature while the function ran"),
    "clock_events": Feature(
        "clock events",
        "bits",
        "NVML clock-event (throttle) reasons seen while the function ran, not shared by most peers",
    ),
    "pcie_gbps": Feature("PCIe", "GB/s", "PCIe throughput of the worker's GPU while the function ran"),
    "nvlink_gbps": Feature("NVLink", "GB/s", "NVLink throughput of the worker's GPU while the function ran"),
    "nic_gbps": Feature("NIC", "GB/s", "throughput of the worker's NIC or bond while the function ran"),
    "cpu_self": Feature("CPU, the worker", "cores", "CPU the worker's own process used while the function ran"),
    "cpu_other": Feature(
        "CPU, others", "share", "share of the host's cores that other processes used while the function ran"
    ),
    "mem_used_frac": Feature("host memory", "share", "share of the host's memory in use"),
    "disk_read_mbps": Feature("disk reads", "MB/s", "the host's disk reads while the function ran"),
    "share": Feature(
        "share of the step", "share", "the function's share of the step's critical path (median over the steps)"
    ),
    "workers_running_it": Feature(
        "workers running it", "", "workers that ran the function at all, against the peer group's size"
    ),
    "own_work_us": Feature(
        "own work", "us", "the worker's own work per step: the step minus its waits at collectives (median over steps)"
    ),
    "wait_us": Feature("waits", "us", "time the worker waited at collectives per step (median over steps)"),
    "job_noise": Feature(
        "shift vs the job's noise",
        "share",
        "the worker's own work above its peers' (relative), against how much a worker's varies from step to step",
    ),
    "last_step": Feature(
        "last step", "", "the last training step the worker finished (a hang: against the majority's)"
    ),
    "collective_seq": Feature(
        "collective", "", "sequence number of the last collective the worker entered and has not returned from"
    ),
    "answered": Feature("answered", "", "workers that answered the hang trigger, against those expected"),
    "healthy_windows": Feature("healthy windows", "", "earlier healthy windows of the job this one was compared with"),
    "baseline_work_us": Feature(
        "work vs the job's past",
        "us",
        "the worker's work now, against its group's in the job's earlier healthy windows",
    ),
    "nic_gbps_sd": Feature(
        "NIC spread",
        "GB/s",
        "standard deviation of the NIC throughput samples while the function ran: a saturated link is steady, its ring-mates burst",
    ),
    "nic_gbps_p95": Feature("NIC peak", "GB/s", "95th percentile of the NIC throughput samples while the function ran"),
    "nvlink_gbps_sd": Feature(
        "NVLink spread",
        "GB/s",
        "standard deviation of the NVLink throughput samples while the function ran: a saturated link is steady, its ring-mates burst",
    ),
    "nvlink_gbps_p95": Feature(
        "NVLink peak", "GB/s", "95th percentile of the NVLink throughput samples while the function ran"
    ),
    "tcp_retrans_share": Feature(
        "TCP sent again",
        "share",
        "share of the data segments its lossy TCP connections sent again in the window, against the others' median",
    ),
    "lossy_peers": Feature("lossy peers", "", "workers at the other end of its lossy TCP connections"),
    "rtt_us": Feature(
        "TCP RTT", "us", "smoothed round-trip time of its lossy or slow TCP connections at the window's end"
    ),
    "tcp_busy_mbps": Feature(
        "TCP busy throughput",
        "MB/s",
        "bytes its fastest TCP connection to a peer sent per second of data in flight, against the others' median",
    ),
    "slow_peers": Feature("slow peers", "", "workers at the other end of its slow TCP connections"),
}

#: NVML clock-event reason bits (nvmlClocksEventReasons)
CLOCK_EVENTS = {
    0x1: "GPU idle",
    0x2: "applications clocks",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
    0x100: "display clock",
}


def feature(name: str) -> Feature:
    """``work_us[bwd.gemm]`` is ``work_us`` of bwd.gemm; unknown names stand for themselves."""
    base, _, fn = name.partition("[")
    f = FEATURES.get(base)
    if f is None:
        return Feature(name, "", "")
    return Feature(f"{f.label} of {fn.rstrip(']')}", f.unit, f.meaning) if fn else f


def number(v: float | int | None, digits: int = 3) -> str:
    """1,522 · 105.9 · 0.0356 · < 0.0001: thousands separators, about ``digits`` significant digits, never an
    exponent (a figure below 0.0001 is "< 0.0001": callers with a unit scale it first, as :func:`hours`)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) or (float(v).is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    a = abs(v)
    if a >= 10 ** (digits - 1):
        return f"{v:,.0f}"
    if a >= 1e-4:
        decimals = max(0, digits - 1 - math.floor(math.log10(a)))
        return f"{v:,.{decimals}f}".rstrip("0").rstrip(".")
    return "< 0.0001" if v > 0 else "> -0.0001"  # people read a tiny figure as about nothing, not as 4.1e-06


def hours(v: float | None, unit: str = "GPU") -> str:
    """Device-hours for people, in the unit that keeps the figure readable: ``285 GPU-h``, ``12 GPU-min``,
    ``15 CPU-s``; ``unit`` is the device (GPU, CPU, device)."""
    if v is None or not math.isfinite(v):
        return "-"
    a = abs(v)
    if a == 0 or a >= 0.1:
        return f"{number(v)} {unit}-h"
    if a * 60 >= 1:
        return f"{number(v * 60)} {unit}-min"
    if a * 3600 >= 0.001:
        return f"{number(v * 3600)} {unit}-s"
    return f"< 1 {unit}-ms"


def unit_label(unit: str) -> str:
    """A feature's unit as people write it (``us`` is the code's spelling of µs; a count has none)."""
    return {"us": "µs", "": "count"}.get(unit, unit)


def duration_us(us: float) -> str:
    a = abs(us)
    if a >= 1e6:
        return f"{us / 1e6:.3g} s"
    if a >= 1e3:
        return f"{us / 1e3:,.1f} ms"
    return f"{number(us)} µs"


def size(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{number(b)} B"


def clock_events(bits: int) -> str:
    names = [name for bit, name in CLOCK_EVENTS.items() if bits & bit]
    return f"0x{bits:x} ({', '.join(names)})" if names else ("none" if bits == 0 else f"0x{bits:x}")


def with_unit(unit: str, v: float | None) -> str:
    """A value in its unit, for people."""
    if v is None or not math.isfinite(v):
        return "-"
    if unit == "us":
        return duration_us(v)
    if unit == "B":
        return size(v)
    if unit == "share":
        return f"{v * 100:.1f}%" if abs(v) < 0.1 else f"{v * 100:.0f}%"
    if unit == "bits":
        return clock_events(int(v))
    if unit == "":
        return number(v)
    if unit == "°C":
        return f"{v:.1f} °C"
    return f"{number(v)} {unit}"


def value(name: str, v: float | None) -> str:
    """An evidence feature's value in its unit (``work_us`` 105885.0 -> ``105.9 ms``)."""
    return with_unit(feature(name).unit, v)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 scenario``, ``2 scenarios``, ``1,024 workers``."""
    return f"{number(n)} {word if n == 1 else many or word + 's'}"


def joined(items: Iterable[object], limit: int = 8) -> str:
    """``0, 5, 13`` (lists joined; ``… (+12)`` beyond ``limit``)."""
    items = list(items)
    text = ", ".join(str(x) for x in items[:limit])
    return text + (f" … (+{len(items) - limit})" if len(items) > limit else "")


#: the evidence features that decided each cause, first the one that decided it (the rules of
#: ``streams/diagnosis/causes.py``): the evidence is shown in this order, then the work, then the rest
DECIDED_BY: dict[str, tuple[str, ...]] = {
    "gpu_throttle_thermal": ("clock_events", "sm_clock_mhz", "gpu_temp_c"),
    "gpu_throttle_power": ("clock_events", "sm_clock_mhz", "gpu_power_w"),
    "gpu_throttle": ("sm_clock_mhz", "clock_events"),
    "gpu_slow": ("work_us", "sm_clock_mhz", "sm_active"),  # slower at the same clock
    "pcie": ("pcie_gbps",),
    "nvlink": ("nvlink_gbps_sd", "nvlink_gbps_p95", "nvlink_gbps"),  # steady while the ring-mates burst
    "nic": (
        "tcp_retrans_share",
        "lossy_peers",
        "tcp_busy_mbps",
        "slow_peers",
        "nic_gbps_sd",
        "nic_gbps_p95",
        "nic_gbps",
    ),
    "switch": ("nic_gbps_sd", "nic_gbps_p95", "nic_gbps"),
    "host_cpu_contention": ("cpu_other", "cpu_self"),
    "host_memory": ("mem_used_frac",),
    "storage": ("disk_read_mbps",),
    "dataloader": ("cpu_other", "disk_read_mbps", "cpu_self"),
    "input_imbalance": ("input_bytes", "bytes", "calls"),
    "rank_specific_code": ("workers_running_it", "work_us"),
    "python_overhead": ("work_us", "cpu_other", "calls"),
    "regression": ("baseline_work_us", "healthy_windows"),
    "hang": ("last_step", "collective_seq", "answered"),
    "worker_died": ("answered",),
}


def decided_order(cause: str, features: list[str]) -> list[int]:
    """The order to show evidence in (indices into ``features``): what decided ``cause`` first, then the work
    against the peers', then the rest as the diagnosis gave them (``undetermined`` and ``unknown`` lead with the
    work: no characteristic decided them)."""
    deciding = DECIDED_BY.get(cause, ())

    def rank(i: int) -> tuple[int, int]:
        base = features[i].partition("[")[0]
        if features[i] in deciding:
            return (0, deciding.index(features[i]))
        if base == "work_us":
            return (1, 0)
        return (2, i)

    return sorted(range(len(features)), key=rank)
