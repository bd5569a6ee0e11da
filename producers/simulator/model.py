"""One synchronous training step, simulated for every worker at once.

Each step, every worker runs: its Python loop, data loading (CPU; background
loader workers prefetch, so ``dataloader.next`` only stalls when they cannot keep
up), the host-to-device copy (PCIe), the forward and backward passes of its
pipeline stage in micro-batches (GPU kernels whose time grows as the SM clock
falls; tensor-parallel all-reduces over NVLink inside a host; mixture-of-experts
all-to-alls; pipeline send/recv between stages over NICs), the data-parallel
gradient all-reduce (hierarchical: over NVLink inside a host, then over the NICs
across hosts), the model-parallel grad-norm all-reduce, the optimizer step and a
little logging.

Nothing is labelled: waits, the critical path and who waits for whom emerge.
Every collective starts when its last member arrives (the others wait inside
it) and moves its bytes at the speed of the slowest link of the group (a ring is
as fast as its slowest hop).  Pipeline stages form a GPipe schedule per
micro-batch; a stage waits in ``nccl:send_recv[pp]`` for its neighbour.

Arrays are (workers, functions) over the catalogue :data:`FUNCTIONS`; a
function a worker does not run has ``present`` False (the embedding only on the
first stage, tensor-parallel collectives only with ``tp > 1``, ...).  Hardware
readings are what a host agent reports for each function: the mean, the spread
(standard deviation) and the peak (95th percentile) of the samples taken *while
it ran*, idle waits filtered out.  A link's counters show what real ones show:
in a group that runs at its slowest link every member's link carries the same
bytes in the same time, so every member's *mean* throughput is the slowest
link's; what differs is the shape.  The slowest link is busy all the time
(steady, low peak), the faster ones burst at their own capacity and idle while
the slow hop drains their buffer (spread 1-3 times the mean, peaks far above)
-- as far as the sampling rate resolves the bursts: samples longer than a burst
average it out.  A scenario's ``hardware`` says what the samplers see at all
(NVML and the host's counters, the host's only, or nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from .topology import Topology

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]
ObjectArray = npt.NDArray[np.object_]

BASE_CLOCK_MHZ = 1980.0
NVLINK_GBPS = 150.0  # per GPU, GB/s while transferring
NIC_GBPS = 50.0  # per bond (2 x 200 Gb/s), shared by the GPUs behind it
PCIE_GBPS = 25.0  # host-to-device copies, per GPU
DISK_MBPS = 2000.0  # host reads while the loader reads
POWER_IDLE_W, POWER_W = 90.0, 600.0  # board power idle and at the base clock under load
TEMP_C = 65.0

#: a link faster than its group's slowest runs ahead by a buffer (NCCL's per-channel buffer), then idles until the
#: slow hop has drained it: its bursts last this many bytes at the slow rate
BURST_BYTES = 4e6
SATURATED_CV = 0.1  # spread (sd/mean) of a link busy all the time (protocol gaps, flow control)
#: spread (sd/mean) of each other metric's samples while a function runs
METRIC_CV = {
    "sm_clock_mhz": 0.003,
    "sm_active": 0.05,
    "gpu_power_w": 0.03,
    "gpu_temp_c": 0.005,
    "pcie_gbps": SATURATED_CV,
    "cpu_self": 0.15,
    "cpu_other": 0.3,
    "mem_used_frac": 0.002,
    "disk_read_mbps": 0.3,
}
_HOST = frozenset({"nic_gbps", "cpu_self", "cpu_other", "mem_used_frac", "disk_read_mbps"})
#: what a worker's sampler sees: NVML and the host's counters (``nvml``), the host's only (``host``: no GPU, or no
#: NVML), nothing (``none``): the values of a feature batch's ``hardware``
SAMPLED = {
    "nvml": _HOST | {"sm_clock_mhz", "sm_active", "gpu_power_w", "gpu_temp_c", "pcie_gbps", "nvlink_gbps"},
    "host": _HOST,
    "none": frozenset(),
}

# NVML clock-event (throttle) reason bits
SW_POWER_CAP = 0x04
SW_THERMAL = 0x20
HW_THERMAL = 0x40


@dataclass(frozen=True)
class Function:
    name: str
    kind: str
    resource: str  # default resource; collectives use "nic" or "nvlink" depending on where their group lives
    base_us: float = (
        0.0  # per step (per layer for layer kernels); the model grows with tp and pp, a GPU's work does not
    )
    sigma: float = 0.01  # per-step jitter (lognormal sigma)


FUNCTIONS: tuple[Function, ...] = (
    Function("python.train_loop", "python", "cpu", 400.0, 0.05),
    Function("dataloader.next", "dataloader", "cpu", 1_500.0, 0.05),
    Function("memcpy.h2d", "memcpy", "pcie", 0.0, 0.02),
    Function("fwd.embedding", "compute", "gpu", 1_000.0, 0.005),
    Function("fwd.gemm", "compute", "gpu", 2_500.0, 0.005),  # per layer
    Function("fwd.attention", "compute", "gpu", 1_250.0, 0.005),  # per layer
    Function("moe.expert_gemm", "compute", "gpu", 2_000.0, 0.005),  # per layer, fwd + bwd
    Function("nccl:all_to_all[ep]", "collective", "nic", 0.0, 0.01),
    Function("nccl:all_reduce[tp]", "collective", "nvlink", 0.0, 0.01),
    Function("nccl:send_recv[pp]", "p2p", "nic", 0.0, 0.01),
    Function("fwd.loss", "compute", "gpu", 1_500.0, 0.005),
    Function("bwd.gemm", "compute", "gpu", 5_000.0, 0.005),  # per layer
    Function("bwd.attention", "compute", "gpu", 2_500.0, 0.005),  # per layer
    Function("nccl:all_reduce[dp]", "collective", "nic", 0.0, 0.01),
    Function("nccl:all_reduce[mp]", "collective", "nic", 0.0, 0.01),
    Function("optimizer.step", "optimizer", "gpu", 8_000.0, 0.005),
    Function("python.log_metrics", "python", "cpu", 150.0, 0.05),
)
F = len(FUNCTIONS)
IDX = {f.name: i for i, f in enumerate(FUNCTIONS)}
NAMES = np.array([f.name for f in FUNCTIONS], dtype=object)
KIND = np.array([f.kind for f in FUNCTIONS], dtype=object)
SIGMA = np.array([f.sigma for f in FUNCTIONS])
GPU_BOUND = np.array([f.resource == "gpu" for f in FUNCTIONS])
COMM = np.array([f.kind in ("collective", "p2p") for f in FUNCTIONS])
#: the transformer-layer kernels: what a pipeline stage with more layers does more of
LAYER_KERNELS = ("fwd.gemm", "fwd.attention", "bwd.gemm", "bwd.attention")
COMPUTE_KERNELS = (
    "fwd.embedding",
    "fwd.gemm",
    "fwd.attention",
    "moe.expert_gemm",
    "fwd.loss",
    "bwd.gemm",
    "bwd.attention",
    "optimizer.step",
)
CPU_FUNCTIONS = ("python.train_loop", "dataloader.next", "python.log_metrics")

INPUT_BYTES = 75e6  # a worker's batch, host to device
ACT_BYTES = 32e6  # activations of one layer output for the whole local batch (tp all-reduce, pp send)
GRAD_BYTES = 150e6  # exposed gradient bytes of the dp all-reduce (the rest overlaps backward)
A2A_BYTES = 2e6  # mixture-of-experts dispatch + combine per layer
HICCUP_US = 2_000.0  # mean stall of a transient hiccup
LOADER_HEALTHY = 0.5  # background loaders need half the step's compute time to prepare a batch


@dataclass(frozen=True)
class Workload:
    """What the job computes; scenario files set it under ``workload:``."""

    layers_per_stage: int = 16
    microbatches: int = 0  # 0: 1 without pipeline parallelism, 8 x pp with it
    moe: bool = False  # mixture-of-experts layers (expert kernels + all-to-all, routing skew)
    seq_jitter: float = 0.02  # per-step spread of each worker's tokens (variable sequence lengths)
    moe_skew: float = 0.10  # per-step spread of tokens routed to each worker's experts
    hiccups: float = 0.002  # share of (worker, function, step) in which one call stalls (transient)

    def m(self, topo: Topology) -> int:
        return self.microbatches or (1 if topo.pp == 1 else 8 * topo.pp)


@dataclass
class Effects:
    """What the active faults change, per worker (W) unless noted.  Healthy: factors 1, deltas 0."""

    clock_factor: np.ndarray
    clock_events: np.ndarray  # uint64, NVML reasons
    temp_delta: np.ndarray
    gpu_factor: np.ndarray  # compute time at the same clock
    nvlink_factor: np.ndarray  # link capacity
    pcie_factor: np.ndarray
    nic_factor: np.ndarray  # capacity of the worker's bond (NIC or switch port)
    cpu_other_delta: np.ndarray
    cpu_self_factor: np.ndarray
    mem_floor: np.ndarray  # host memory in use at least this share
    disk_factor: np.ndarray  # disk read rate the loader sees
    loader_excess: np.ndarray  # extra share of the step the loader needs per batch
    python_factor: np.ndarray  # Python (CPU-bound) slowdown
    tokens: np.ndarray  # input size factor
    fn_factor: np.ndarray  # (W, F) duration factor per function
    extra_us: np.ndarray  # (W, F) extra time per function, as a share of the step budget
    extra_layers: np.ndarray  # (pp,) int: layers a stage has beyond its share
    clock_offset_s: np.ndarray  # wall-clock skew of the worker's host
    missing: np.ndarray  # bool: the worker's agent is gone (no records)

    @classmethod
    def healthy(cls, topo: Topology) -> Effects:
        w = topo.workers
        one, zero = np.ones(w), np.zeros(w)
        return cls(
            clock_factor=one.copy(),
            clock_events=np.zeros(w, dtype=np.uint64),
            temp_delta=zero.copy(),
            gpu_factor=one.copy(),
            nvlink_factor=one.copy(),
            pcie_factor=one.copy(),
            nic_factor=one.copy(),
            cpu_other_delta=zero.copy(),
            cpu_self_factor=one.copy(),
            mem_floor=zero.copy(),
            disk_factor=one.copy(),
            loader_excess=zero.copy(),
            python_factor=one.copy(),
            tokens=one.copy(),
            fn_factor=np.ones((w, F)),
            extra_us=np.zeros((w, F)),
            extra_layers=np.zeros(topo.pp, dtype=np.int64),
            clock_offset_s=zero.copy(),
            missing=np.zeros(w, dtype=bool),
        )


@dataclass
class SimulatedStep:
    """One step of every worker: per-(worker, function) characteristics and per-worker step time."""

    step: int
    present: np.ndarray  # (W, F) bool: the worker runs the function
    resource: np.ndarray  # (W, F) object
    total_us: np.ndarray  # (W, F)
    critical_us: np.ndarray
    wait_us: np.ndarray  # NaN: not measured locally (as on a real host); the diagnosis estimates it
    true_wait_us: np.ndarray  # what the simulator knows: time spent waiting for peers (tests, evaluation)
    first_start_us: np.ndarray
    calls: np.ndarray
    bytes: np.ndarray
    samples: np.ndarray
    hw: dict[str, np.ndarray]  # metric -> (W, F), NaN where not applicable
    clock_events: np.ndarray  # (W, F) uint64
    step_time_us: np.ndarray  # (W,)
    missing: np.ndarray  # (W,) bool
    clock_offset_s: np.ndarray  # (W,)

    @property
    def sync_step_us(self) -> float:
        """The synchronised step time: the slowest worker's."""
        return float(self.step_time_us.max())


