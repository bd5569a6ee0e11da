"""JAX profiler traces -> the op-event table, by way of the PyTorch trace reader.

``jax.profiler.trace(dir, create_perfetto_trace=True)`` (and ``start_trace``/``stop_trace``) writes
``<dir>/plugins/profile/<run>/perfetto_trace.json.gz`` (Chrome-trace JSON, no event categories) beside the
TensorBoard profile ``<host>.trace.json.gz`` (the same events, readable here too).  :func:`to_torch_form` renames a
JAX trace's events into the vocabulary :func:`~lockstep.producers.agent.trace.read_chrome_trace` already reads, and
:func:`read_jax_trace` reads it and puts the JAX-specific meaning back (which XLA ops are collectives, which ran on
the CPU).  One reader, one set of rules for steps, regions, launches and sync waits.

How a JAX trace maps:

- **Steps**: each ``jax.profiler.StepTraceAnnotation(name, step_num=N)`` (an event with ``args.step_num``) is step
  ``N`` (``ProfilerStep#N``).  Without one the reader's fallbacks apply (a repeating top-level region, else one step).
- **Host regions**: ``jax.profiler.TraceAnnotation`` / ``annotate_function`` spans on the host's threads are
  regions (``python`` functions named as annotated); JAX's and XLA's own runtime spans (``PjitFunction(f)``,
  ``Class::Method``, argument parsing, buffer handling) are operators: part of the region that holds them,
  functions of their own (``compute`` on the ``cpu``) outside every region.  Waits for results
  (``CommonPjRtBuffer::Await``, ``BlockHostUntilReady``) are ``sync`` waits.  Python-tracer frames (``$file:line
  name``) are left out: the tracer records every call of JAX's own tracing machinery, and its names carry no path
  to tell the user's frames from JAX's.  Compiler threads are left out too; compilation shows as the host's
  ``backend_compile_and_load`` operator.
- **XLA ops** (events with ``args.hlo_op``: the CPU client's thunks on the host, ``XLA Ops`` lines on a device):
  device work named by the op's named scope (``args.tf_op`` / ``long_name`` where the profiler writes it, the
  ``jax.named_scope`` path) else ``<module>/<op>``; collectives (``all-reduce``, ``all-gather``, ``reduce-scatter``,
  ``collective-permute``, ``all-to-all``) are ``collective`` on the ``nic``; the rest is ``compute``, on the ``cpu``
  for a CPU device, the ``gpu`` otherwise.  Each op counts in the step that *launched* it: the host's dispatch of its
  run (the last ``PjitFunction``/``Execute`` span begun before the run's first op), so work that XLA runs after the
  host moved on stays with its step.
- **Who**: the rank is the caller's (the live agent's ``jax.process_index()``), else a ``rank<N>`` / ``worker<N>`` /
  ``process<N>`` in the file's name or a folder above it (``jax.profiler.trace(f"traces/rank{jax.process_index()}")``);
  the host is the TensorBoard file's (``<host>.xplane.pb`` beside the trace).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.events import MAX_STEP, OP_EVENT_SCHEMA
from .trace import (
    MAX_TRACE_BYTES,
    TraceError,
    TraceEvents,
    file_rank,
    read_bounded,
    read_chrome_trace,
    read_chrome_trace_parts,
)

PERFETTO_NAME = "perfetto_trace.json.gz"
#: the key a converted trace carries (it is read as a torch trace, not converted again)
_CONVERTED = "lockstepConvertedFrom"
#: XLA's collective ops (``all-reduce.3``, ``all-gather-start``, ``collective-permute-done`` ...)
_COLLECTIVE = re.compile(r"(?:^|[/.])(?:all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|psum)", re.I)
_P2P = re.compile(r"collective-permute|send|recv", re.I)
#: host spans of JAX's and XLA's own runtime (not the user's annotations)
_RUNTIME = re.compile(
    r"::|^(?:Pjit|Pmap|Xla)[A-Za-z]*Function\(|^ExecuteReplicated|^(?:Parse|Handle|Allocate|Wait for|DevicePut|shard_args|"
    r"lower_|backend_compile|compile|PythonRefManager|Execute|Await|Transfer|Copy|Deallocate)",
)
_WAIT = re.compile(r"Await|BlockHostUntilReady|block_until_ready", re.I)
_DISPATCH = re.compile(r"^(?:Pjit|Pmap)[A-Za-z]*Function\(|Execute(?!.*wait for completion)", re.I)
_SKIP_THREADS = re.compile(r"Compiler|codegen|compile", re.I)
_RANK_IN_PATH = re.compile(r"(?:^|[^a-z])(?:process|proc)[-_]?(\d{1,8})(?!\d)", re.I)
#: device numbers of CPU devices are moved past every accelerator's, so that the two never share a label
CPU_DEVICE_BASE = 1 << 20


def is_jax_trace(trace: dict) -> bool:
    """Does this Chrome trace come from the JAX (XLA/TSL) profiler?  Its processes are named ``/host:CPU`` and
    ``/device:...``; torch.profiler's never are."""
    events = trace.get("traceEvents")
    for e in events[:200] if isinstance(events, list) else ():
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name":
            name = str((e.get("args") or {}).get("name", ""))
            if name.startswith(("/host:", "/device:")):
                return True
    return False


