"""NVML through nvidia-ml-py, entirely optional.

Every entry point returns ``None`` (or NaN for a reading) instead of raising when
the library, the driver or the device is missing, or a query is not supported
on this GPU, so the agent runs the same on hosts without a GPU.  The conversion
of raw NVML readings into the function table's units is pure
(:func:`fast_metrics`, :func:`pcie_metrics`) and tested without a GPU.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import NamedTuple

import numpy as np

log = logging.getLogger("lockstep.agent")

UINT_MAX = 0xFFFFFFFF  # NVML field scope "all links"
_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The initialised ``pynvml`` module, or None (no library, no driver, no GPU); the reason is logged once."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        reason = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                module = pynvml
            else:
                reason = "NVML reports no GPU"
        except ImportError as exc:
            reason = f"nvidia-ml-py is not importable ({exc})"
        except Exception as exc:
            reason = f"NVML is not usable here ({type(exc).__name__}: {exc})"
        _state["module"] = module
        _state["reason"] = reason
        return module


def unavailable_reason() -> str:
    load()
    return str(_state.get("reason", ""))


def physical_index(uuid: str) -> int | None:
    nvml = load() if uuid else None
    if nvml is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(uuid)))
    except Exception:
        return None


def _call(fn, *args, default=math.nan):
    try:
        return fn(*args)
    except Exception:
        return default


class NvmlReading(NamedTuple):
    """Raw NVML values of one sample; NaN where the GPU does not report them."""

    sm_clock_mhz: float
    utilisation_pct: float
    power_mw: float
    temp_c: float
    clock_events: float  # bit mask (exact in a float64 up to 2**53)
    nvlink_tx_kib: float  # cumulative counters
    nvlink_rx_kib: float


class NvmlDevice:
    """One GPU, opened by UUID or index."""

    def __init__(self, nvml, handle):
        self.nvml = nvml
        self.handle = handle
        self._reasons = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self._nvlink_fields = [
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX),
        ]
        self.has_nvlink = not math.isnan(self._nvlink()[0])

    @classmethod
    def open(cls, uuid: str = "", index: int | None = None) -> NvmlDevice | None:
        nvml = load()
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else nvml.nvmlDeviceGetHandleByIndex(index or 0)
            return cls(nvml, handle)
        except Exception as exc:
            log.warning("cannot open GPU %s in NVML (%s): sampling the host only", uuid or index, exc)
            return None

    def _nvlink(self) -> tuple[float, float]:
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(self.handle, self._nvlink_fields)
        except Exception:
            return math.nan, math.nan
        out = []
        for v in values:
            out.append(float(v.value.ullVal) if v.nvmlReturn == 0 else math.nan)
        return out[0], out[1]

    def read(self, full: bool = True) -> NvmlReading:
        """One reading; ``full=False`` leaves out utilisation, power and temperature (NaN), which the driver
        averages over 1/6 s to 1 s, so that the clock, its event reasons and NVLink can be read faster."""
        n, h = self.nvml, self.handle
        util = _call(n.nvmlDeviceGetUtilizationRates, h, default=None) if full else None
        tx, rx = self._nvlink() if self.has_nvlink else (math.nan, math.nan)
        return NvmlReading(
            sm_clock_mhz=float(_call(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM)),
            utilisation_pct=float(util.gpu) if util is not None else math.nan,
            power_mw=float(_call(n.nvmlDeviceGetPowerUsage, h)) if full else math.nan,
            temp_c=float(_call(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)) if full else math.nan,
            clock_events=float(_call(self._reasons, h, default=0)),
            nvlink_tx_kib=tx,
            nvlink_rx_kib=rx,
        )

    def read_pcie(self) -> tuple[float, float]:
        """PCIe TX and RX in KB/s; each query measures for 20 ms inside the driver (so it runs on its own thread)."""
        n, h = self.nvml, self.handle
        return float(_call(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_TX_BYTES)), float(
            _call(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_RX_BYTES)
        )


def rate(t_s: np.ndarray, counter: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-interval rates of a cumulative counter, each stamped at the end of its interval.

    A sample at ``t`` describes the sampling period before it (the summariser's
    convention).  A counter that goes backwards (reset, wrap) gives NaN for that interval.
    """
    t_s = np.asarray(t_s, dtype=np.float64)
    counter = np.asarray(counter, dtype=np.float64)
    if t_s.size < 2:
        return np.empty(0), np.empty(0)
    dt = np.diff(t_s)
    dc = np.diff(counter)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where((dt > 0) & (dc >= 0), dc * scale / dt, np.nan)
    return t_s[1:], r


def fast_metrics(t_s: np.ndarray, r: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """NVML readings (columns of :class:`NvmlReading` over samples) -> metric -> (t_s, value) in table units."""
    out = {
        "sm_clock_mhz": (t_s, r["sm_clock_mhz"]),
        "sm_active": (t_s, r["utilisation_pct"] / 100.0),
        "gpu_power_w": (t_s, r["power_mw"] / 1000.0),
        "gpu_temp_c": (t_s, r["temp_c"]),
        "clock_events": (t_s, r["clock_events"].astype(np.float64)),
    }
    nvlink = r["nvlink_tx_kib"] + r["nvlink_rx_kib"]
    if np.isfinite(nvlink).any():
        out["nvlink_gbps"] = rate(t_s, nvlink, scale=1024 / 1e9)
    return {k: (t, v) for k, (t, v) in out.items() if v.size and np.isfinite(v).any()}


def pcie_metrics(t_s: np.ndarray, tx_kbs: np.ndarray, rx_kbs: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """NVML PCIe throughput (TX then RX, 20 ms each, KB/s, ending at each stamp) -> pcie_gbps (GB/s, TX + RX)."""
    v = (np.asarray(tx_kbs, dtype=np.float64) + np.asarray(rx_kbs, dtype=np.float64)) * 1000 / 1e9
    return {"pcie_gbps": (np.asarray(t_s, dtype=np.float64), v)} if v.size and np.isfinite(v).any() else {}
