"""The hardware sampler: runs only during a profiling window, on its own threads.

A sample stamped ``t`` describes the sampling period before it (rates over the
interval since the previous sample; gauges as read at ``t``), as the summariser expects.
Each sample reads raw counters only (a few small /proc files, ``time.process_time``,
NVML queries) and appends them to lists; rates and units are computed once, after
the window, by the pure, vectorised :func:`host_metrics` and the NVML conversions.
PCIe throughput comes from an NVML query that measures for 20 ms inside the
driver, so it has a thread of its own and its own (lower) rate.

Metrics are the hardware columns of the function table (``schemas/functions.py``):
``sm_clock_mhz sm_active gpu_power_w gpu_temp_c clock_events pcie_gbps nvlink_gbps``
from NVML, ``nic_gbps cpu_self cpu_other mem_used_frac disk_read_mbps`` from /proc.
Without a usable GPU the sampler records the host only and says so once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...schemas.events import SAMPLE_SCHEMA
from . import nvml as nvml_mod

log = logging.getLogger("lockstep.agent")

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_said_host_only = False


# --------------------------------------------------------------------------- raw counters (/proc)


def parse_cpu_jiffies(stat: bytes, cores: frozenset[int] | None) -> tuple[int, int]:
    """(busy, total) jiffies summed over ``cores`` (all cores if None) from /proc/stat."""
    busy = total = 0
    for line in stat.split(b"\n"):
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        if cores is not None and int(name[3:]) not in cores:
            continue
        values = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        t = sum(values)
        total += t
        busy += t - values[3] - values[4]
    return busy, total


def parse_meminfo(meminfo: bytes) -> float:
    """Share of memory in use (1 - MemAvailable / MemTotal)."""
    vals = {}
    for line in meminfo.split(b"\n")[:8]:
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            vals[key] = int(rest.split()[0])
    return 1.0 - vals[b"MemAvailable"] / vals[b"MemTotal"] if len(vals) == 2 and vals[b"MemTotal"] else float("nan")


def parse_disk_read_bytes(diskstats: bytes, disks: frozenset[str]) -> int:
    """Bytes read from whole disks (not partitions) from /proc/diskstats."""
    total = 0
    for line in diskstats.split(b"\n"):
        f = line.split()
        if len(f) > 5 and f[2].decode() in disks:
            total += int(f[5]) * 512  # sectors read, always 512-byte units
    return total


def parse_net_bytes(netdev: bytes, nics: frozenset[str] | None) -> int:
    """Received + sent bytes of ``nics`` (all but loopback if None) from /proc/net/dev."""
    total = 0
    for line in netdev.split(b"\n")[2:]:
        name, sep, rest = line.partition(b":")
        if not sep:
            continue
        name_s = name.strip().decode()
        if (nics is None and name_s != "lo") or (nics is not None and name_s in nics):
            f = rest.split()
            total += int(f[0]) + int(f[8])
    return total


PROC_FILES = ("/proc/stat", "/proc/meminfo", "/proc/diskstats", "/proc/net/dev")


class HostReader:
    """Reads the host's raw counters; everything it cannot read is NaN.

    The /proc files stay open and are re-read with ``pread`` at offset 0 (half the cost
    of opening them for every sample).
    """

    def __init__(self, nic: str = ""):
        try:
            self.cores: frozenset[int] | None = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cores = None
        self.n_cores = len(self.cores) if self.cores else (os.cpu_count() or 1)
        block = Path("/sys/block")
        self.disks = frozenset(p.name for p in block.iterdir() if not p.name.startswith(("loop", "ram"))) if block.is_dir() else frozenset()
        self.ib_counters = self._ib_counters(nic)
        self.nics = frozenset({nic}) if nic and not self.ib_counters else None
        self._fds: dict[str, int] = {}
        for path in PROC_FILES + tuple(map(str, self.ib_counters)):
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError:
                pass  # that metric stays NaN

    def _read(self, path: str) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            raise OSError(f"{path} is not readable")
        data = os.pread(fd, 1 << 16, 0)  # enough: the cpu lines of /proc/stat come first, before the long "intr" line
        return data if len(data) < 1 << 16 else data[: data.rfind(b"\n")]  # whole lines only

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    @staticmethod
    def _ib_counters(nic: str) -> list[Path]:
        """InfiniBand HCAs count 4-byte words in sysfs, not in /proc/net/dev."""
        ports = Path("/sys/class/infiniband") / nic / "ports" if nic else None
        if ports is None or not ports.is_dir():
            return []
        return [c for p in ports.iterdir() for c in (p / "counters" / "port_xmit_data", p / "counters" / "port_rcv_data") if c.exists()]

    def read(self) -> tuple[float, float, float, float, float, float]:
        """(busy s, total s) on the worker's cores, memory share, disk bytes read, NIC bytes, process CPU s."""
        nan = float("nan")
        try:
            busy, total = parse_cpu_jiffies(self._read("/proc/stat"), self.cores)
            busy_s, total_s = busy / CLK_TCK, total / CLK_TCK
        except (OSError, ValueError):
            busy_s = total_s = nan
        try:
            mem = parse_meminfo(self._read("/proc/meminfo"))
        except (OSError, ValueError):
            mem = nan
        try:
            disk = float(parse_disk_read_bytes(self._read("/proc/diskstats"), self.disks))
        except (OSError, ValueError):
            disk = nan
        try:
            if self.ib_counters:
                net = float(sum(int(self._read(str(c))) for c in self.ib_counters) * 4)
            else:
                net = float(parse_net_bytes(self._read("/proc/net/dev"), self.nics))
        except (OSError, ValueError):
            net = nan
        return busy_s, total_s, mem, disk, net, time.process_time()