def jax_profiles(folder: Path) -> list[Path]:
    """The JAX traces a folder stands for: the profiler's log folder itself (``<dir>/plugins/profile/<run>/``), or one
    per log folder in it (``traces/rank0``, ``traces/rank1``, ...); of several runs in one log folder, the last."""
    out = []
    for log_dir in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]:
        runs = sorted(log_dir.glob(f"plugins/profile/*/{PERFETTO_NAME}"))
        if runs:
            out.append(runs[-1])
        if log_dir == folder and runs:
            break
    return out


def is_jax_source(source: str | Path | dict) -> bool:
    """A trace the JAX profiler wrote: by its file's name (``perfetto_trace.json.gz``, or ``<host>.trace.json.gz``
    beside ``<host>.xplane.pb``), or, for a parsed object, by its processes' names (not one already converted)."""
    if isinstance(source, dict):
        return source.get(_CONVERTED) is None and is_jax_trace(source)
    path = Path(source)
    if path.name == PERFETTO_NAME:
        return True
    host = path.name.split(".trace.json")[0] if ".trace.json" in path.name else ""
    return bool(host) and (path.parent / f"{host}.xplane.pb").exists()


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 18:
        return int(value)
    return None


def to_torch_form(trace: dict, step_name: str | None = None) -> tuple[dict, frozenset[int]]:
    """The JAX trace in torch.profiler's vocabulary (categories, ``ProfilerStep#N``, launch correlations), and the
    device numbers (``args.device``) it gave the CPU devices.  With ``step_name``, only the step annotations of that
    name are steps (the live agent's own); other step annotations are left out (they mark the same iterations)."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise TraceError("not a Chrome-trace JSON object with traceEvents")
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M":
            name = str((e.get("args") or {}).get("name", ""))
            if e.get("name") == "process_name":
                procs[e.get("pid")] = name
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = name
    out: list[dict] = [e for e in events if isinstance(e, dict) and e.get("ph") == "M"]
    host_pids = {p for p, n in procs.items() if n.startswith("/host:")}
    dispatch_ts: list[float] = []
    ops: list[dict] = []  # XLA ops, given their launch afterwards
    cpu_devices: set[int] = set()
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        name = str(e.get("name", ""))
        raw_args = e.get("args")
        args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
        pid, tid = e.get("pid"), e.get("tid")
        if "hlo_op" in args:
            ops.append(e)
            continue
        if pid not in host_pids or name.startswith(("$", "end: ")):
            continue  # device lines other than ops (modules, streams), Python-tracer frames, span ends
        if _SKIP_THREADS.search(threads.get((pid, tid), "")):
            continue
        if "device_ordinal" in args or name.startswith("ThreadpoolListener"):
            continue  # the executor's own bookkeeping on its thread
        step = _int(args.get("step_num"))
        if step is not None and step_name is not None and name != step_name:
            continue
        if step is not None:
            if step > MAX_STEP:
                raise TraceError(f"{name}: a step number beyond {MAX_STEP}")
            out.append({**e, "cat": "user_annotation", "name": f"ProfilerStep#{step}"})
        elif _WAIT.search(name):
            out.append({**e, "cat": "cuda_sync"})
        elif _RUNTIME.search(name):
            out.append({**e, "cat": "cpu_op"})
            if _DISPATCH.search(name):
                dispatch_ts.append(float(e.get("ts", 0.0)))
        else:
            out.append({**e, "cat": "user_annotation"})
    # the launch of each run of XLA ops: the last dispatch the host began before the run's first op
    runs: dict[tuple[Any, Any], float] = {}
    for e in ops:
        key = (e.get("pid"), e["args"].get("run_id"))
        runs[key] = min(runs.get(key, np.inf), float(e.get("ts", 0.0)))
    starts = np.sort(np.array(dispatch_ts, dtype=np.float64))
    corr_of: dict[tuple[Any, Any], int] = {}
    host_tid = next((t for (p, t), n in threads.items() if p in host_pids and n == "python"), 0)
    host_pid = next(iter(host_pids), 0)
    for key, first in sorted(runs.items(), key=lambda kv: kv[1]):
        i = int(np.searchsorted(starts, first, side="right")) - 1
        if i < 0:
            continue  # dispatched before the trace began: the op counts where it ran
        corr_of[key] = len(corr_of) + 1
        out.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "xla launch",
                "pid": host_pid,
                "tid": host_tid,
                "ts": float(starts[i]),
                "dur": 0.0,
                "args": {"correlation": corr_of[key]},
            }
        )
    for e in ops:
        args = e["args"]
        on_host = e.get("pid") in host_pids or procs.get(e.get("pid"), "").startswith("/device:CPU")
        ordinal = _int(args.get("device_ordinal"))
        if ordinal is None:
            ordinal = _int(procs.get(e.get("pid"), "").rsplit(":", 1)[-1]) or 0
        device = CPU_DEVICE_BASE + ordinal if on_host else ordinal
        if on_host:
            cpu_devices.add(device)
        scope = args.get("tf_op") or args.get("long_name") or ""
        label = str(scope) if scope else f"{args.get('hlo_module', 'xla')}/{args['hlo_op']}"
        new_args: dict[str, Any] = {"device": device}
        corr = corr_of.get((e.get("pid"), args.get("run_id")))
        if corr is not None:
            new_args["correlation"] = corr
        out.append({**e, "cat": "kernel", "name": label, "args": new_args})
    header = {k: v for k, v in trace.items() if k != "traceEvents"}
    return {**header, _CONVERTED: "jax", "traceEvents": out}, frozenset(cpu_devices)


def load_jax_trace(source: str | Path | dict, max_bytes: int = MAX_TRACE_BYTES) -> dict:
    if isinstance(source, dict):
        return source
    try:
        doc = msgspec.json.decode(read_bounded(source, max_bytes))
    except msgspec.DecodeError as exc:
        raise TraceError(f"not a Chrome-trace JSON object with traceEvents ({exc})") from None
    except RecursionError:
        raise TraceError("not a Chrome-trace JSON object with traceEvents (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise TraceError("not a Chrome-trace JSON object with traceEvents")
    return doc


def path_rank(path: Path) -> int | None:
    """The rank a JAX trace's path carries: in its name, its run's folder, else the log folder the profiler was given
    (``rank3/plugins/profile/<run>/perfetto_trace.json.gz``).  Folders above that are not asked (a ``/home/worker1``
    would give every file one rank)."""
    places = [path, path.parent]
    run = path.parent
    if run.parent.name == "profile" and run.parent.parent.name == "plugins":
        places.append(run.parent.parent.parent)
    for part in places:
        r = file_rank(part)
        if r is None:
            m = _RANK_IN_PATH.search(part.name)
            r = int(m.group(1)) if m else None
        if r is not None:
            return r
    return None


def path_host(path: Path) -> str:
    """The host the TensorBoard profile beside the trace names (``<host>.xplane.pb``), else ``""``."""
    try:
        for sib in path.parent.glob("*.xplane.pb"):
            return sib.name.removesuffix(".xplane.pb")
    except OSError:
        pass
    name = path.name
    return name.split(".trace.json")[0] if ".trace.json" in name else ""


def read_jax_trace(
    source: str | Path | dict,
    worker: int | None = None,
    *,
    host: str = "",
    step_name: str | None = None,
    max_bytes: int = MAX_TRACE_BYTES,
) -> TraceEvents:
    """Read one JAX process's trace (``perfetto_trace.json.gz``, ``<host>.trace.json.gz`` or the parsed object)."""
    path = None if isinstance(source, dict) else Path(source)
    doc = load_jax_trace(source, max_bytes)
    try:
        converted, cpu_devices = to_torch_form(doc, step_name)
    except TraceError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a field of an unexpected type
        raise TraceError(f"not a JAX profiler trace this reader understands ({type(exc).__name__}: {exc})") from None
    host = host or (path_host(path) if path is not None else "")
    if host:
        converted["hostName"] = host
    rank_from = "given"
    if worker is None and path is not None:
        worker = path_rank(path)
        rank_from = "file name"
    te = read_chrome_trace(converted, worker)
    te = replace(te, meta=replace(te.meta, rank_from=rank_from if worker is not None else ""))
    return retag(te, cpu_devices, host)


