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
    """1,522 · 105.9 · 0.0356 · 4.1e-07: thousands separators, about ``digits`` significant digits, no exponent
    unless the number is tiny."""
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
    return f"{v:.1e}"


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