@dataclass(frozen=True)
class Static:
    """Per-device properties fixed for the job (manufacturing spread, cooling, host load)."""

    clock: np.ndarray
    temp_c: np.ndarray
    power: np.ndarray
    mem: np.ndarray
    cpu_other: np.ndarray
    structure: Structure

    @classmethod
    def draw(cls, topo: Topology, workload: Workload, seed: int) -> Static:
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
        w, h = topo.workers, topo.hosts
        host = topo.arrays["host"]
        return cls(
            clock=rng.normal(1.0, 0.002, w),
            temp_c=TEMP_C + rng.normal(0.0, 3.0, w),
            power=rng.normal(1.0, 0.02, w),
            mem=(0.35 + rng.uniform(0.0, 0.15, h))[host],
            cpu_other=(0.03 + rng.uniform(0.0, 0.05, h))[host],
            structure=_structure(topo, workload),
        )


def step_rng(seed: int, step: int) -> np.random.Generator:
    """One stream per (seed, step): a step's records do not depend on which steps ran before."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1, step)))


@dataclass(frozen=True)
class Structure:
    """What the topology fixes: who runs what, where each collective's group lives."""

    present: BoolArray  # (W, F): the worker runs the function
    resource: ObjectArray  # (W, F): the resource each function depends on ("nic" or "nvlink" for collectives)
    dp_per_host: int  # members of a data-parallel group on one host
    dp_hosts: int  # hosts a data-parallel group spans
    mp_hosts: int  # hosts a model-parallel group spans (one per stage)