def retag(te: TraceEvents, cpu_devices: frozenset[int], host: str) -> TraceEvents:
    """Put back what torch's vocabulary cannot say: XLA collectives, and work on CPU devices."""
    t = te.events
    if t.num_rows == 0:
        return te
    fn = t.column("function")
    kind = t.column("kind").to_numpy(zero_copy_only=False).astype(object)
    res = t.column("resource").to_numpy(zero_copy_only=False).astype(object)
    dev = t.column("device").to_numpy(zero_copy_only=False).astype(object)
    is_dev = (kind == "compute") & (res == "gpu")
    cpu_labels = {f"{host}/gpu{d}" for d in cpu_devices}
    on_cpu = is_dev & np.isin(dev, list(cpu_labels)) if cpu_labels else np.zeros(len(kind), dtype=bool)
    coll = is_dev & pc.match_substring_regex(fn, _COLLECTIVE.pattern, ignore_case=True).to_numpy(zero_copy_only=False)
    p2p = coll & pc.match_substring_regex(fn, _P2P.pattern, ignore_case=True).to_numpy(zero_copy_only=False)
    kind[coll] = np.where(p2p[coll], "p2p", "collective")
    res[coll] = "nic"
    res[on_cpu & ~coll] = "cpu"
    cpu_name = f"{host}/cpu" if host else "cpu"
    dev[on_cpu] = cpu_name
    sync_cpu = (kind == "sync") & np.isin(dev, list(cpu_labels)) if cpu_labels else np.zeros(len(kind), dtype=bool)
    dev[sync_cpu] = cpu_name
    events = t
    for col, values in (("kind", kind), ("resource", res), ("device", dev)):
        i = events.schema.get_field_index(col)
        events = events.set_column(i, OP_EVENT_SCHEMA.field(col), pa.array(values.tolist(), pa.string()))
    meta = te.meta
    if meta.device and any(meta.device == lbl for lbl in cpu_labels):
        meta = replace(meta, device=cpu_name)
    return replace(te, events=events, meta=meta)