def host_metrics(t_s: np.ndarray, raw: np.ndarray, sampler_cpu_s: np.ndarray, n_cores: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Host samples -> metric -> (t_s, value), vectorised over samples.

    ``raw`` holds one row per sample: busy s and total s on the worker's cores,
    memory share, disk bytes read, NIC bytes, this process's CPU s (what
    :meth:`HostReader.read` returns); ``sampler_cpu_s`` is the sampler thread's own
    CPU time, taken out of the process's so that the agent does not count itself.
    """
    t_s = np.asarray(t_s, dtype=np.float64)
    raw = np.asarray(raw, dtype=np.float64).reshape(-1, 6)
    if t_s.size < 2:
        return {}
    end = t_s[1:]  # a rate describes the interval before its stamp
    dt = np.diff(t_s)
    d = np.diff(raw, axis=0)
    d_self = d[:, 5] - np.diff(np.asarray(sampler_cpu_s, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        ok = dt > 0
        cpu_self = np.where(ok, np.clip(d_self, 0, None) / dt, np.nan)
        # other processes: busy time on the worker's cores minus this process's, as a share of those cores
        wall_cores = np.where(d[:, 1] > 0, d[:, 1], dt * n_cores)
        cpu_other = np.where(ok, np.clip((d[:, 0] - d[:, 5]) / wall_cores, 0.0, 1.0), np.nan)
        disk = np.where(ok & (d[:, 3] >= 0), d[:, 3] / dt / 1e6, np.nan)
        nic = np.where(ok & (d[:, 4] >= 0), d[:, 4] / dt / 1e9, np.nan)
    out = {
        "cpu_self": (end, cpu_self),
        "cpu_other": (end, cpu_other),
        "mem_used_frac": (t_s, raw[:, 2]),
        "disk_read_mbps": (end, disk),
        "nic_gbps": (end, nic),
    }
    return {k: (t, v) for k, (t, v) in out.items() if np.isfinite(v).any()}


def to_table(worker: int, metrics: dict[str, tuple[np.ndarray, np.ndarray]]) -> pa.Table:
    """metric -> (t_s unix, value) -> the hardware-sample table (t_us unix microseconds)."""
    items = [(m, t, v) for m, (t, v) in sorted(metrics.items()) if len(t)]
    if not items:
        return SAMPLE_SCHEMA.empty_table()
    t_us = np.concatenate([t for _, t, _ in items]) * 1e6
    values = np.concatenate([v for _, _, v in items]).astype(np.float64)
    names = pa.DictionaryArray.from_arrays(
        np.repeat(np.arange(len(items), dtype=np.int32), [len(t) for _, t, _ in items]), pa.array([m for m, _, _ in items])
    ).cast(pa.string())
    keep = np.isfinite(values)
    table = pa.table(
        {"worker": np.full(values.size, worker, dtype=np.int64), "t_us": t_us, "metric": names, "value": values}, schema=SAMPLE_SCHEMA
    )
    return table.filter(pa.array(keep)) if not keep.all() else table


# --------------------------------------------------------------------------- the sampler


@dataclass
class SamplerStats:
    source: str  # "nvml" or "host"
    hz_requested: float
    samples: int
    seconds: float
    cpu_s: float  # CPU time of the sampler's threads

    @property
    def hz_achieved(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        """Share of one core the sampler used while it ran."""
        return self.cpu_s / self.seconds if self.seconds > 0 else 0.0


class HardwareSampler:
    """Samples the host (and the worker's GPU through NVML, when there is one) at ``hz`` until stopped."""

    def __init__(self, worker: int, hz: float, *, nic: str = "", gpu_uuid: str = "", gpu_index: int | None = None, use_gpu: bool = True):
        global _said_host_only
        self.worker = worker
        self.hz = hz
        self.host = HostReader(nic)
        self.gpu = nvml_mod.NvmlDevice.open(gpu_uuid, gpu_index) if use_gpu else None
        if self.gpu is None and not _said_host_only:
            _said_host_only = True
            log.info("hardware sampler: no GPU through NVML (%s); sampling the host only", nvml_mod.unavailable_reason() or "not requested")
        self.source = "nvml" if self.gpu is not None else "host"
        self._stop = threading.Event()
        self._t: list[float] = []
        self._host: list[tuple] = []
        self._self_cpu: list[float] = []
        self._gpu: list[nvml_mod.NvmlReading] = []
        self._pcie: list[tuple[float, float, float]] = []
        self._cpu_main = self._cpu_pcie = 0.0
        self._threads: list[threading.Thread] = []
        self._t0 = self._t1 = 0.0

    def start(self) -> HardwareSampler:
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._run, name="lockstep-sampler", daemon=True)]
        if self.gpu is not None:
            self._threads.append(threading.Thread(target=self._run_pcie, name="lockstep-sampler-pcie", daemon=True))
        for t in self._threads:
            t.start()
        return self

    @property
    def native_ids(self) -> frozenset[int]:
        return frozenset(t.native_id for t in self._threads if t.native_id is not None)

    def _run(self) -> None:
        period = 1.0 / self.hz
        next_t = time.monotonic()
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            self._t.append(time.time())
            self._host.append(self.host.read())
            if self.gpu is not None:
                self._gpu.append(self.gpu.read())
            self._self_cpu.append(time.thread_time() - cpu0)
            next_t += period
            delay = next_t - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_t = time.monotonic()  # fell behind: do not try to catch up
        self._cpu_main = time.thread_time() - cpu0

    def _run_pcie(self) -> None:
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            tx, rx = self.gpu.read_pcie()  # type: ignore[union-attr]
            self._pcie.append((time.time(), tx, rx))
            self._stop.wait(0.05)
        self._cpu_pcie = time.thread_time() - cpu0

    def stop(self) -> tuple[pa.Table, SamplerStats]:
        """Stop sampling; the samples as a SAMPLE_SCHEMA table (``t_us`` unix microseconds) and the sampler's cost."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.host.close()
        self._t1 = time.monotonic()
        t_s = np.asarray(self._t, dtype=np.float64)
        metrics = host_metrics(t_s, np.asarray(self._host, dtype=np.float64), np.asarray(self._self_cpu), self.host.n_cores)
        if self._gpu:
            g = np.asarray(self._gpu, dtype=np.float64)
            cols = {f: g[:, i] for i, f in enumerate(nvml_mod.NvmlReading._fields)}
            metrics.update(nvml_mod.fast_metrics(t_s[: len(g)], cols))
        if self._pcie:
            p = np.asarray(self._pcie, dtype=np.float64)
            metrics.update(nvml_mod.pcie_metrics(p[:, 0], p[:, 1], p[:, 2]))
        stats = SamplerStats(self.source, self.hz, len(self._t), self._t1 - self._t0, self._cpu_main + self._cpu_pcie)
        return to_table(self.worker, metrics), stats