def _structure(topo: Topology, wl: Workload) -> Structure:
    a = topo.arrays
    stage = a["pp"]
    present = np.ones((topo.workers, F), dtype=bool)
    present[:, IDX["fwd.embedding"]] = stage == 0
    present[:, IDX["fwd.loss"]] = stage == topo.pp - 1
    present[:, IDX["moe.expert_gemm"]] = wl.moe
    present[:, IDX["nccl:all_to_all[ep]"]] = wl.moe and topo.dp > 1
    present[:, IDX["nccl:all_reduce[tp]"]] = topo.tp > 1
    present[:, IDX["nccl:send_recv[pp]"]] = topo.pp > 1
    present[:, IDX["nccl:all_reduce[dp]"]] = topo.dp > 1
    present[:, IDX["nccl:all_reduce[mp]"]] = topo.pp * topo.tp > 1
    # data-parallel group of one (pp, tp): members per host and hosts spanned
    dp_per_host = min(topo.dp, max(1, topo.gpus_per_host // topo.tp))
    dp_hosts = -(-topo.dp // dp_per_host)
    mp_hosts = topo.pp  # a model-parallel group spans one host per stage
    resource = np.tile(np.array([f.resource for f in FUNCTIONS], dtype=object), (topo.workers, 1))
    for name, hosts in (
        ("nccl:all_to_all[ep]", dp_hosts),
        ("nccl:all_reduce[dp]", dp_hosts),
        ("nccl:all_reduce[mp]", mp_hosts),
    ):
        resource[:, IDX[name]] = "nic" if hosts > 1 else "nvlink"
    return Structure(present=present, resource=resource, dp_per_host=dp_per_host, dp_hosts=dp_hosts, mp_hosts=mp_hosts)


def budget_us(topo: Topology, wl: Workload) -> float:
    """A healthy worker's compute per step: the time background data loaders have to prepare the next batch."""
    b = {f.name: f.base_us for f in FUNCTIONS}
    per_layer = sum(b[n] for n in LAYER_KERNELS) + (b["moe.expert_gemm"] if wl.moe else 0.0)
    return wl.layers_per_stage * per_layer + b["optimizer.step"]


def _group_max(x: np.ndarray, shape: tuple[int, int, int], axes: tuple[int, ...]) -> np.ndarray:
    """Max over the given axes of the (pp, dp, tp) layout, broadcast back to workers."""
    v = x.reshape(shape)
    return np.broadcast_to(v.max(axis=axes, keepdims=True), shape).reshape(-1)


def _group_min(x: np.ndarray, shape: tuple[int, int, int], axes: tuple[int, ...]) -> np.ndarray:
    v = x.reshape(shape)
    return np.broadcast_to(v.min(axis=axes, keepdims=True), shape).reshape(-1)


def _ring_time(bytes_: float, members: int, bw_gbps: np.ndarray) -> np.ndarray:
    """All-reduce of ``bytes_`` over a ring of ``members`` whose slowest hop runs at ``bw_gbps``: microseconds."""
    if members < 2:
        return np.zeros_like(bw_gbps)
    return 2.0 * (members - 1) / members * bytes_ / (bw_gbps * 1e3)


def simulate_step(
    topo: Topology,
    wl: Workload,
    static: Static,
    step: int,
    rng: np.random.Generator,
    fx: Effects,
    hardware_hz: float = 100.0,
    readings: bool = True,
    hardware: str = "nvml",
) -> SimulatedStep:
    """Simulate one step of every worker; ``readings=False`` skips the hardware readings (timing only, same times);
    ``hardware``: what the workers' samplers see (:data:`SAMPLED`).

    The phases in the order a worker runs them: its own work (:func:`_work`), the host side before the pipeline
    (Python, loading, the copy), the pipeline of forward and backward passes (:func:`_pipeline_phase`), the
    gradient all-reduces (:func:`_gradient_phase`), the optimizer and logging; then what the agent counts
    (:func:`_calls`, :func:`_bytes`) and the hardware readings (:func:`_hardware`).  Only :func:`_work` and
    :func:`_hardware` draw from ``rng``, in that order."""
    W = topo.workers
    st = static.structure
    work = _work(topo, wl, static, rng, fx)
    times = _Times(total=work.dur.copy(), wait=np.zeros((W, F)), first=np.zeros((W, F)))
    links = _Links(nvlink=NVLINK_GBPS * fx.nvlink_factor, nic=NIC_GBPS / topo.gpus_per_nic * fx.nic_factor)
    ready = _in_order(work.dur, times.first, np.zeros(W), ("python.train_loop", "dataloader.next", "memcpy.h2d"))
    pipe_end, tp_calls = _pipeline_phase(topo, wl, st, work, fx, links, times, ready)
    t = _gradient_phase(topo, st, work, fx, links, times, pipe_end)
    step_time = _in_order(work.dur, times.first, t, ("optimizer.step", "python.log_metrics"))

    present = st.present
    total = times.total
    total[~present] = 0.0
    calls = _calls(topo, work.layers, tp_calls, wl.m(topo), present)
    nbytes = _bytes(topo, wl.m(topo), work, tp_calls, calls, present)
    sampled = SAMPLED[hardware]
    if sampled:
        samples = np.where(present, np.maximum(1, np.rint(total * hardware_hz / 1e6)), 0).astype(np.int32)
    else:
        samples = np.zeros((W, F), dtype=np.int32)
    hw = _hardware(topo, static, rng, fx, st, samples, work, links, total, hardware_hz, sampled) if readings else {}
    for arr in hw.values():
        arr[~present] = np.nan
    if "sm_clock_mhz" not in sampled:  # no NVML: no clock-event reasons either
        fx = replace(fx, clock_events=np.zeros(W, dtype=np.uint64))
    events = np.where(GPU_BOUND[None, :] & present, fx.clock_events[:, None], 0).astype(np.uint64)
    return SimulatedStep(
        step=step,
        present=present,
        resource=st.resource,
        total_us=total,
        critical_us=total.copy(),
        wait_us=np.full((W, F), np.nan),
        true_wait_us=times.wait,
        first_start_us=times.first,
        calls=calls,
        bytes=nbytes,
        samples=samples,
        hw=hw,
        clock_events=events,
        step_time_us=step_time,
        missing=fx.missing,
        clock_offset_s=fx.clock_offset_s,
    )


@dataclass(frozen=True)
class _Work:
    """What each worker computes this step, before anyone waits for anyone."""

    dur: FloatArray  # (W, F) µs of work per function; 0 where the worker does not run it
    jitter: FloatArray  # (W, F) the step's natural variability
    tokens: FloatArray  # (W,) input size this step
    route: FloatArray  # (W,) tokens routed to the worker's experts
    clock: FloatArray  # (W,) SM clock, MHz
    layers: FloatArray  # (W,) layers of the worker's pipeline stage
    pcie_gbps: FloatArray  # (W,) the host-to-device link's rate
    input_bytes: FloatArray  # (W,) the batch copied to the device

    def comm(self, fx: Effects, name: str) -> FloatArray:
        """A collective's time factor on each worker: its fault and its jitter."""
        i = IDX[name]
        out: FloatArray = fx.fn_factor[:, i] * self.jitter[:, i]
        return out


@dataclass(frozen=True)
class _Times:
    """The step's timeline as the phases build it: per (worker, function) µs."""

    total: FloatArray  # time in the function, waits included
    wait: FloatArray  # of which waiting for peers
    first: FloatArray  # start of its first call, from the step's start


@dataclass(frozen=True)
class _Links:
    """Each worker's link capacities (GB/s while transferring)."""

    nvlink: FloatArray
    nic: FloatArray  # its share of the bond


def _work(topo: Topology, wl: Workload, static: Static, rng: np.random.Generator, fx: Effects) -> _Work:
    """Every function's own duration on every worker: kernels nearly deterministic and slower as the clock falls,
    host-side work varies more, rare hiccups; the faults' factors applied."""
    W, P, D, T = topo.workers, topo.pp, topo.dp, topo.tp
    base = np.array([f.base_us for f in FUNCTIONS])
    budget = budget_us(topo, wl)
    jitter = rng.lognormal(0.0, 1.0, size=(W, F)) ** SIGMA[None, :]
    # one call stalls (GC, OS jitter)
    hiccup = np.where(rng.random((W, F)) < wl.hiccups, rng.exponential(HICCUP_US, (W, F)), 0.0)
    tokens = rng.lognormal(0.0, wl.seq_jitter, W) * fx.tokens  # variable sequence lengths
    route = rng.lognormal(0.0, wl.moe_skew, (P, D))  # tokens routed to each tensor-parallel group's experts
    route = np.repeat(route.reshape(-1), T) * fx.tokens
    clock = BASE_CLOCK_MHZ * static.clock * fx.clock_factor * rng.normal(1.0, 0.001, W)
    speed = (BASE_CLOCK_MHZ / clock) * fx.gpu_factor  # compute time factor

    layers = (wl.layers_per_stage + fx.extra_layers)[topo.arrays["pp"]].astype(np.float64)
    dur = np.zeros((W, F))
    i = IDX
    dur[:, i["fwd.gemm"]] = base[i["fwd.gemm"]] * layers * tokens
    dur[:, i["bwd.gemm"]] = base[i["bwd.gemm"]] * layers * tokens
    # attention grows with sequence length squared
    dur[:, i["fwd.attention"]] = base[i["fwd.attention"]] * layers * tokens**2
    dur[:, i["bwd.attention"]] = base[i["bwd.attention"]] * layers * tokens**2
    dur[:, i["fwd.embedding"]] = base[i["fwd.embedding"]] * tokens
    dur[:, i["fwd.loss"]] = base[i["fwd.loss"]] * tokens
    dur[:, i["moe.expert_gemm"]] = base[i["moe.expert_gemm"]] * layers * route
    dur[:, i["optimizer.step"]] = base[i["optimizer.step"]]
    dur[:, GPU_BOUND] *= speed[:, None]
    dur[:, i["python.train_loop"]] = base[i["python.train_loop"]] * fx.python_factor
    dur[:, i["python.log_metrics"]] = base[i["python.log_metrics"]] * fx.python_factor
    # the copy moves the batch at the link's rate
    pcie_gbps = PCIE_GBPS * fx.pcie_factor
    input_bytes = INPUT_BYTES * tokens
    dur[:, i["memcpy.h2d"]] = input_bytes / (pcie_gbps * 1e3)
    dur *= jitter * fx.fn_factor
    dur += fx.extra_us * budget + hiccup
    # prefetching loaders hide their work unless it exceeds the step's compute
    produce = budget * (LOADER_HEALTHY * rng.lognormal(0.0, 0.05, W) + fx.loader_excess)
    loader = i["dataloader.next"]
    dur[:, loader] = base[loader] * jitter[:, loader] + np.maximum(0.0, produce - budget)
    dur[~static.structure.present] = 0.0
    return _Work(dur, jitter, tokens, route, clock, layers, pcie_gbps, input_bytes)


def _in_order(dur: FloatArray, first: FloatArray, t: FloatArray, names: tuple[str, ...]) -> FloatArray:
    """Functions each worker runs one after the other on its own from ``t``: their starts, and when they end."""
    for name in names:
        first[:, IDX[name]] = t
        t = t + dur[:, IDX[name]]
    return t


def _pipeline_phase(
    topo: Topology,
    wl: Workload,
    st: Structure,
    work: _Work,
    fx: Effects,
    links: _Links,
    times: _Times,
    ready: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Forward and backward passes per tensor-parallel group (node = (pp, dp)), whose members sync at every tp
    all-reduce, in a GPipe schedule of micro-batches across the pipeline's stages; the tp all-reduce, the experts'
    all-to-all and the stages' send/recv take what is not compute.  Returns when each worker's pipeline ends and
    its tp all-reduce calls."""
    W, P, D, T = topo.workers, topo.pp, topo.dp, topo.tp
    shape = (P, D, T)
    stage = topo.arrays["pp"]
    M = wl.m(topo)
    dur, total, wait, first = work.dur, times.total, times.wait, times.first
    g = IDX
    fwd_names = ("fwd.embedding", "fwd.gemm", "fwd.attention", "fwd.loss")
    bwd_names = ("bwd.gemm", "bwd.attention")
    f_w = dur[:, [g[n] for n in fwd_names]].sum(axis=1) / M
    b_w = dur[:, [g[n] for n in bwd_names]].sum(axis=1) / M
    e_w = dur[:, g["moe.expert_gemm"]] / (2 * M)  # per micro-batch, per direction
    tp_axis, dp_axis = (2,), (1,)
    start = _group_max(ready, shape, tp_axis)
    f_max, b_max = _group_max(f_w, shape, tp_axis), _group_max(b_w, shape, tp_axis)
    tp_calls = 2 * work.layers * M  # per direction: after attention and after the MLP of every layer
    tp_xfer = np.zeros(W)
    if T > 1:
        per_call = _ring_time(ACT_BYTES / M, T, _group_min(links.nvlink, shape, tp_axis))
        tp_xfer = tp_calls * per_call * work.comm(fx, "nccl:all_reduce[tp]")
        tp_xfer = _group_max(tp_xfer, shape, tp_axis)
    # experts: every data-parallel replica of a stage exchanges tokens with the others (ep = dp)
    e_max = _group_max(_group_max(e_w, shape, tp_axis), shape, dp_axis) if wl.moe else np.zeros(W)
    a2a_xfer = np.zeros(W)
    if wl.moe and D > 1:
        link = np.where(st.dp_hosts > 1, links.nic, links.nvlink)
        a2a_xfer = (
            2
            * 2
            * work.layers
            * M
            * (A2A_BYTES / M)
            / (_group_min(link, shape, dp_axis) * 1e3)
            * work.comm(fx, "nccl:all_to_all[ep]")
        )
        a2a_xfer = _group_max(_group_max(a2a_xfer, shape, tp_axis), shape, dp_axis)
    f_node = f_max + e_max + (tp_xfer + a2a_xfer) / (2 * M)
    b_node = b_max + e_max + (tp_xfer + a2a_xfer) / (2 * M)

    hop = np.zeros((0, D))  # one send/recv of one micro-batch's activations, stage p -> p + 1
    if P > 1:
        nic = links.nic.reshape(shape)
        link = np.minimum(nic[:-1], nic[1:])  # stage p -> p + 1, same (dp, tp)
        hop = ACT_BYTES / M / (link.min(axis=2, keepdims=True) * 1e3)  # (P-1, D, 1)
        hop = np.broadcast_to(hop, (P - 1, D, T)) * work.comm(fx, "nccl:send_recv[pp]").reshape(shape)[:-1]
        hop = hop.max(axis=2)  # (P-1, D)
    S = start.reshape(shape)[:, :, 0]
    F_first, B_first, pipe_end = _gpipe(f_node.reshape(shape)[:, :, 0], b_node.reshape(shape)[:, :, 0], S, hop, M)

    def node(x: FloatArray) -> FloatArray:  # (P, D) -> workers
        return np.repeat(x.reshape(-1), T)

    pipe_end_w, S_w = node(pipe_end), node(S)
    compute_w = M * (f_node + b_node)
    # accounting per worker: what is not compute in the pipeline phase is waiting or moving bytes
    tp_wait = (start - ready) + M * ((f_max - f_w) + (b_max - b_w))
    a2a_wait = 2 * M * (e_max - e_w)
    if T > 1:
        total[:, g["nccl:all_reduce[tp]"]] = tp_xfer + tp_wait
        wait[:, g["nccl:all_reduce[tp]"]] = tp_wait
    if wl.moe and D > 1:
        total[:, g["nccl:all_to_all[ep]"]] = a2a_xfer + a2a_wait
        wait[:, g["nccl:all_to_all[ep]"]] = a2a_wait
    if P > 1:
        p2p = pipe_end_w - S_w - compute_w
        n_hops = np.where((stage == 0) | (stage == P - 1), 2 * M, 4 * M)
        hop_w = np.concatenate([hop, hop[-1:]]).reshape(-1)  # the hop each stage sends on (the last: its input)
        xfer = np.minimum(p2p, n_hops / 2 * np.repeat(hop_w, T))
        total[:, g["nccl:send_recv[pp]"]] = p2p
        wait[:, g["nccl:send_recv[pp]"]] = p2p - xfer
    for n in (*fwd_names, "moe.expert_gemm", "nccl:all_reduce[tp]", "nccl:all_to_all[ep]"):
        first[:, g[n]] = node(F_first)
    for n in bwd_names:
        first[:, g[n]] = node(B_first)
    first[:, g["nccl:send_recv[pp]"]] = np.where(stage == 0, node(F_first) + f_node, S_w)
    first[:, g["fwd.loss"]] = node(F_first) + f_node * 0.9
    return pipe_end_w, tp_calls


def _gpipe(
    fn: FloatArray, bn: FloatArray, S: FloatArray, hop: FloatArray, M: int
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """A GPipe schedule of ``M`` micro-batches over (stage, replica) nodes that start at ``S``, take ``fn`` / ``bn``
    per micro-batch forward / backward and ``hop`` per send to the next stage: when each node starts its first
    forward, its first backward, and when its pipeline ends."""
    P, D = S.shape
    F_end = np.zeros((P, D))
    F_first = np.zeros((P, D))
    for m in range(M):  # forward, GPipe: stage p starts micro-batch m when it is free and p-1 has sent it
        for p in range(P):
            r = S[p] if m == 0 else F_end[p]
            if p > 0:
                r = np.maximum(r, F_end[p - 1] + hop[p - 1])
            F_end[p] = r + fn[p]
            if m == 0:
                F_first[p] = r
    B_end = F_end.copy()
    B_first = np.zeros((P, D))
    for m in range(M):  # backward: gradients flow from the last stage to the first
        for p in reversed(range(P)):
            r = B_end[p]
            if p < P - 1:
                r = np.maximum(r, B_end[p + 1] + hop[p])
            B_end[p] = r + bn[p]
            if m == 0:
                B_first[p] = r
    pipe_end = B_end.copy()
    if P > 1:
        pipe_end[1:] += hop  # the last gradients sent to the previous stage
    return F_first, B_first, pipe_end


def _gradient_phase(
    topo: Topology, st: Structure, work: _Work, fx: Effects, links: _Links, times: _Times, t: FloatArray
) -> FloatArray:
    """The data-parallel gradient all-reduce per (pp, tp), hierarchical (NVLink inside a host, then NICs across
    hosts), then the model-parallel grad-norm all-reduce (a few bytes) over every stage and tp rank of one replica;
    each starts when its last member arrives.  Returns when each worker is done with them."""
    P, D, T = topo.pp, topo.dp, topo.tp
    shape = (P, D, T)
    dp_axis = (1,)
    if D > 1:
        k, h = st.dp_per_host, st.dp_hosts
        xfer = _ring_time(GRAD_BYTES, k, _group_min(links.nvlink, shape, dp_axis))
        xfer = xfer + _ring_time(GRAD_BYTES / k, h, _group_min(links.nic, shape, dp_axis))
        xfer = _group_max(xfer * work.comm(fx, "nccl:all_reduce[dp]"), shape, dp_axis)
        t = _collective(times, "nccl:all_reduce[dp]", t, _group_max(t, shape, dp_axis), xfer)
    if P * T > 1:
        lat = 20.0 * np.log2(P * T) + np.where(st.mp_hosts > 1, 30.0 * np.log2(max(2, P)), 0.0)
        xfer = _group_max(lat * work.comm(fx, "nccl:all_reduce[mp]"), shape, (0, 2))
        t = _collective(times, "nccl:all_reduce[mp]", t, _group_max(t, shape, (0, 2)), xfer)
    return t


def _collective(times: _Times, name: str, arrive: FloatArray, last: FloatArray, xfer: FloatArray) -> FloatArray:
    """A collective every member enters at ``arrive`` and that moves its bytes once the ``last`` arrived."""
    f = IDX[name]
    times.first[:, f] = arrive
    times.wait[:, f] = last - arrive
    times.total[:, f] = last - arrive + xfer
    end: FloatArray = last + xfer
    return end


def _calls(topo: Topology, layers: FloatArray, tp_calls: FloatArray, M: int, present: BoolArray) -> IntArray:
    """How many times each worker calls each function in the step."""
    stage, P = topo.arrays["pp"], topo.pp
    calls = np.ones((topo.workers, F), dtype=np.int32)
    lk = (layers * M).astype(np.int32)
    for name, per in (
        ("fwd.gemm", 3),
        ("bwd.gemm", 6),
        ("fwd.attention", 2),
        ("bwd.attention", 2),
        ("moe.expert_gemm", 4),
    ):
        calls[:, IDX[name]] = per * lk
    calls[:, IDX["nccl:all_reduce[tp]"]] = 2 * tp_calls.astype(np.int32)
    calls[:, IDX["nccl:all_to_all[ep]"]] = 4 * lk
    calls[:, IDX["nccl:send_recv[pp]"]] = np.where((stage == 0) | (stage == P - 1), 2 * M, 4 * M)
    calls[:, IDX["fwd.embedding"]] = M
    calls[:, IDX["fwd.loss"]] = M
    calls[:, IDX["memcpy.h2d"]] = M
    calls[~present] = 0
    return calls


def _bytes(
    topo: Topology, M: int, work: _Work, tp_calls: FloatArray, calls: IntArray, present: BoolArray
) -> FloatArray:
    """Bytes each worker moves in each copy and collective (NaN for the others)."""
    D, T = topo.dp, topo.tp
    nbytes = np.full((topo.workers, F), np.nan)
    nbytes[:, IDX["memcpy.h2d"]] = work.input_bytes
    nbytes[:, IDX["nccl:all_reduce[tp]"]] = 2 * tp_calls * 2 * (T - 1) / T * ACT_BYTES / M
    nbytes[:, IDX["nccl:all_to_all[ep]"]] = 4 * work.layers * A2A_BYTES * work.route
    nbytes[:, IDX["nccl:send_recv[pp]"]] = calls[:, IDX["nccl:send_recv[pp]"]] * ACT_BYTES / M
    nbytes[:, IDX["nccl:all_reduce[dp]"]] = 2 * (D - 1) / max(D, 1) * GRAD_BYTES
    nbytes[:, IDX["nccl:all_reduce[mp]"]] = 8.0 * 2
    nbytes[~present] = np.nan
    return nbytes


def _link_rates(topo: Topology, st: Structure, links: _Links) -> dict[str, list[tuple[int, FloatArray, FloatArray]]]:
    """Per link metric: (function, rate every member of the worker's group moves bytes at, the worker's own capacity).

    A collective runs at its slowest link (the timing above): every member's link carries the same bytes in the
    same time, so its mean throughput is the group's slowest capacity, whatever its own.
    """
    shape = (topo.pp, topo.dp, topo.tp)
    nic, nvlink = links.nic, links.nvlink
    out: dict[str, list[tuple[int, FloatArray, FloatArray]]] = {"nic_gbps": [], "nvlink_gbps": []}
    if topo.tp > 1:
        out["nvlink_gbps"].append((IDX["nccl:all_reduce[tp]"], _group_min(nvlink, shape, (2,)), nvlink))
    if topo.dp > 1:
        dp = IDX["nccl:all_reduce[dp]"]
        if st.dp_per_host > 1:  # hierarchical: NVLink inside the host, then the NICs across hosts
            out["nvlink_gbps"].append((dp, _group_min(nvlink, shape, (1,)), nvlink))
        if st.dp_hosts > 1:
            out["nic_gbps"].append((dp, _group_min(nic, shape, (1,)), nic))
        link, metric = (nic, "nic_gbps") if st.dp_hosts > 1 else (nvlink, "nvlink_gbps")
        out[metric].append((IDX["nccl:all_to_all[ep]"], _group_min(link, shape, (1,)), link))
    if topo.pp > 1:  # send/recv between neighbouring stages (same dp, tp rank): a stage's link carries both hops
        v = nic.reshape(shape)
        hop = np.minimum(v[:-1], v[1:]).min(axis=2, keepdims=True)  # (pp - 1, dp, 1), as in the timing
        inf = np.full((1,) + hop.shape[1:], np.inf)
        rate = np.minimum(np.concatenate([inf, hop]), np.concatenate([hop, inf]))
        out["nic_gbps"].append((IDX["nccl:send_recv[pp]"], np.broadcast_to(rate, shape).reshape(-1), nic))
    return out


def _shape(
    rng: np.random.Generator,
    mean: FloatArray,
    cv: FloatArray | float,
    samples: IntArray,
    cap: FloatArray | float = np.inf,
) -> tuple[FloatArray, FloatArray]:
    """Standard deviation and 95th percentile of ``samples`` readings of mean ``mean`` and spread ``cv`` (sd/mean),
    with the error an estimate from that many samples has; the spread is NaN below two samples, the peak the one
    reading; no reading exceeds ``cap``."""
    n = np.maximum(samples, 1)
    sd = (
        np.abs(mean)
        * cv
        * np.clip(1.0 + rng.normal(0.0, 1.0, mean.shape) / np.sqrt(2.0 * np.maximum(n - 1, 1)), 0.1, None)
    )
    p95 = np.minimum(mean + 1.645 * sd, np.maximum(cap, mean))
    return np.where(samples >= 2, sd, np.nan), np.where(samples >= 2, p95, mean)


def _hardware(
    topo: Topology,
    static: Static,
    rng: np.random.Generator,
    fx: Effects,
    st: Structure,
    samples: IntArray,
    work: _Work,
    links: _Links,
    total: FloatArray,
    hz: float,
    sampled: frozenset[str],
) -> dict[str, FloatArray]:
    """Readings while each function ran: mean, spread (sd) and peak (p95) of the samples that overlapped it.

    The level's noise shrinks with the number of samples; the spread is each metric's own (:data:`METRIC_CV`),
    except on links: see :func:`_link_rates` and :data:`BURST_BYTES`.
    """
    if not sampled:
        return {}
    W = topo.workers
    nan = np.full((W, F), np.nan)
    gpu = GPU_BOUND[None, :]
    level = 1.0 / np.sqrt(np.maximum(samples, 1))

    def n(s: float) -> FloatArray:  # readings' noise around their level, smaller with more samples
        out: FloatArray = 1.0 + rng.normal(0.0, 1.0, size=(W, F)) * s * level
        return out

    clock = work.clock
    rel_clock = (clock / BASE_CLOCK_MHZ)[:, None]
    active = np.where(KIND[None, :] == "optimizer", 0.6, 0.88)
    power = POWER_IDLE_W + (POWER_W - POWER_IDLE_W) * rel_clock**2 * static.power[:, None]
    hw = {
        "sm_clock_mhz": np.where(gpu, clock[:, None] * n(0.001), nan),
        "sm_active": np.where(gpu, np.clip(active * n(0.02), 0, 1), nan),
        "gpu_power_w": np.where(gpu, power * n(0.02), nan),
        "gpu_temp_c": np.where(gpu, (static.temp_c + fx.temp_delta)[:, None] * n(0.01), nan),
        "pcie_gbps": nan.copy(),
        # the worker's process: about a core for the training loop; the loader's workers while it stalls
        "cpu_self": np.where(KIND[None, :] == "dataloader", 6.0 * fx.cpu_self_factor[:, None], 1.0) * n(0.05),
        "cpu_other": np.clip((static.cpu_other + fx.cpu_other_delta)[:, None] * n(0.05), 0, 1),
        "mem_used_frac": np.clip(np.maximum(static.mem, fx.mem_floor)[:, None] * n(0.005), 0, 1),
        "disk_read_mbps": np.where(KIND[None, :] == "dataloader", DISK_MBPS * fx.disk_factor[:, None] * n(0.05), nan),
    }
    h2d = IDX["memcpy.h2d"]
    hw["pcie_gbps"][:, h2d] = work.pcie_gbps * n(0.02)[:, h2d]
    for m, cv in METRIC_CV.items():
        hw[f"{m}_sd"], hw[f"{m}_p95"] = _shape(rng, hw[m], cv, samples)
    # links: every member of a group moves bytes at the group's slowest rate, so every member's mean is that rate.
    # The slowest link is busy all the time (steady: SATURATED_CV); a faster one sends BURST_BYTES at its own
    # capacity, then idles until the slow hop drains them (duty d = rate / capacity: sd/mean sqrt((1 - d) / d)).
    # Samples longer than a burst average bursts out: only sqrt(burst / sample interval) of that spread shows.
    comm = COMM[None, :] & (total > 0)
    for metric, rates in _link_rates(topo, st, links).items():
        for key in (metric, f"{metric}_sd", f"{metric}_p95"):
            hw[key] = np.full((W, F), np.nan)
        for f, rate, cap in rates:
            ok = comm[:, f]
            duty = np.clip(rate / cap, 1e-3, 1.0)
            burst_us = BURST_BYTES / (rate * 1e3)
            shows = np.minimum(1.0, np.sqrt(burst_us * hz / 1e6))
            cv = np.hypot(SATURATED_CV * rng.lognormal(0.0, 0.2, W), np.sqrt((1.0 - duty) / duty) * shows)
            mean = rate * (1.0 + rng.normal(0.0, 0.02, W) / np.sqrt(np.maximum(samples[:, f], 1)))
            sd, p95 = _shape(rng, mean, cv, samples[:, f], cap * (1.0 + 1.645 * SATURATED_CV))
            for key, v in ((metric, mean), (f"{metric}_sd", sd), (f"{metric}_p95", p95)):
                hw[key][:, f] = np.where(ok, v, np.nan)
    return {k: v for k, v in hw.items() if k.removesuffix("_sd").removesuffix("_p95") in sampled}
