"""The sampler process: reads a training process's hardware counters at up to 10 kHz, outside it.

Run as ``python -P probe.py`` by :class:`~lockstep.producers.agent.sampler.HardwareSampler`,
one per training process and window.  Nothing here runs in the training process, so no
sample ever waits for, or holds, its GIL.  Standard library only at import (it starts in
about 40 ms); NVML is imported only when a GPU is sampled.

The counters are read raw and kept in ``array('d')`` columns; rates and units are computed
once, vectorised, by the parent after the window.  Three tiers, each at the rate its source
changes:

* **fast** (the asked rate, up to 10 kHz): NIC bytes (``/sys/class/net/<nic>/statistics``,
  InfiniBand port counters under ``/sys/class/infiniband``), and the training process's CPU
  time through its POSIX CPU clock (``clock_gettime`` on ``pid``: nanoseconds, including the
  running slice; /proc counts in 1/100 s).
* **slow** (at most 100 Hz, ``SLOW_HZ``): ``/proc/stat`` (busy time on the worker's cores,
  which the kernel reports in 1/100 s: reading it faster only repeats values), memory, disk.
* **gpu** (NVML, at most ``NVML_HZ``; utilisation, power and temperature, which the driver
  averages over 1/6 s to 1 s, at most ``NVML_FULL_HZ``) and **pcie** (NVML
  measures PCIe for 20 ms per query: a thread of its own at about 20 Hz).

Protocol (pipes): the parent writes one JSON line of settings, then ``go``, then ``stop``
(or closes stdin).  The probe answers one JSON line once it is ready (``gpu``, ``reason``,
``nic``), and after ``stop`` one JSON line describing the tiers followed by each tier's
float64 rows, row-major.  It dies with its parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sampler process imports it only when it opens a GPU
    from .nvml import NvmlDevice

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SLOW_HZ = 100.0  # /proc/stat counts in 1/CLK_TCK s
NVML_HZ = 1000.0
NVML_FULL_HZ = 20.0  # utilisation, power, temperature: the driver averages them over 1/6 s to 1 s
NAN = float("nan")

FAST = ("t", "t_end", "nic_bytes", "proc_cpu_s")  # the reads happened between t and t_end
SLOW = ("t", "busy_s", "total_s", "mem_used_frac", "disk_bytes", "nic_bytes", "proc_cpu_s")
PCIE = ("t", "tx_kbs", "rx_kbs")


# --------------------------------------------------------------------------- raw counters (pure parsers)


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
    return 1.0 - vals[b"MemAvailable"] / vals[b"MemTotal"] if len(vals) == 2 and vals[b"MemTotal"] else NAN


def parse_disk_read_bytes(diskstats: bytes, disks: frozenset[str]) -> int:
    """Bytes read from whole disks (not partitions) from /proc/diskstats."""
    total = 0
    for line in diskstats.split(b"\n"):
        f = line.split()
        if len(f) > 5 and f[2].decode() in disks:
            total += int(f[5]) * 512  # sectors read, always 512-byte units
    return total


def net_devices(netdev: bytes) -> list[str]:
    """Interface names in /proc/net/dev (the reading process's network namespace)."""
    return [name.strip().decode() for name, sep, _ in (line.partition(b":") for line in netdev.split(b"\n")[2:]) if sep]


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


def process_cpu_clock(pid: int) -> int:
    """The POSIX CPU-time clock of process ``pid`` (``clock_getcpuclockid``: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED))."""
    return ((~pid) << 3) | 2


# --------------------------------------------------------------------------- sources


class Counters:
    """The counters of one training process (``pid``) and its host; what cannot be read is NaN.

    Files stay open and are re-read with ``pread`` at offset 0.  NIC bytes come from sysfs
    (two small reads per interface) when sysfs shows this network namespace, else from
    ``/proc/net/dev``, which always does; an InfiniBand HCA from its port counters (4-byte words).
    """

    def __init__(self, pid: int, nic: str = ""):
        self.pid = pid
        self.clock: int | None = process_cpu_clock(pid)
        try:
            time.clock_gettime(self.clock)
        except OSError:
            self.clock = None
        try:
            self.cores: frozenset[int] | None = frozenset(os.sched_getaffinity(pid))
        except OSError:
            self.cores = None
        self.n_cores = len(self.cores) if self.cores else (os.cpu_count() or 1)
        block = Path("/sys/block")
        self.disks = (
            frozenset(p.name for p in block.iterdir() if not p.name.startswith(("loop", "ram")))
            if block.is_dir()
            else frozenset()
        )
        self._fds: dict[str, int] = {}
        for path in ("/proc/stat", "/proc/meminfo", "/proc/diskstats", "/proc/net/dev"):
            self._open(path)
        self.nic_files, self.nic_scale, self.nics, self.nic_source = self._nic_files(nic)

    def _open(self, path: str) -> bool:
        try:
            self._fds[path] = os.open(path, os.O_RDONLY)
            return True
        except OSError:
            return False

    def _nic_files(self, nic: str) -> tuple[list[int], float, frozenset[str] | None, str]:
        ports = Path("/sys/class/infiniband") / nic / "ports" if nic else None
        if ports is not None and ports.is_dir():
            files = [
                str(p / "counters" / c) for p in sorted(ports.iterdir()) for c in ("port_xmit_data", "port_rcv_data")
            ]
            fds = [self._fds[f] for f in files if self._open(f)]
            if fds:
                return fds, 4.0, None, f"infiniband {nic}"
        try:
            names = net_devices(self.read("/proc/net/dev"))
        except OSError:
            return [], 1.0, None, "none"
        want = [nic] if nic else [n for n in names if n != "lo"]
        sysfs = Path("/sys/class/net")
        # sysfs shows the network namespace it was mounted in (``ip netns exec`` mounts the right one); check it is ours
        same_ns = sysfs.is_dir() and set(os.listdir(sysfs)) == set(names)
        if same_ns and all(n in names for n in want):
            files = [str(sysfs / n / "statistics" / f"{d}_bytes") for n in want for d in ("rx", "tx")]
            if all(self._open(f) for f in files):
                return [self._fds[f] for f in files], 1.0, None, f"sysfs {','.join(want)}"
        return [], 1.0, frozenset(want) if nic else None, f"/proc/net/dev {','.join(want) or '-'}"

    def read(self, path: str) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            raise OSError(f"{path} is not readable")
        data = os.pread(fd, 1 << 16, 0)  # enough: the cpu lines of /proc/stat come first, before the long "intr" line
        return data if len(data) < 1 << 16 else data[: data.rfind(b"\n")]  # whole lines only

    def nic_bytes(self) -> float:
        try:
            if self.nic_files:
                return sum(int(os.pread(fd, 32, 0)) for fd in self.nic_files) * self.nic_scale
            return float(parse_net_bytes(self.read("/proc/net/dev"), self.nics))
        except (OSError, ValueError):
            return NAN

    def proc_cpu_s(self) -> float:
        if self.clock is None:
            return NAN
        try:
            return time.clock_gettime_ns(self.clock) / 1e9
        except OSError:  # the process is gone
            return NAN

    def fast(self) -> tuple[float, float, float, float]:
        t = time.time()
        nic, cpu = self.nic_bytes(), self.proc_cpu_s()
        return t, time.time(), nic, cpu

    def slow(self, t: float, _t_end: float, nic: float, cpu: float) -> tuple[float, ...]:
        try:
            busy, total = parse_cpu_jiffies(self.read("/proc/stat"), self.cores)
            busy_s, total_s = busy / CLK_TCK, total / CLK_TCK
        except (OSError, ValueError):
            busy_s = total_s = NAN
        try:
            mem = parse_meminfo(self.read("/proc/meminfo"))
        except (OSError, ValueError):
            mem = NAN
        try:
            disk = float(parse_disk_read_bytes(self.read("/proc/diskstats"), self.disks))
        except (OSError, ValueError):
            disk = NAN
        return t, busy_s, total_s, mem, disk, nic, cpu


# --------------------------------------------------------------------------- the loops


class Probe:
    def __init__(self, cfg: dict):
        self.hz = min(float(cfg["hz"]), 10_000.0)
        self.counters = Counters(int(cfg["pid"]), cfg.get("nic", ""))
        self.stop = threading.Event()
        self.cols: dict[str, array] = {"fast": array("d"), "slow": array("d"), "gpu": array("d"), "pcie": array("d")}
        self.gpu: NvmlDevice | None = None
        self.gpu_fields: tuple[str, ...] = ()
        self.reason = "not requested"
        if cfg.get("use_gpu"):
            self._open_gpu(cfg.get("gpu_uuid", ""), cfg.get("gpu_index"))
        self.threads = [threading.Thread(target=self._host_loop, daemon=True)]
        if self.gpu is not None:
            self.threads += [
                threading.Thread(target=self._gpu_loop, daemon=True),
                threading.Thread(target=self._pcie_loop, daemon=True),
            ]

    def _open_gpu(self, uuid: str, index: int | None) -> None:
        try:
            from lockstep.producers.agent import nvml
        except ImportError as exc:
            self.reason = f"lockstep is not importable in the sampler process ({exc})"
            return
        self.gpu = nvml.NvmlDevice.open(uuid, index)
        self.gpu_fields = nvml.NvmlReading._fields
        self.reason = "" if self.gpu is not None else nvml.unavailable_reason() or "the GPU could not be opened"

    def ready(self) -> dict:
        return {
            "gpu": "nvml" if self.gpu is not None else "",
            "reason": self.reason,
            "nic": self.counters.nic_source,
            "cores": self.counters.n_cores,
        }

    def _paced(self, hz: float, body) -> None:
        """Call ``body(i)`` at ``hz`` until stopped; a late reading does not try to catch up."""
        period = 1.0 / hz
        sleep, mono, stopped = time.sleep, time.monotonic, self.stop.is_set
        next_t = mono()
        i = 0
        while not stopped():
            body(i)
            i += 1
            next_t += period
            delay = next_t - mono()
            if delay > 0:
                sleep(delay)
            else:
                next_t = mono()

    def _host_loop(self) -> None:
        c, fast, slow = self.counters, self.cols["fast"], self.cols["slow"]
        every = max(1, round(self.hz / min(self.hz, SLOW_HZ)))

        def body(i: int) -> None:
            row = c.fast()
            fast.extend(row)
            if i % every == 0:
                slow.extend(c.slow(*row))

        self._paced(self.hz, body)

    def _gpu_loop(self) -> None:
        out, gpu, hz = self.cols["gpu"], self.gpu, min(self.hz, NVML_HZ)
        if gpu is None:
            return
        every = max(1, round(hz / NVML_FULL_HZ))

        def body(i: int) -> None:
            out.append(time.time())
            out.extend(gpu.read(full=i % every == 0))

        self._paced(hz, body)

    def _pcie_loop(self) -> None:
        out, gpu = self.cols["pcie"], self.gpu
        if gpu is None:
            return
        while not self.stop.is_set():
            tx, rx = gpu.read_pcie()  # two 20 ms measurements inside the driver
            out.extend((time.time(), tx, rx))
            self.stop.wait(0.01)

    def run(self) -> tuple[float, float]:
        """Start sampling; the monotonic time and this process's CPU time at the start."""
        t0, cpu0 = time.monotonic(), time.process_time()
        for t in self.threads:
            t.start()
        return t0, cpu0

    def finish(self, t0: float, cpu0: float) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)
        widths = {"fast": len(FAST), "slow": len(SLOW), "gpu": 1 + len(self.gpu_fields), "pcie": len(PCIE)}
        return {
            "seconds": time.monotonic() - t0,
            "cpu_s": time.process_time() - cpu0,
            "tiers": {k: {"rows": len(v) // widths[k], "width": widths[k]} for k, v in self.cols.items()},
        }


def _die_with_parent(parent: int) -> None:
    """Killed when the training process ends, however it ends (the parent is the process sampled).

    Armed here, not with a ``preexec_fn`` (``lockstep.broker.parent_death_signal``): that would make the
    training process ``fork`` instead of ``vfork``.  Also, the pipe's end of file stops the probe.
    """
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before we asked
        os._exit(0)


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    line = stdin.readline()
    if not line:
        return 0
    cfg = json.loads(line)
    _die_with_parent(int(cfg["pid"]))
    try:  # on cores the training process is not pinned to, if it is pinned (its own cores may be all it has, or shared
        # with a noisy neighbour); else on any
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, (every - os.sched_getaffinity(int(cfg["pid"]))) or every)
    except OSError:
        pass
    probe = Probe(cfg)
    stdout.write(json.dumps(probe.ready()).encode() + b"\n")
    stdout.flush()
    if stdin.readline().strip() != b"go":
        return 0
    t0, cpu0 = probe.run()
    stdin.readline()  # "stop", or end of file when the parent closes the pipe
    head = probe.finish(t0, cpu0)
    stdout.write(json.dumps(head).encode() + b"\n")
    for k, spec in head["tiers"].items():  # as many rows as the header says (a thread that did not stop may add more)
        stdout.write(probe.cols[k][: spec["rows"] * spec["width"]].tobytes())
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
