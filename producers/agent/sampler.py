"""The hardware sampler: a process of its own samples the training process's hardware during a window.

:class:`HardwareSampler` keeps the interface the agent has always used (``start()``, ``stop()``
-> samples table and cost), but the sampling itself runs in a separate process
(``probe.py``, pure Python, spawned with ``vfork``: about 0.3 ms in the calling thread): the
training process keeps no sampler thread, so no sample waits for or holds its GIL, at 10 kHz as
at 100 Hz.  The probe reads raw counters only; rates and units are computed here, once,
vectorised, after the window (:func:`host_metrics`, :func:`fast_host_metrics`, the NVML
conversions).

A sample stamped ``t`` describes the sampling period before it (rates over the interval since
the previous sample; gauges as read at ``t``), as the summariser expects.  Metrics are the
hardware columns of the function table (``schemas/functions.py``): ``sm_clock_mhz sm_active
gpu_power_w gpu_temp_c clock_events pcie_gbps nvlink_gbps`` from NVML, ``nic_gbps cpu_self`` at
the asked rate (up to 10 kHz), ``cpu_other mem_used_frac disk_read_mbps`` from /proc at up to
100 Hz (see ``probe.py`` for why each source has its rate).  Without a usable GPU the sampler
records the host only and says so once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...schemas.events import SAMPLE_SCHEMA
from ...schemas.records import HardwareSeen
from . import nvml as nvml_mod
from .probe import FAST, PCIE, parse_cpu_jiffies, parse_disk_read_bytes, parse_meminfo, parse_net_bytes

log = logging.getLogger("lockstep.agent")

__all__ = [
    "HardwareSampler",
    "SamplerStats",
    "fast_host_metrics",
    "host_metrics",
    "parse_cpu_jiffies",
    "parse_disk_read_bytes",
    "parse_meminfo",
    "parse_net_bytes",
    "to_table",
]

PROBE = Path(__file__).with_name("probe.py")
COLLECT_TIMEOUT_S = 10.0
_said_host_only = False


def host_metrics(
    t_s: np.ndarray, raw: np.ndarray, sampler_cpu_s: np.ndarray, n_cores: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Host samples -> metric -> (t_s, value), vectorised over samples.

    ``raw`` holds one row per sample: busy s and total s on the worker's cores,
    memory share, disk bytes read, NIC bytes, the training process's CPU s (the
    probe's slow tier); ``sampler_cpu_s`` is CPU time of the sampler inside that
    process, taken out of the process's (zero since the sampler is a process of its own).
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


def fast_host_metrics(
    t_s: np.ndarray, t_end_s: np.ndarray, nic_bytes: np.ndarray, proc_cpu_s: np.ndarray
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The probe's fast tier -> ``nic_gbps`` (GB/s, rx + tx) and ``cpu_self`` (cores) per interval, vectorised.

    Each reading happened between ``t_s`` and ``t_end_s`` and is stamped at the middle.  A reading
    that took far longer than the usual (more than 4 x the median + 20 us: the sampler process was
    preempted between the clock and the counters) is left out, so that its interval does not get
    another interval's bytes; the next interval then spans both.
    """
    t_s, t_end_s = np.asarray(t_s, dtype=np.float64), np.asarray(t_end_s, dtype=np.float64)
    took = t_end_s - t_s
    ok = took <= 4.0 * np.median(took) + 20e-6 if took.size else np.zeros(0, dtype=bool)
    t = (t_s[ok] + t_end_s[ok]) / 2
    out = {
        "nic_gbps": nvml_mod.rate(t, np.asarray(nic_bytes)[ok], 1e-9),
        "cpu_self": nvml_mod.rate(t, np.asarray(proc_cpu_s)[ok]),
    }
    return {k: (t, v) for k, (t, v) in out.items() if v.size and np.isfinite(v).any()}


def to_table(worker: int, metrics: dict[str, tuple[np.ndarray, np.ndarray]]) -> pa.Table:
    """metric -> (t_s unix, value) -> the hardware-sample table (t_us unix microseconds)."""
    items = [(m, t, v) for m, (t, v) in sorted(metrics.items()) if len(t)]
    if not items:
        return SAMPLE_SCHEMA.empty_table()
    t_us = np.concatenate([t for _, t, _ in items]) * 1e6
    values = np.concatenate([v for _, _, v in items]).astype(np.float64)
    names = pa.DictionaryArray.from_arrays(
        np.repeat(np.arange(len(items), dtype=np.int32), [len(t) for _, t, _ in items]),
        pa.array([m for m, _, _ in items]),
    ).cast(pa.string())
    keep = np.isfinite(values)
    table = pa.table(
        {"worker": np.full(values.size, worker, dtype=np.int64), "t_us": t_us, "metric": names, "value": values},
        schema=SAMPLE_SCHEMA,
    )
    return table.filter(pa.array(keep)) if not keep.all() else table


# --------------------------------------------------------------------------- the sampler


