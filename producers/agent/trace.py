"""PyTorch profiler Chrome-trace JSON -> op-event table (:data:`lockstep.schemas.events.OP_EVENT_SCHEMA`).

One trace file is one worker, as ``torch.profiler`` writes it
(``export_chrome_trace`` or ``tensorboard_trace_handler``, optionally gzipped):
the rank comes from ``distributedInfo.rank``, the steps from the
``ProfilerStep#N`` annotations, and traces without any GPU activity (CPU-only
jobs) are read the same way.

Which events become functions, and under which stable name:

- **GPU kernels** (``kernel``): each one, named by its normalised kernel name
  (no return type, no argument list).  NCCL kernels are collectives (``p2p``
  for send/recv), everything else ``compute`` on the ``gpu``.
- **Copies** (``gpu_memcpy``, ``gpu_memset``): ``memcpy``; host<->device over
  ``pcie``, peer-to-peer over ``nvlink``, on-device on the ``gpu``.
- **Communication on CPU threads** (``nccl:*``, ``gloo:*``, ``c10d::*``):
  collectives by name and process group, e.g. ``gloo:all_reduce[default_pg]``.
- **CPU regions**: ``record_function`` annotations and Python frames
  (``with_stack``), named by call site (``train.py(42): slow_function``, the
  path reduced to its file name so that it is the same on every host);
  ``Optimizer.*`` annotations are ``optimizer``, ``DataLoader`` ones
  ``dataloader``, the rest ``python``.  Operators inside a region are part of
  it; operators outside every region (top-level ``aten::*``) are functions of
  their own (``compute`` on the ``cpu``).

Regions nest; the summariser credits each instant to the innermost one.  An
event belongs to the step whose ``ProfilerStep#N`` span holds its start.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from ...schemas.events import OP_EVENT_SCHEMA

MAX_NAME = 200


class TraceError(ValueError):
    """The trace cannot be read as a PyTorch profiler trace; the message says why."""


@dataclass(frozen=True)
class ProcessGroup:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass
class TraceMeta:
    host: str = ""
    device: str = ""  # "<host>/gpu<N>" when the trace holds GPU activity, else ""
    backend: str = ""  # distributed backend: nccl, gloo, ...
    world_size: int | None = None
    process_groups: tuple[ProcessGroup, ...] = ()
    gpu: str = ""  # GPU model from deviceProperties
    trace_id: str = ""


@dataclass
class TraceEvents:
    worker: int
    events: pa.Table  # OP_EVENT_SCHEMA
    step_bounds: dict[int, tuple[float, float]]  # step -> (start_us, end_us) on this worker's clock
    meta: TraceMeta = field(default_factory=TraceMeta)


class _Event(msgspec.Struct, forbid_unknown_fields=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    args: dict[str, Any] = {}


class _Trace(msgspec.Struct, forbid_unknown_fields=False):
    traceEvents: list[_Event]  # noqa: N815 - the format's own names
    distributedInfo: dict[str, Any] = {}  # noqa: N815
    deviceProperties: list[dict[str, Any]] = []  # noqa: N815
    host_name: str = ""
    trace_id: str = ""


_decoder = msgspec.json.Decoder(_Trace)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_CALL_SITE = re.compile(r"^(?P<path>.*?)\((?P<line>\d+)\): (?P<func>.*)$")
_COMM_PREFIXES = ("nccl:", "gloo:", "c10d::", "mpi:", "ucc:")
_P2P = re.compile(r"send|recv", re.I)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "user_annotation", "python_function")


def read_chrome_trace(source: str | Path | dict, worker: int | None = None) -> TraceEvents:
    """Read one worker's trace: a file path (``.json`` or ``.json.gz``) or the parsed JSON object."""
    trace = _load(source)
    dist = trace.distributedInfo or {}
    if worker is None:
        rank = dist.get("rank")
        if not isinstance(rank, int) or rank < 0:
            raise TraceError("no distributedInfo.rank in the trace (not a torch.distributed job?); give the worker's rank explicitly")
        worker = rank
    host = trace.host_name or ""
    groups = tuple(
        ProcessGroup(str(pg.get("pg_name", "")), str(pg.get("pg_desc", "")), tuple(int(r) for r in pg.get("ranks", []) or []))
        for pg in dist.get("pg_config", []) or []
        if isinstance(pg, dict)
    )
    ev = [e for e in trace.traceEvents if e.ph == "X" and (e.cat in GPU_CATS or e.cat in CPU_CATS)]
    bounds: dict[int, tuple[float, float]] = {}
    for e in ev:
        m = _STEP.match(e.name) if e.cat == "user_annotation" else None
        if m and int(m.group(1)) not in bounds:
            bounds[int(m.group(1))] = (float(e.ts), float(e.ts) + float(e.dur))
    if not bounds:
        raise TraceError("no ProfilerStep#N annotations: profile with torch.profiler.profile(schedule=...) and call prof.step() every step")
    gpu_pids = [e.pid for e in ev if e.cat in GPU_CATS]
    gpu_id = max(set(gpu_pids), key=gpu_pids.count) if gpu_pids else None
    meta = TraceMeta(
        host=host,
        device=f"{host}/gpu{gpu_id}" if gpu_id is not None else "",
        backend=str(dist.get("backend", "")),
        world_size=dist.get("world_size") if isinstance(dist.get("world_size"), int) else None,
        process_groups=groups,
        gpu=str((trace.deviceProperties or [{}])[0].get("name", "")) if trace.deviceProperties else "",
        trace_id=trace.trace_id,
    )
    pg_suffix = f"[{groups[0].desc or groups[0].name}]" if len(groups) == 1 else ""
    return TraceEvents(worker=worker, events=_events(ev, worker, bounds, host, pg_suffix), step_bounds=dict(sorted(bounds.items())), meta=meta)