def read_trace_parts(
    source: str | Path, worker: int | None = None, *, max_bytes: int = MAX_TRACE_BYTES, anonymous_as: int | None = None
) -> Iterator[TraceEvents]:
    """One worker's trace file, whichever profiler wrote it, in parts of whole steps: ``torch.profiler``'s in bounded
    memory (:func:`~lockstep.producers.agent.trace.read_chrome_trace_parts`, ``anonymous_as`` with it), JAX's whole
    (one part)."""
    if is_jax_source(source):
        te = read_jax_trace(source, worker, max_bytes=max_bytes)
        if te.worker is None and anonymous_as is not None:  # its events as that worker's meanwhile
            te = replace(te.with_worker(anonymous_as), worker=None, meta=te.meta)
        yield te
    else:
        yield from read_chrome_trace_parts(source, worker, max_bytes=max_bytes, anonymous_as=anonymous_as)


def read_trace(
    source: str | Path | dict[str, Any], worker: int | None = None, *, max_bytes: int = MAX_TRACE_BYTES
) -> TraceEvents:
    """Read one worker's trace, whichever profiler wrote it: JAX's (renamed into the torch reader's vocabulary,
    :func:`read_jax_trace`) or ``torch.profiler``'s (:func:`~lockstep.producers.agent.trace.read_chrome_trace`)."""
    if is_jax_source(source):
        return read_jax_trace(source, worker, max_bytes=max_bytes)
    return read_chrome_trace(source, worker, max_bytes=max_bytes)