@dataclass
class SamplerStats:
    source: str  # "nvml" or "host"
    hz_requested: float
    samples: int  # readings of the fast tier (NIC, process CPU)
    seconds: float
    cpu_s: float  # CPU time of the sampler process while it sampled
    tiers: dict[str, int] = field(default_factory=dict)  # readings per tier: fast, slow, gpu, pcie

    @property
    def hz_achieved(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        """Share of one core the sampler used while it ran."""
        return self.cpu_s / self.seconds if self.seconds > 0 else 0.0


class HardwareSampler:
    """Samples this process's host (and its GPU through NVML, when there is one) at ``hz`` from a process of its own.

    ``prepare()`` starts the sampler process (it opens its counters and NVML and waits), ``start()``
    starts sampling (preparing first if needed); ``halt()`` ends sampling without waiting and
    ``collect()`` waits for the samples (the agent calls them from its training thread and its window
    thread); ``stop()`` is both.  Nothing raises: a sampler that cannot run records nothing, logged.
    """

    def __init__(
        self,
        worker: int,
        hz: float,
        *,
        nic: str = "",
        gpu_uuid: str = "",
        gpu_index: int | None = None,
        use_gpu: bool = True,
    ):
        global _said_host_only
        self.worker = worker
        self.hz = hz
        use_gpu = use_gpu and nvml_mod.load() is not None
        if not use_gpu and not _said_host_only:
            _said_host_only = True
            log.debug(
                "hardware sampler: no GPU through NVML (%s); sampling the host only",
                nvml_mod.unavailable_reason() or "not requested",
            )
        self.source: HardwareSeen = "nvml" if use_gpu else "host"  # until the sampler process says otherwise
        self._settings = {
            "pid": os.getpid(),
            "hz": hz,
            "nic": nic,
            "use_gpu": use_gpu,
            "gpu_uuid": gpu_uuid,
            "gpu_index": gpu_index,
        }
        self._proc: subprocess.Popen | None = None
        self._early = b""  # what wait_ready() read of the sampler process's output (its first line)
        self._t0 = 0.0

    def prepare(self) -> HardwareSampler:
        if self._proc is None:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-P", str(PROBE)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    close_fds=True,
                )
                self._send(json.dumps(self._settings).encode())
            except OSError as exc:
                log.warning("hardware sampler: cannot start the sampler process (%s); no hardware samples", exc)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Prepare and wait until the sampler process has opened its counters (benchmarks, tests; the agent never waits)."""
        self.prepare()
        if self._proc is None or self._proc.stdout is None:
            return False
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while not self._early.endswith(b"\n") and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 4096)  # the probe writes nothing else before it is stopped
            if not chunk:
                break
            self._early += chunk
        return self._early.endswith(b"\n")

    def start(self) -> HardwareSampler:
        self.prepare()
        self._t0 = time.monotonic()
        self._send(b"go")
        return self

    def halt(self) -> None:
        """End sampling; does not wait (a write of a few bytes to a pipe)."""
        self._send(b"stop")

    def _send(self, line: bytes) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.write(line + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # the sampler process is gone: collect() says why

    def close(self) -> None:
        """Stop a sampler process that was prepared but never collected."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
        self._proc = None

    def collect(self) -> tuple[pa.Table, SamplerStats]:
        """Wait for the samples: a SAMPLE_SCHEMA table (``t_us`` unix microseconds) and the sampler's cost."""
        seconds = time.monotonic() - self._t0 if self._t0 else 0.0
        empty = SAMPLE_SCHEMA.empty_table(), SamplerStats(self.source, self.hz, 0, seconds, 0.0)
        proc, self._proc = self._proc, None
        if proc is None:
            return empty
        try:
            out, err = proc.communicate(timeout=COLLECT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            log.warning(
                "hardware sampler: the sampler process did not answer within %.0f s; no hardware samples",
                COLLECT_TIMEOUT_S,
            )
            return empty
        try:
            ready, head, tiers = _parse(self._early + out)
        except (ValueError, KeyError):
            tail = err.decode(errors="replace").strip().splitlines()
            log.warning(
                "hardware sampler: the sampler process ended with %s (%s); no hardware samples",
                proc.returncode,
                tail[-1] if tail else "no message",
            )
            return empty
        if self.source == "nvml" and not ready["gpu"]:
            self.source = "host"
            log.warning("hardware sampler: no GPU in the sampler process (%s); sampling the host only", ready["reason"])
        stats = SamplerStats(
            self.source,
            self.hz,
            len(tiers["fast"]),
            head["seconds"],
            head["cpu_s"],
            {k: len(v) for k, v in tiers.items()},
        )
        return to_table(self.worker, metrics(tiers, int(ready["cores"]))), stats

    def stop(self) -> tuple[pa.Table, SamplerStats]:
        """Stop sampling and return the samples and the sampler's cost."""
        self.halt()
        return self.collect()


def _parse(out: bytes) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """The probe's answer: its ready line, its header, and each tier as a (rows, width) float64 array."""
    a = out.index(b"\n")
    b = out.index(b"\n", a + 1)
    ready, head = json.loads(out[:a]), json.loads(out[a + 1 : b])
    tiers, at = {}, b + 1
    for name, spec in head["tiers"].items():
        n = spec["rows"] * spec["width"]
        tiers[name] = np.frombuffer(out, dtype=np.float64, count=n, offset=at).reshape(spec["rows"], spec["width"])
        at += 8 * n
    return ready, head, tiers


def metrics(tiers: dict[str, np.ndarray], n_cores: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The probe's raw tiers -> metric -> (t_s, value) in the function table's units."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    slow = tiers.get("slow")
    if slow is not None and len(slow):
        out.update(
            host_metrics(slow[:, 0], slow[:, 1:], np.zeros(len(slow)), n_cores)
        )  # probe.SLOW: t, then host_metrics's columns
    fast = tiers.get("fast")
    if fast is not None and len(fast):
        out.update(fast_host_metrics(*(fast[:, FAST.index(c)] for c in FAST)))
    gpu = tiers.get("gpu")
    if gpu is not None and len(gpu):
        out.update(
            nvml_mod.fast_metrics(gpu[:, 0], {f: gpu[:, 1 + i] for i, f in enumerate(nvml_mod.NvmlReading._fields)})
        )
    pcie = tiers.get("pcie")
    if pcie is not None and len(pcie):
        out.update(nvml_mod.pcie_metrics(*(pcie[:, PCIE.index(c)] for c in PCIE)))
    return out