def _load(source: str | Path | dict) -> _Trace:
    try:
        if isinstance(source, dict):
            return msgspec.convert(source, _Trace)
        path = Path(source)
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return _decoder.decode(raw)
    except OSError as exc:
        raise TraceError(f"cannot read it: {exc.strerror or exc}") from None
    except (msgspec.DecodeError, msgspec.ValidationError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(f"not a Chrome-trace JSON object with traceEvents ({exc})") from None


def _events(ev: list[_Event], worker: int, bounds: dict[int, tuple[float, float]], host: str, pg_suffix: str) -> pa.Table:
    n = len(ev)
    cat = np.array([e.cat for e in ev], dtype=object)
    name = np.array([e.name for e in ev], dtype=object)
    ts = np.fromiter((e.ts for e in ev), dtype=np.float64, count=n)
    dur = np.fromiter((e.dur for e in ev), dtype=np.float64, count=n)
    stream = np.array([f"{e.pid}/{e.tid}" for e in ev], dtype=object)

    # the step whose ProfilerStep span holds the event's start
    steps = np.array(sorted(bounds), dtype=np.int64)
    starts = np.array([bounds[s][0] for s in steps])
    ends = np.array([bounds[s][1] for s in steps])
    k = np.searchsorted(starts, ts, side="right") - 1
    in_step = (k >= 0) & (ts < ends[np.clip(k, 0, None)])
    is_step = np.array([bool(_STEP.match(x)) for x in name]) & (cat == "user_annotation")

    gpu = np.isin(cat, GPU_CATS)
    cpu = ~gpu & ~is_step
    comm = cpu & np.array([x.startswith(_COMM_PREFIXES) for x in name])
    region = cpu & ~comm & (cat != "cpu_op")
    keep = in_step & (gpu | comm | region | (cpu & (cat == "cpu_op") & ~_nested(stream, ts, dur, cpu)))
    idx = np.flatnonzero(keep)

    # name each distinct (category, name, process group) once; traces repeat the same kernels thousands of times
    named: dict[tuple[str, str, str], tuple[str, str, str]] = {}
    keys = [(cat[i], name[i], (_pg(ev[i]) if comm[i] else "") or pg_suffix) for i in idx]
    fn, kind, res = (list(x) for x in zip(*[named.get(k) or named.setdefault(k, _classify(*k)) for k in keys])) if keys else ([], [], [])
    nbytes = np.array([_bytes(ev[i]) if cat[i] == "gpu_memcpy" else np.nan for i in idx], dtype=np.float64)
    device = np.array([f"{host}/gpu{ev[i].pid}" if gpu[i] else None for i in idx], dtype=object)
    return pa.Table.from_pydict(
        {
            "worker": np.full(idx.size, worker, dtype=np.int64),
            "step": steps[k[idx]],
            "function": fn,
            "kind": kind,
            "start_us": ts[idx],
            "duration_us": np.maximum(dur[idx], 0.0),
            "host": [host or None] * idx.size,
            "device": device.tolist(),
            "resource": res,
            "bytes": nbytes,
            "stream": stream[idx].tolist(),
        },
        schema=OP_EVENT_SCHEMA,
    )


def _nested(stream: np.ndarray, ts: np.ndarray, dur: np.ndarray, among: np.ndarray) -> np.ndarray:
    """For the ``among`` events: does another of them on the same thread enclose it?"""
    out = np.zeros(ts.size, dtype=bool)
    idx = np.flatnonzero(among)
    if idx.size == 0:
        return out
    _, thread = np.unique(stream[idx].astype(str), return_inverse=True)
    order = np.lexsort((-dur[idx], ts[idx], thread))
    t0 = ts[idx][order] - ts[idx].min()
    big = float(t0.max() + dur[idx].max() + 1.0)
    off = thread[order] * big  # threads are separate segments of one running maximum
    end = off + t0 + dur[idx][order]
    prev = np.concatenate([[-np.inf], np.maximum.accumulate(end)[:-1]])
    out[idx[order]] = off + t0 < prev
    return out


def _pg(e: _Event) -> str:
    return str(e.args.get("Process Group Description") or e.args.get("Process Group Name") or "")


def _bytes(e: _Event) -> float:
    b = e.args.get("bytes")
    return float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else np.nan


def _classify(cat: str, name: str, pg: str) -> tuple[str, str, str]:
    """(function, kind, resource) of a kept event; ``pg`` names its process group ("[default_pg]" or "")."""
    if cat == "kernel":
        key = kernel_key(name)
        if "nccl" in name.lower():
            return key, "p2p" if _P2P.search(key) else "collective", "nic"
        return key, "compute", "gpu"
    if cat in ("gpu_memcpy", "gpu_memset"):
        resource = "pcie" if ("HtoD" in name or "DtoH" in name) else "nvlink" if "PtoP" in name else "gpu"
        return _cap(name), "memcpy", resource
    if name.startswith(_COMM_PREFIXES):
        suffix = pg if pg.startswith("[") or not pg else f"[{pg}]"
        return _cap(name + suffix), "p2p" if _P2P.search(name) else "collective", "nic"
    if cat == "python_function":
        return _cap(call_site(name)), "python", "cpu"
    if cat == "user_annotation":
        if name.startswith("Optimizer."):
            return _cap(name), "optimizer", "cpu"
        if "dataloader" in name.lower():
            return _cap(name), "dataloader", "cpu"
        return _cap(call_site(name)), "python", "cpu"
    return _cap(name.removeprefix("autograd::engine::evaluate_function: ")), "compute", "cpu"


def kernel_key(name: str) -> str:
    """A kernel's stable key: no ``void``, no argument list, single spaces."""
    n = " ".join(name.split())
    n = n.removeprefix("void ")
    if n.endswith(")"):
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                if i > 0:
                    n = n[:i].rstrip()
                break
    return _cap(n)


def call_site(name: str) -> str:
    """``/home/me/train.py(42): step`` -> ``train.py(42): step`` (the same on every host)."""
    m = _CALL_SITE.match(name)
    if not m:
        return name
    file = re.split(r"[/\\]", m.group("path"))[-1]
    return f"{file}({m.group('line')}): {m.group('func')}"


def _cap(name: str) -> str:
    if len(name) <= MAX_NAME:
        return name
    return name[: MAX_NAME - 13] + "~" + hashlib.sha1(name.encode()).hexdigest()[:12]
