"""PyTorch profiler Chrome-trace JSON -> op-event table (:data:`lockstep.schemas.events.OP_EVENT_SCHEMA`).

One trace file is one worker, as ``torch.profiler`` writes it
(``export_chrome_trace`` or ``tensorboard_trace_handler``, optionally gzipped),
CPU-only or with device activity (CUDA, ROCm, MTIA), in today's Kineto format or
the older one (``Operator`` / ``Runtime`` / ``Kernel`` categories).

**Who.**  The rank comes from ``distributedInfo.rank``, else from the file name
(``rank-3``, ``rank3``, ``rank_3``, ``worker3``), else it is left to the caller
(``worker`` is None).  The host is the trace's ``hostName`` / ``host_name``, else
the file name up to its first dot (``tensorboard_trace_handler`` writes
``<host>_<pid>.<time>.pt.trace.json``; the ``_<pid>`` is dropped); the device is
``<host>/gpu<N>`` (``mtia<N>``) for the accelerator that ran most device events.

**Steps.**  ``ProfilerStep#N`` annotations give the steps.  Without them the
iterations are inferred: each ``Optimizer.step`` ends one (the first begins with
the trace), else each occurrence of the top-level annotation that repeats and
covers at least half the trace is one, else the whole trace is step 0;
``meta.steps_from`` says which.  CPU events belong to the step whose span holds
their start (of overlapping spans, the one begun last).
Device events (kernels, copies, memsets, device-side NCCL kernels) belong to the
step that *launched* them: the runtime call with the same ``correlation``, else
the ``ac2g`` flow that ends on them, gives the launch time (a device event with
neither falls back to its own start).  A step spans from its start to the end of
the last device work it launched, so GPU work that runs after the CPU moved on,
and the last step's, stays with its step.

Which events become functions, and under which stable name:

- **Device kernels** (``kernel``, ROCm's and other ``gpu_*`` device categories,
  MTIA's ``mtia_ccp_events``): each one by its normalised kernel name (no return
  type, no argument list).  NCCL kernels are collectives (``p2p`` for send/recv),
  everything else ``compute`` on the ``gpu``.
- **Copies** (``gpu_memcpy``, ``gpu_memset``): ``memcpy``; host<->device over
  ``pcie``, peer-to-peer over ``nvlink``, on-device on the ``gpu``.  Only
  host-to-device copies carry ``bytes``: the worker's input.
- **Sync waits** (``sync``): runtime calls that block the host until the device
  catches up: device / stream / event synchronize, synchronous copies, and an
  asynchronous copy call still running when its copy began (it waited for the
  stream to get there and for the copy: ``cudaMemcpyAsync`` from or to pageable
  memory); ``cuda_sync`` records of a call the trace
  does not hold; a device's own event waits (MTIA ``event_wait``).  Named by
  the call.  Other runtime calls (launches) stay part of the CPU function that
  made them.
- **Communication on CPU threads** (``nccl:*``, ``gloo:*``, ``c10d::*``):
  collectives by name and process group, e.g. ``gloo:all_reduce[default_pg]``.
- **Collective numbers**: where the trace numbers its collectives (``record_param_comms``'s ``Seq`` with its
  process group, as torch's NCCL backend writes them), each collective event (the ``c10d::`` / ``nccl:``
  operators, the NCCL kernels) takes the number of its call, and the op events get the optional
  ``collective_seq`` and ``process_group`` columns (:func:`_sequence`; the group by its name where
  ``distributedInfo.pg_config`` gives it, :func:`_group_names`); a trace without numbers gets neither.
- **CPU regions**: ``record_function`` annotations and Python frames
  (``with_stack``), named by call site (``train.py(42): slow_function``, the
  path reduced to its file name so that it is the same on every host);
  ``Optimizer.*`` annotations are ``optimizer``, ``DataLoader`` ones
  ``dataloader``, the rest ``python``.  Operators inside a region are part of
  it; operators outside every region (top-level ``aten::*``) are functions of
  their own (``compute`` on the ``cpu``).

Regions nest; the summariser credits each instant to the innermost one.

**Bounds.**  A file larger than ``max_bytes`` (after decompression, read in
chunks), nested deeper than the decoder allows, a step number or rank beyond
what records can carry, or an event lasting more than ``MAX_DURATION_US`` is a
:class:`TraceError` that says so; nothing is read without a limit.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.errors import LockstepError
from ...schemas.events import (
    COLLECTIVE_FIELDS,
    MAX_DURATION_US,
    MAX_STEP,
    MAX_TIME_US,
    MAX_WORKER,
    OP_EVENT_SCHEMA,
)
from .trace_json import (
    EVENT_COLUMNS,
    FLOW_COLUMNS,
    Columns,
    Head,
    Spilled,
    TraceReadError,
    read_file,
    read_object,
    release_memory,
)

MAX_NAME = 200
#: largest trace accepted, after decompression (a JSON trace decodes to a few times its size in memory)
MAX_TRACE_BYTES = 2 << 30
#: events (complete and flow) of a trace read whole; a larger one is read in parts of about this many
#: (:func:`read_chrome_trace_parts`)
PART_EVENTS = 1_000_000
#: events of a spilled chunk (what a part reads back at once)
CHUNK_EVENTS = 1 << 18
_CHUNK = 16 << 20


class TraceError(LockstepError, ValueError):
    """The trace cannot be read as a PyTorch profiler trace; the message says why."""


@dataclass(frozen=True)
class ProcessGroup:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass
class TraceMeta:
    host: str = ""
    device: str = ""  # "<host>/gpu<N>" when the trace holds device activity, else ""
    backend: str = ""  # distributed backend: nccl, gloo, ...
    world_size: int | None = None
    process_groups: tuple[ProcessGroup, ...] = ()
    gpu: str = ""  # device model from deviceProperties
    trace_id: str = ""
    rank_from: str = ""  # "given" | "trace" (distributedInfo.rank) | "file name" | "" (unknown: worker is None)
    steps_from: str = ""  # "ProfilerStep" | "Optimizer.step" | "region <name>" | "whole trace"


@dataclass
class TraceEvents:
    worker: int | None  # None: neither the caller, the trace nor the file name said (events carry worker -1)
    events: pa.Table  # OP_EVENT_SCHEMA
    step_bounds: dict[int, tuple[float, float]]  # step -> (start_us, end_us) on this worker's clock
    meta: TraceMeta = field(default_factory=TraceMeta)

    def with_worker(self, worker: int, rank_from: str = "given") -> TraceEvents:
        """The same events as another worker's (a rank the caller decided)."""
        col = pa.array(np.full(self.events.num_rows, worker, dtype=np.int64))
        events = self.events.set_column(0, OP_EVENT_SCHEMA.field("worker"), col)
        return replace(self, worker=worker, events=events, meta=replace(self.meta, rank_from=rank_from))


_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_CALL_SITE = re.compile(r"^(?P<path>.*?)\((?P<line>\d+)\): (?P<func>.*)$")
_FILE_RANK = re.compile(r"(?:^|[^a-z])(?:rank|worker)[-_]?(\d{1,8})(?!\d)", re.I)
_COMM_PREFIXES = ("nccl:", "gloo:", "c10d::", "mpi:", "ucc:")
_P2P = re.compile(r"send|recv", re.I)
#: calls that block the host until the device is done: synchronize, synchronous copies (no "Async")
_BLOCKING_CALL = re.compile(r"synchronize|^(?:cuda|hip|cu)Memcpy(?!.*Async)", re.I)
#: the Kineto format before 1.9 named the categories differently
_LEGACY_CATS = {
    "Operator": "cpu_op",
    "Runtime": "cuda_runtime",
    "Kernel": "kernel",
    "Memcpy": "gpu_memcpy",
    "Memset": "gpu_memset",
}
CPU_CATS = ("cpu_op", "user_annotation", "python_function")
COPY_CATS = ("gpu_memcpy", "gpu_memset")
RUNTIME_CATS = (
    "cuda_runtime",
    "cuda_driver",
    "mtia_runtime",
    "xpu_runtime",
    "xpu_driver",
    "privateuse1_runtime",
    "privateuse1_driver",
)
SYNC_CATS = ("cuda_sync", "xpu_sync")
MTIA_CATS = ("mtia_ccp_events",)
#: device categories that are not work: annotations mirrored on the device's timeline
_NOT_DEVICE_WORK = ("gpu_user_annotation",)


def read_chrome_trace(
    source: str | Path | dict[str, Any], worker: int | None = None, *, max_bytes: int = MAX_TRACE_BYTES
) -> TraceEvents:
    """Read one worker's ``torch.profiler`` trace: a file path (``.json`` or ``.json.gz``) or the parsed JSON object
    (:func:`~lockstep.producers.agent.jaxtrace.read_trace` also takes JAX's)."""
    if isinstance(source, dict):
        head, cols = _wrap(read_object, source)
        path = None
    else:
        path = Path(source)
        with open_regular(source, max_bytes, "trace") as fh:
            head, read = _wrap(read_file, fh, max_bytes)
        cols = cast(Columns, read)  # nothing spilled without a folder
    who = _who(head, worker, path)
    events, bounds, steps_from, dev = _read_events(
        cols, -1 if who.worker is None else who.worker, who.host, who.pg_suffix
    )
    del cols
    release_memory()
    return _trace_events(head, who, events, bounds, steps_from, dev)


def read_chrome_trace_parts(
    source: str | Path,
    worker: int | None = None,
    *,
    max_bytes: int = MAX_TRACE_BYTES,
    part_events: int | None = None,
    anonymous_as: int | None = None,
) -> Iterator[TraceEvents]:
    """One worker's trace file read in parts of whole steps, in bounded memory: each part's events and bounds are
    those of a run of its steps, together the ones :func:`read_chrome_trace` gives (a summary of each part is a
    summary of its steps).  A trace of at most ``part_events`` events (complete and flow) is one part.

    A larger one is written to a temporary folder (``TMPDIR``; about 60 bytes an event) as it is read, and read
    back a chunk at a time: a pass finds the steps (``ProfilerStep#N``, else inferred as the whole read infers
    them), the main device and whether the trace numbers its collectives, a second counts each step's events, and
    the steps are grouped so that each part holds about ``part_events`` events.  A part takes the events that
    overlap its time (the regions and calls around its own), the device work its runtime calls launched (by
    correlation id), and device work that no call of an earlier part launched and that began in it; each event is
    kept by the part whose step it belongs to.  So the memory is one part's events and one chunk, whatever the
    trace's size.  A trace that is one step is read back whole: one part, as :func:`read_chrome_trace`.  So is one
    whose rank is not known (the caller numbers it later), unless ``anonymous_as`` says whose its events are
    meanwhile (its parts' ``worker`` stays None)."""
    path = Path(source)
    part_events = part_events or PART_EVENTS
    try:
        yield from _parts_spilled(path, worker, max_bytes, part_events, anonymous_as)
    except OSError as exc:  # the temporary folder: full, gone, not writable
        raise TraceError(
            f"cannot spill the trace's events to {tempfile.gettempdir()} ({exc.strerror or exc}): set TMPDIR to a "
            "folder with room for about 60 bytes an event"
        ) from None


def _parts_spilled(
    path: Path, worker: int | None, max_bytes: int, part_events: int, anonymous_as: int | None
) -> Iterator[TraceEvents]:
    """:func:`read_chrome_trace_parts`, its temporary folder made only once a chunk is spilled, removed at the end."""
    with contextlib.ExitStack() as stack:

        def folder() -> Path:
            return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lockstep-trace-")))

        with open_regular(path, max_bytes, "trace") as fh:
            head, cols = _wrap(
                read_file,
                fh,
                max_bytes,
                spill=folder,
                spill_rows=part_events,
                chunk_rows=min(part_events, CHUNK_EVENTS),
            )
        who = _who(head, worker, path)
        whose = who.worker if who.worker is not None else anonymous_as if anonymous_as is not None else -1
        if isinstance(cols, Spilled) and whose >= 0:
            parts = _read_parts(cols, whose, who.host, who.pg_suffix, part_events)
            if parts is not None:
                steps_from, dev, tables = parts
                for events, bounds in tables:
                    yield _trace_events(head, who, events, bounds, steps_from, dev)
                return
        whole = _concat(cols, [cols.load(i) for i in range(cols.chunks)]) if isinstance(cols, Spilled) else cols
        del cols
        events, bounds, steps_from, dev = _read_events(whole, whose, who.host, who.pg_suffix)
        del whole
        release_memory()
        yield _trace_events(head, who, events, bounds, steps_from, dev)


@dataclass
class _Who:
    """Whose trace it is, from its head, the caller and the file name."""

    worker: int | None
    rank_from: str
    host: str
    groups: tuple[ProcessGroup, ...]
    pg_suffix: str  # the job's one process group, named on its collectives


def _who(head: Head, worker: int | None, path: Path | None) -> _Who:
    dist = head.distributedInfo
    rank_from = "given"
    if worker is None:
        worker, rank_from = _rank(dist.get("rank"), path)
    elif not 0 <= worker <= MAX_WORKER:
        raise TraceError(f"rank {worker} is out of range (0..{MAX_WORKER})")
    host = head.hostName or head.host_name or (_file_host(path) if path else "")
    groups = tuple(
        ProcessGroup(
            str(pg.get("pg_name", "")),
            str(pg.get("pg_desc", "")),
            tuple(int(r) for r in pg.get("ranks", []) or [] if isinstance(r, int)),
        )
        for pg in dist.get("pg_config", []) or []
        if isinstance(pg, dict)
    )
    suffix = f"[{groups[0].desc or groups[0].name}]" if len(groups) == 1 else ""
    return _Who(worker, rank_from, host, groups, suffix)


def _trace_events(
    head: Head,
    who: _Who,
    events: pa.Table,
    bounds: dict[int, tuple[float, float]],
    steps_from: str,
    dev: tuple[str, int] | None,
) -> TraceEvents:
    dist = head.distributedInfo
    if "process_group" in events.column_names and who.groups:
        events = _group_names(events, who.groups)
    props = {p.get("id"): str(p.get("name", "")) for p in head.deviceProperties or [] if isinstance(p, dict)}
    world = dist.get("world_size")
    host = who.host
    meta = TraceMeta(
        host=host,
        device=f"{host}/{dev[0]}{dev[1]}" if dev else "",
        backend=str(dist.get("backend", "")),
        world_size=world
        if isinstance(world, int) and not isinstance(world, bool) and 0 < world <= MAX_WORKER
        else None,
        process_groups=who.groups,
        gpu=props.get(dev[1], "") if dev else next(iter(props.values()), ""),
        trace_id=head.trace_id,
        rank_from=who.rank_from if who.worker is not None else "",
        steps_from=steps_from,
    )
    return TraceEvents(worker=who.worker, events=events, step_bounds=bounds, meta=meta)


def file_rank(path: Path) -> int | None:
    """The rank a file name carries (``rank-3``, ``rank3``, ``rank_3``, ``worker3``), or None."""
    m = _FILE_RANK.search(path.name)
    return int(m.group(1)) if m else None


def _rank(rank: object, path: Path | None) -> tuple[int | None, str]:
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= MAX_WORKER:
            raise TraceError(f"distributedInfo.rank {rank!r} is not a rank (an integer 0..{MAX_WORKER})")
        return rank, "trace"
    r = file_rank(path) if path else None
    return (r, "file name") if r is not None else (None, "")


def _file_host(path: Path) -> str:
    return re.sub(r"_\d+$", "", path.name.split(".", 1)[0])


# --------------------------------------------------------------------------- bounded reading


def open_regular(source: str | Path, max_bytes: int, what: str = "file") -> BinaryIO:
    """A regular file opened for reading, refused when it is larger than ``max_bytes``.

    Opened without blocking (a FIFO never hangs the reader) and checked to be a
    regular file, not a device such as ``/dev/zero`` (through a symlink or not),
    a FIFO or a directory, before anything is read.
    """
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TraceError(f"cannot read it: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        os.close(fd)
        mode = st.st_mode
        if stat.S_ISREG(mode):
            raise TraceError(
                f"{what} of {st.st_size:,} bytes is larger than the limit of {max_bytes:,} (--max-input-mb)"
            )
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
        )
        raise TraceError(f"not a regular file ({kind})")
    return os.fdopen(fd, "rb")


def read_bounded(source: str | Path, max_bytes: int, what: str = "trace") -> bytes | bytearray:
    """A regular file's bytes (:func:`open_regular`), gunzipped when it is gzip, in chunks, never more than ``max_bytes``."""
    with open_regular(source, max_bytes, what) as fh:
        head = fh.read(2)
        if head != b"\x1f\x8b":
            raw = head + fh.read(max_bytes + 1 - len(head))
            if len(raw) > max_bytes:  # it grew since it was opened
                raise TraceError(f"{what} is larger than the limit of {max_bytes:,} bytes (--max-input-mb)")
            return raw
        size = os.fstat(fh.fileno()).st_size
        if size >= 4:  # gzip's trailer holds the size modulo 2^32: refuse an announced bomb before inflating it
            fh.seek(size - 4)
            announced = int.from_bytes(fh.read(4), "little")
            if announced > max_bytes:
                raise TraceError(
                    f"gzip {what} unpacks to {announced:,} bytes, more than the limit of {max_bytes:,} (--max-input-mb)"
                )
        fh.seek(0)
        out = bytearray()
        try:
            with gzip.GzipFile(fileobj=fh) as gz:
                while chunk := gz.read(min(_CHUNK, max_bytes + 1 - len(out))):
                    out += chunk
                    if len(out) > max_bytes:
                        raise TraceError(
                            f"gzip {what} unpacks to more than the limit of {max_bytes:,} bytes (--max-input-mb)"
                        )
        except (OSError, EOFError) as exc:
            raise TraceError(f"not a readable gzip file ({exc})") from None
        return out


def _wrap(read: Callable[..., tuple[Head, Any]], *args: Any, **kwargs: Any) -> tuple[Head, Any]:
    """The streaming reader's result, its errors as :class:`TraceError`."""
    try:
        return read(*args, **kwargs)
    except TraceReadError as exc:
        raise TraceError(str(exc)) from None
    except RecursionError:
        raise TraceError("not a Chrome-trace JSON object with traceEvents (nested too deeply)") from None


# --------------------------------------------------------------------------- events
#
# The stages of reading the events, in order (each a function below): the events' categories and names as
# codes (:func:`_vocabulary`), what kind of work each event is (:class:`_Kinds`), the steps
# (:func:`_steps`), each device event's device and launch (:func:`_device_codes`, :func:`_launches`), the
# sync waits (:func:`_sync_waits`), the step of each event (:func:`_step_index`), the events kept as
# functions (:func:`_kept`), their devices (:func:`_devices`) and their names (:func:`_named`).  Each stage
# frees what it no longer needs (the columns are :func:`_read_events`'s to consume): the peak memory is the
# working arrays of one stage.


@dataclass
class _Vocab:
    """Each event's category and name as codes, and per-event tests made once per distinct category or name."""

    cat: np.ndarray  # each event's category: a code into ``cats`` (the old format's names as today's)
    cats: list[str]
    code: dict[str, int]  # category -> its code
    name: np.ndarray  # each event's name: a code into ``name_dict``
    name_dict: list[str]
    names: pa.Array  # ``name_dict`` as Arrow strings: string predicates on each distinct name once

    def is_cat(self, *which: str) -> np.ndarray:
        """Is each event of one of these categories (one lookup per event: ``np.isin`` compares each event
        once per category)."""
        table = np.zeros(len(self.cats), dtype=bool)
        table[[self.code[w] for w in which if w in self.code]] = True
        out: np.ndarray = table[self.cat]
        return out

    def starts(self, prefix: str) -> np.ndarray:
        return _starts(self.names, prefix)[self.name] if len(self.names) else np.zeros(self.name.size, dtype=bool)

    def has(self, sub: str, ignore_case: bool = False) -> np.ndarray:
        if not len(self.names):
            return np.zeros(self.name.size, dtype=bool)
        out: np.ndarray = _has(self.names, sub, ignore_case)[self.name]
        return out


@dataclass
class _Kinds:
    """What kind of work each event is (masks over all events)."""

    cpu: np.ndarray  # CPU operators, annotations, Python frames
    runtime: np.ndarray  # runtime and driver calls
    sync_rec: np.ndarray  # sync records (``cuda_sync``)
    copy: np.ndarray  # device copies and memsets
    dev: np.ndarray  # device work: kernels, copies, other accelerators' device events


def _read_events(
    c: Columns, worker: int, host: str, pg_suffix: str, part: _Part | None = None
) -> tuple[pa.Table, dict[int, tuple[float, float]], str, tuple[str, int] | None]:
    """The kept events as an op-event table, the step bounds, what the steps came from and the main device.  With
    ``part``: the events are a part's (:func:`_read_parts`), the steps, main device and numbering the whole
    trace's, and only the part's own steps' events are kept (the bounds are all steps'; the caller takes its own)."""
    v = _vocabulary(c)
    kinds = _kinds(v)
    _check_times(c, v, kinds)
    ts, dur, stream = c.ts, np.maximum(c.dur, 0.0, out=c.dur), c.stream  # clamped in place: ours to consume
    # byte counts of the copies only (the column itself is dropped: fewer full-length arrays at the peak)
    copy_idx = np.flatnonzero(kinds.copy)
    copy_bytes = c.nbytes[copy_idx]
    _drop(c, "nbytes")
    is_ann = v.cat == v.code["user_annotation"]
    bounds, steps_from = (part.bounds, part.steps_from) if part else _steps(v, is_ann, ts, dur, stream, kinds)
    if not bounds:
        return OP_EVENT_SCHEMA.empty_table(), {}, steps_from, None
    steps = np.array(sorted(bounds), dtype=np.int64)
    step_start = np.array([bounds[s][0] for s in steps], dtype=np.float64)
    ends = np.array([bounds[s][1] for s in steps], dtype=np.float64)

    # arrays over the device events only: the working memory is what the trace's device work needs
    dev_idx = np.flatnonzero(kinds.dev)
    dcode = _device_codes(c, v, dev_idx)
    rt_idx = np.flatnonzero(kinds.runtime & (c.corr >= 0))
    launch, runtime_of = _launches(c, ts, rt_idx, dev_idx)
    sync = _sync_waits(c, v, kinds, ts, dur, rt_idx, dev_idx, runtime_of)
    del rt_idx
    _drop(c, "corr")
    dev_wait = v.is_cat(*MTIA_CATS) & v.has("wait", ignore_case=True)  # a device's own event waits
    is_dev = kinds.dev
    is_dev &= ~dev_wait
    sync |= dev_wait
    is_cpu = kinds.cpu
    del dev_wait, kinds  # the runtime, sync record and copy masks

    # the step of each event: CPU work by its start, device work by its launch (device waits by their own start)
    when = ts.copy()
    still = is_dev[dev_idx]
    when[dev_idx[still]] = launch[still]
    del launch, still
    k, in_step = _step_index(when, step_start, ends)
    del when
    if part is not None:  # a part keeps its own steps' events only (the others are there as context)
        in_step &= np.isin(steps, part.own)[np.clip(k, 0, None)]

    idx, comm = _kept(v, is_ann, is_cpu, is_dev, sync, in_step, ts, dur, stream)
    seq = _sequence(c, is_cpu, ts, dur, stream, idx, dev_idx, runtime_of, part.numbered if part else None)
    del runtime_of
    _drop(c, "seq")
    # a step lasts until the last device work it launched ended
    d = idx[is_dev[idx]]
    np.maximum.at(ends, k[d], ts[d] + dur[d])
    out_bounds = {int(s): (float(a), float(b)) for s, a, b in zip(steps, step_start, ends)}
    labels, device, dev_main = _devices(host, dcode, dev_idx, idx, is_dev[idx], sync[idx], part.main if part else None)

    fn, kind, res = _named(c, v, idx, comm, sync[idx], pg_suffix)
    htod = (v.cat[idx] == v.code["gpu_memcpy"]) & v.has("HtoD")[idx]
    nbytes = np.full(idx.size, np.nan)
    nbytes[htod] = copy_bytes[np.searchsorted(copy_idx, idx[htod])]  # host-to-device copies are copies
    stream_names = np.array(c.stream_dict or [""], dtype=object)
    table = pa.Table.from_pydict(
        {
            "worker": np.full(idx.size, worker, dtype=np.int64),
            "step": steps[k[idx]],
            "function": fn,
            "kind": kind,
            "start_us": ts[idx],
            "duration_us": dur[idx],
            "host": _take([host or None], np.zeros(idx.size, dtype=np.int64)),
            "device": _take(labels, device),
            "resource": res,
            "bytes": nbytes,
            "stream": _take(stream_names.tolist(), stream[idx]),
        },
        schema=OP_EVENT_SCHEMA,
    )
    if seq is not None:  # the trace numbers its collectives: their instances, on the collectives only
        number, group = seq
        coll = np.isin(np.asarray(kind.to_numpy(zero_copy_only=False), dtype=object), ("collective", "p2p"))
        number[~coll] = -1
        has = number >= 0
        table = table.append_column(COLLECTIVE_FIELDS[0], pa.array(number, pa.int64(), mask=~has))
        table = table.append_column(
            COLLECTIVE_FIELDS[1], pc.if_else(pa.array(has), group, pa.nulls(idx.size, pa.string()))
        )
    return table, out_bounds, steps_from, dev_main


# --------------------------------------------------------------------------- a large trace in parts


@dataclass
class _Part:
    """What a part of a trace is read with (:func:`_read_parts`): the whole trace's steps, main device and numbering,
    and the part's own steps."""

    bounds: dict[int, tuple[float, float]]
    steps_from: str
    own: np.ndarray  # int64 step numbers
    main: int | None
    numbered: bool


#: the columns that tell what an event is (:func:`_vocabulary`, :func:`_kinds`) and when
_WHAT = ("cat", "name", "ts", "dur")
#: an event's kind as the parts are chosen by (a chunk's ``kind`` file): a runtime call with a correlation id, device work
_RUNTIME, _DEVICE = 1, 2


@dataclass
class _Chunk:
    """Where a spilled chunk's events lie (µs, correlation ids): a part skips the chunks it needs nothing of."""

    calls: tuple[float, float]  # runtime calls with a correlation id: first and last start
    context: tuple[float, float]  # other events than device work: first start, last end
    device: tuple[float, float]  # device work: first and last start
    ids: tuple[float, float]  # device work's correlation ids: lowest and highest
    flows: tuple[float, float]  # flow events: first and last


def _span(x: np.ndarray, end: np.ndarray | None = None) -> tuple[float, float]:
    """The lowest of ``x`` and the highest of ``end`` (else of ``x``): Python numbers, ids exact; empty: none met."""
    return (x.min().item(), (x if end is None else end).max().item()) if x.size else (np.inf, -np.inf)


def _read_parts(
    sp: Spilled, worker: int, host: str, pg_suffix: str, part_events: int
) -> tuple[str, tuple[str, int] | None, Iterator[tuple[pa.Table, dict[int, tuple[float, float]]]]] | None:
    """A spilled trace's steps (``ProfilerStep#N``, else each ending with an ``Optimizer.step``) read a run of them
    at a time: what they came from, the main device, and each part's op events and own step bounds (lazily: one part
    in memory at a time).  None where the trace has neither (its steps are inferred from its top-level regions, or
    it is one step: the caller reads it whole)."""
    # pass 1: the times checked, the steps, the device that ran most device work, whether collectives are numbered,
    # and each chunk's kinds (a file beside its columns) and where its events lie
    marks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    opts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # Optimizer.step: the steps without ProfilerStep#N
    anns: list[tuple[np.ndarray, ...]] = []  # CPU annotations: without either, the steps may be a repeating region
    t_first, t_last, offset = np.inf, -np.inf, 0
    dev_counts: dict[int, int] = {}
    numbered = False
    index: list[_Chunk] = []
    for i in range(sp.chunks):
        c = sp.load(i, *_WHAT, "stream", "device", "seq", "corr", "flow_ts")
        v = _vocabulary(c)
        kinds = _kinds(v)
        _check_times(c, v, kinds)
        step = np.flatnonzero((v.cat == v.code["user_annotation"]) & v.starts("ProfilerStep#"))
        marks.append((v.name[step], c.ts[step], c.dur[step]))
        opt = np.flatnonzero(kinds.cpu & v.starts("Optimizer.step"))
        opts.append((c.ts[opt], c.dur[opt], c.stream[opt]))
        ann = np.flatnonzero(kinds.cpu & (v.cat == v.code["user_annotation"]))
        anns.append((v.name[ann], c.ts[ann], c.dur[ann], c.stream[ann], offset + ann))
        offset += c.size
        work = kinds.cpu | kinds.dev
        if work.any():
            t_first = min(t_first, float(c.ts[work].min()))
            t_last = max(t_last, float((c.ts[work] + c.dur[work]).max()))
        dev_idx = np.flatnonzero(kinds.dev)
        codes, counts = np.unique((d := _device_codes(c, v, dev_idx))[d >= 0], return_counts=True)
        for code, n in zip(codes.tolist(), counts.tolist()):
            dev_counts[code] = dev_counts.get(code, 0) + n
        numbered |= bool((c.seq >= 0).any())
        calls = kinds.runtime & (c.corr >= 0)
        np.save(sp.folder / f"{i}.kind.npy", (calls * _RUNTIME + kinds.dev * _DEVICE).astype(np.uint8))
        ctx = ~kinds.dev
        dev_ids = c.corr[dev_idx]
        index.append(
            _Chunk(
                _span(c.ts[calls]),
                _span(c.ts[ctx], c.ts[ctx] + c.dur[ctx]),
                _span(c.ts[dev_idx]),
                _span(dev_ids[dev_ids >= 0]),
                _span(c.flow_ts),
            )
        )
    names, ts, dur = (np.concatenate(x) for x in zip(*marks))
    bounds, steps_from = _profiler_steps(sp.name_dict, names, np.ones(names.size, dtype=bool), ts, dur)
    if not bounds:
        opt_ts, opt_dur, opt_stream = (np.concatenate(x) for x in zip(*opts))
        by_opt = _optimizer_steps(opt_ts, opt_dur, opt_stream, t_first)
        if by_opt:
            bounds, steps_from = by_opt, "Optimizer.step"
        else:
            a_name, a_ts, a_dur, a_stream, a_at = (np.concatenate(x) for x in zip(*anns))
            by_region = _spilled_region_steps(sp, a_name, a_ts, a_dur, a_stream, a_at, t_first, t_last)
            if not by_region:
                return None  # one step: a part can hold no less
            bounds, steps_from = by_region
    codes = np.array(sorted(dev_counts), dtype=np.int64)
    main = _main_device(codes, np.array([dev_counts[c] for c in codes.tolist()], dtype=np.int64))
    steps = np.array(sorted(bounds), dtype=np.int64)
    starts = np.array([bounds[s][0] for s in steps.tolist()])
    # pass 2: each step's events (by their start; the events before the first step count with it), then the
    # steps grouped into parts of about part_events
    per_step = np.zeros(steps.size, dtype=np.int64)
    for i in range(sp.chunks):
        k = np.searchsorted(starts, sp.load(i, "ts").ts, side="right") - 1
        per_step += np.bincount(np.clip(k, 0, None), minlength=steps.size)
    first = [0]
    held = 0
    for j, n in enumerate(per_step.tolist()):
        if held and held + n > part_events:
            first.append(j)
            held = 0
        held += n
    edges = [-np.inf, *starts[first[1:]].tolist(), np.inf]
    own = np.split(steps, first[1:])

    def tables() -> Iterator[tuple[pa.Table, dict[int, tuple[float, float]]]]:
        claimed = [np.zeros(0, dtype=np.uint8)] * sp.chunks  # per chunk: its device events a part took (bits)
        for g, mine in enumerate(own):
            cols = _part_columns(sp, index, edges[g], edges[g + 1], edges[max(g - 1, 0)], claimed)
            part = _Part(bounds, steps_from, mine, main, numbered)
            events, all_bounds, _, _ = _read_events(cols, worker, host, pg_suffix, part)
            del cols
            yield events, {s: all_bounds[s] for s in mine.tolist()}
            del events
            release_memory()

    return steps_from, (("mtia" if main % 2 else "gpu", main // 2) if main is not None else None), tables()


def _spilled_region_steps(
    sp: Spilled,
    name: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    stream: np.ndarray,
    at: np.ndarray,
    t_first: float,
    t_last: float,
) -> tuple[dict[int, tuple[float, float]], str] | None:
    """:func:`_region_steps` of a spilled trace, from its CPU annotations (``at``: their places in the trace): the
    top-level ones are those that no CPU event of any chunk encloses (:func:`_enclosed`, the rule of :func:`_nested`)."""
    nested = np.zeros(ts.size, dtype=bool)
    offset = 0
    for i in range(sp.chunks):
        c = sp.load(i, *_WHAT, "stream")
        cpu = np.flatnonzero(_kinds(_vocabulary(c)).cpu)
        nested |= _enclosed(stream, ts, dur, at, c.stream[cpu], c.ts[cpu], c.dur[cpu], offset + cpu)
        offset += c.size
    top = ~nested
    return _region_steps(np.array(sp.name_dict, dtype=object)[name[top]], ts[top], dur[top], t_first, t_last)


def _enclosed(
    stream: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    at: np.ndarray,
    e_stream: np.ndarray,
    e_ts: np.ndarray,
    e_dur: np.ndarray,
    e_at: np.ndarray,
) -> np.ndarray:
    """For each event (``stream``, ``ts``, ``dur``, its place ``at``): does one of the ``e_*`` events enclose it as
    :func:`_nested` decides, i.e. does one that comes before it on its thread in (start, longest first, place) order
    end after it starts.  Each event is put just before an identical one (itself, where it is among them)."""
    n = ts.size
    key_stream = np.concatenate([stream, e_stream]).astype(np.int64)
    start = np.concatenate([ts, e_ts])
    order = np.lexsort(
        (
            np.concatenate([np.zeros(n, np.int8), np.ones(e_ts.size, np.int8)]),
            np.concatenate([at, e_at]),
            -np.concatenate([dur, e_dur]),
            start,
            key_stream,
        )
    )
    end = np.concatenate([np.full(n, -np.inf), e_ts + e_dur])[order]
    thread = key_stream[order]
    cuts = np.flatnonzero(np.diff(thread)) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [order.size]]), strict=True):
        end[lo:hi] = np.maximum.accumulate(end[lo:hi])
    mine = np.flatnonzero(order < n)
    out = np.zeros(n, dtype=bool)
    out[order[mine]] = start[order[mine]] < end[mine]
    return out


def _part_columns(
    sp: Spilled, index: list[_Chunk], lo: float, hi: float, flows_from: float, claimed: list[np.ndarray]
) -> Columns:
    """The events a part from ``lo`` to ``hi`` (µs) is read from: every event other than device work that overlaps
    it (the regions and calls around its own events), the device work that the runtime calls begun in it launched
    (the same correlation id), device work begun in it that no earlier part took (launched by no call in the
    trace), and the flow events from ``flows_from`` on.  ``claimed``: each chunk's device events taken by the
    parts so far (packed bits, updated).  Chunks that hold none of these (``index``) are not read."""

    def meets(span: tuple[float, float], a: float, b: float) -> bool:
        return span[0] < b and span[1] >= a

    launched = []
    for i, ix in enumerate(index):  # the correlation ids of the runtime calls begun in the part
        if meets(ix.calls, lo, hi):
            c = sp.load(i, "ts", "corr")
            rt = ((np.load(sp.folder / f"{i}.kind.npy") & _RUNTIME) > 0) & (c.ts >= lo) & (c.ts < hi)
            launched.append(c.corr[rt])
    ids = np.sort(np.concatenate(launched)) if launched else np.zeros(0, np.int64)  # (repeats do no harm)
    del launched
    picked: list[Columns] = []
    for i, ix in enumerate(index):
        by_id = ids.size > 0 and meets(ix.ids, ids[0].item(), ids[-1].item() + 1)
        if not (meets(ix.context, lo, hi) or meets(ix.device, lo, hi) or by_id or meets(ix.flows, flows_from, hi)):
            continue
        c = sp.load(i)
        dev = (np.load(sp.folder / f"{i}.kind.npy") & _DEVICE) > 0
        taken = np.unpackbits(claimed[i], count=c.size).astype(bool) if claimed[i].size else np.zeros(c.size, bool)
        began = (c.ts >= lo) & (c.ts < hi)
        mine = dev & ~taken & (_among(c.corr, ids, dev) | began)
        claimed[i] = np.packbits(taken | mine)
        rows = np.flatnonzero(mine | (~dev & (c.ts < hi) & (c.ts + c.dur >= lo)))
        flows = np.flatnonzero((c.flow_ts >= flows_from) & (c.flow_ts < hi))
        if rows.size or flows.size:
            taken_cols = {k: getattr(c, k)[rows] for k in EVENT_COLUMNS} | {
                k: getattr(c, k)[flows] for k in FLOW_COLUMNS
            }
            picked.append(replace(c, **taken_cols))
        del c, dev, taken, began, mine
    return _concat(sp, picked)


def _among(values: np.ndarray, ids: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Is each of ``values`` (only ``where``, else False) one of the sorted ``ids``: a binary search each
    (``np.isin`` hashes all of both, several times slower)."""
    out = np.zeros(values.size, dtype=bool)
    if ids.size:
        at = np.flatnonzero(where)
        v = values[at]
        out[at] = ids[np.minimum(np.searchsorted(ids, v), ids.size - 1)] == v
    return out


def _concat(sp: Spilled, parts: list[Columns]) -> Columns:
    """Pieces of a spilled trace's chunks (in the trace's order) as one :class:`Columns`."""
    cols = {
        k: np.concatenate([getattr(p, k) for p in parts]) if parts else np.empty(0, dtype)
        for k, dtype in (*EVENT_COLUMNS.items(), *FLOW_COLUMNS.items())
    }
    return Columns(**cols, cat_dict=sp.cat_dict, name_dict=sp.name_dict, stream_dict=sp.stream_dict, pg_dict=sp.pg_dict)


def _vocabulary(c: Columns) -> _Vocab:
    """The events' categories (the old format's names as today's; its record_function regions, written as
    operators, as annotations) and names as codes; frees the category column."""
    cats = list(c.cat_dict)
    for new in (*_LEGACY_CATS.values(), "user_annotation", "cpu_op"):  # codes for the categories compared below
        if new not in cats:
            cats.append(new)
    code = {s: i for i, s in enumerate(cats)}
    remap = np.array([code[_LEGACY_CATS.get(s, s)] for s in c.cat_dict] or [0], dtype=np.int32)
    v = _Vocab(remap[c.cat], cats, code, c.name, c.name_dict, pa.array(c.name_dict, pa.string()))
    _drop(c, "cat")
    ops = np.flatnonzero(v.cat == code["cpu_op"])  # old traces wrote record_function regions as operators too
    if ops.size:
        region = v.starts("ProfilerStep#") | v.starts("Optimizer.") | v.has("DataLoader")
        v.cat[ops[region[ops]]] = code["user_annotation"]
    return v


def _kinds(v: _Vocab) -> _Kinds:
    is_copy = v.is_cat(*COPY_CATS)
    gpu_cat = np.array([s.startswith("gpu_") and s not in _NOT_DEVICE_WORK for s in v.cats], dtype=bool)
    is_dev = is_copy | v.is_cat("kernel") | v.is_cat(*MTIA_CATS) | gpu_cat[v.cat]
    return _Kinds(v.is_cat(*CPU_CATS), v.is_cat(*RUNTIME_CATS), v.is_cat(*SYNC_CATS), is_copy, is_dev)


def _check_times(c: Columns, v: _Vocab, kinds: _Kinds) -> None:
    """A :class:`TraceError` for the first event read whose start or duration no profiler measures."""
    ts, dur = c.ts, c.dur
    used = kinds.cpu | kinds.runtime | kinds.sync_rec | kinds.dev
    broken = used & (~np.isfinite(ts) | ~np.isfinite(dur) | (np.abs(ts) > MAX_TIME_US) | (dur > MAX_DURATION_US))
    if broken.any():
        i = int(np.flatnonzero(broken)[0])
        raise TraceError(
            f"event {_cap(v.name_dict[v.name[i]])!r} at ts {ts[i]:g} lasts {dur[i]:g} µs: not a time a profiler measures (at most {MAX_DURATION_US:g} µs)"
        )


def _steps(
    v: _Vocab, is_ann: np.ndarray, ts: np.ndarray, dur: np.ndarray, stream: np.ndarray, kinds: _Kinds
) -> tuple[dict[int, tuple[float, float]], str]:
    """step -> (start_us, end_us) from ``ProfilerStep#N``, else inferred; and what they came from."""
    bounds, steps_from = _profiler_steps(v.name_dict, v.name, is_ann & v.starts("ProfilerStep#"), ts, dur)
    if bounds:
        return bounds, steps_from
    return _inferred_steps(
        v.name_dict, v.name, is_ann, v.starts("Optimizer.step"), ts, dur, stream, kinds.cpu, kinds.dev
    )


def _device_codes(c: Columns, v: _Vocab, dev_idx: np.ndarray) -> np.ndarray:
    """The device of each device event, one code per (kind of accelerator, number), -1 where unknown: its args'
    device, else its pid (Kineto's device timelines); frees the device column."""
    dev_no = c.device[dev_idx]
    _drop(c, "device")
    out: np.ndarray = np.where(dev_no >= 0, 2 * dev_no + v.is_cat(*MTIA_CATS)[dev_idx], -1)
    return out


def _launches(c: Columns, ts: np.ndarray, rt_idx: np.ndarray, dev_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each device event's launch time and the runtime call that launched it (-1: none in the trace): the call
    with the same correlation id, else the flow that ends on the device event, else its own start."""
    corr, stream = c.corr, c.stream
    launch = ts[dev_idx]
    runtime_of = np.full(dev_idx.size, -1, dtype=np.int64)
    if dev_idx.size and rt_idx.size:
        runtime_of = _lookup(corr[rt_idx], rt_idx, corr[dev_idx])
    found = runtime_of >= 0
    launch[found] = ts[runtime_of[found]]
    missing = np.flatnonzero(~found)
    if missing.size:
        via_flow = _flow_launch(c, stream[dev_idx[missing]], ts[dev_idx[missing]])
        ok = np.isfinite(via_flow)
        launch[missing[ok]] = via_flow[ok]
    return launch, runtime_of


def _sync_waits(
    c: Columns,
    v: _Vocab,
    kinds: _Kinds,
    ts: np.ndarray,
    dur: np.ndarray,
    rt_idx: np.ndarray,
    dev_idx: np.ndarray,
    runtime_of: np.ndarray,
) -> np.ndarray:
    """Which events are host waits on the device: blocking runtime calls, asynchronous copy calls that waited for
    their copy, and sync records of calls the trace lacks (a device's own waits are the caller's)."""
    corr, name = c.corr, v.name
    blocking = np.zeros(name.size, dtype=bool)
    if rt_idx.size:  # a few distinct calls, thousands of times each: each name judged once
        blocks = np.array([bool(_BLOCKING_CALL.search(s)) for s in v.name_dict], dtype=bool)
        blocking[rt_idx] = blocks[name[rt_idx]]
    waited_of = (runtime_of >= 0) & kinds.copy[dev_idx]  # an async copy call still running when its copy began
    waited = dev_idx[waited_of]
    if waited.size:
        r = runtime_of[waited_of]
        copy_call = _has(v.names, "memcpy", ignore_case=True)[name[r]]
        hit = copy_call & (ts[r] + dur[r] > ts[waited])
        blocking[r[hit]] = True
    sync_rec = np.flatnonzero(kinds.sync_rec & (name != _code_of(v.name_dict, "Stream Wait Event")))
    if sync_rec.size:  # the call itself is not in the trace
        blocking[sync_rec[_lookup(corr[rt_idx], rt_idx, corr[sync_rec]) < 0]] = True
    return blocking


def _step_index(when: np.ndarray, step_start: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each event's step (an index into the steps; int32: steps are fewer than 2**31) by the time that places it,
    and whether that time is inside the step's span."""
    k = (np.searchsorted(step_start, when, side="right") - 1).astype(np.int32)
    in_step = (k >= 0) & (when < ends[np.clip(k, 0, None)])
    return k, in_step


def _kept(
    v: _Vocab,
    is_ann: np.ndarray,
    is_cpu: np.ndarray,
    is_dev: np.ndarray,
    sync: np.ndarray,
    in_step: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    stream: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The events that become functions (their indices) and which of them are communication: device work, sync
    waits, communication and regions on CPU threads, and operators outside every region, inside a step."""
    is_step = is_cpu & is_ann & v.starts("ProfilerStep#")
    cpu = is_cpu & ~is_step
    comm = cpu & np.logical_or.reduce([v.starts(p) for p in _COMM_PREFIXES])
    is_op = v.cat == v.code["cpu_op"]
    region = cpu & ~comm & ~is_op
    keep = in_step & (is_dev | sync | comm | region | (cpu & is_op & ~_nested(stream, ts, dur, cpu)))
    idx = np.flatnonzero(keep)
    return idx, comm[idx]


def _sequence(
    c: Columns,
    is_cpu: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    stream: np.ndarray,
    idx: np.ndarray,
    dev_idx: np.ndarray,
    runtime_of: np.ndarray,
    numbered: bool | None = None,
) -> tuple[np.ndarray, pa.Array] | None:
    """The kept events' collective sequence numbers (-1: none) and process groups, None when the trace records
    none.  ``torch.profiler`` writes a collective's number (``args.Seq``, with its ``Process Group Name`` and
    ``Description``) on the ``record_param_comms`` operator that its ``c10d::`` operator encloses and that encloses
    its ``nccl:`` region and the launch of its kernel: a CPU event takes the number of the numbered CPU event on its
    thread that it overlaps (the last to start before it ends), a device event the one of the call that launched
    it; an event that carries a number itself keeps its own.  ``numbered``: whether the trace does (None: whether
    these events do)."""
    has = c.seq >= 0
    if not (has.any() if numbered is None else numbered):
        return None
    own = c.seq[idx]
    number = own.copy()
    pg = c.pg[idx].astype(np.int64)
    rec = np.flatnonzero(has & is_cpu)
    if rec.size:
        # the span a kept event is looked up by: its own, or for device work the launching call's
        q_ev = idx.copy()
        if dev_idx.size:
            at = np.minimum(np.searchsorted(dev_idx, idx), dev_idx.size - 1)
            launched = (dev_idx[at] == idx) & (runtime_of[at] >= 0)
            q_ev[launched] = runtime_of[at][launched]
        t0 = float(min(ts[rec].min(), ts[q_ev].min(initial=np.inf)))
        span = float(max((ts[rec] + dur[rec]).max(), (ts[q_ev] + dur[q_ev]).max(initial=-np.inf)) - t0) + 1.0
        # (thread, start) as one sortable number: the numbered events in order on each thread
        r_key = stream[rec].astype(np.float64) * span + (ts[rec] - t0)
        order = np.argsort(r_key, kind="stable")
        rec, r_key = rec[order], r_key[order]
        q_end = stream[q_ev].astype(np.float64) * span + (ts[q_ev] + dur[q_ev] - t0)
        pos = np.searchsorted(r_key, q_end, side="right") - 1
        ok = pos >= 0
        r = rec[np.clip(pos, 0, None)]
        ok &= (stream[r] == stream[q_ev]) & (ts[r] + dur[r] >= ts[q_ev]) & (own < 0)
        number[ok] = c.seq[r[ok]]
        pg[ok] = c.pg[r[ok]]
    groups: list[str | None] = list(c.pg_dict)
    return number, _take(groups, pg)


def _group_names(events: pa.Table, groups: tuple[ProcessGroup, ...]) -> pa.Table:
    """The collectives' process groups by name where ``distributedInfo.pg_config`` gives the name of the
    description the events carry (and no other group of the rank has that description): names are the same on
    every rank and unique, descriptions need not be (``mesh_tp`` for every tensor-parallel group)."""
    descs = [g.desc for g in groups]
    named = {g.desc: g.name for g in groups if g.desc and g.name and descs.count(g.desc) == 1}
    if not named:
        return events
    i = events.schema.get_field_index("process_group")
    col = events.column(i).combine_chunks().dictionary_encode()
    labels = [named.get(d, d) for d in col.dictionary.to_pylist()]
    renamed = pc.take(pa.array(labels, pa.string()), col.indices)
    return events.set_column(i, events.schema.field(i), renamed)


def _devices(
    host: str,
    dcode: np.ndarray,
    dev_idx: np.ndarray,
    idx: np.ndarray,
    on_dev: np.ndarray,
    sync: np.ndarray,
    main: int | None = None,
) -> tuple[list[str | None], np.ndarray, tuple[str, int] | None]:
    """The kept events' devices: the labels (``<host>/gpu<N>``, each device named once, None last), each kept
    event's as an index into them (device work its own, sync waits the main device's, the rest None), and the
    main device (the accelerator that ran most device events; ``main``: the whole trace's, for a part of it)."""
    codes, counts = np.unique(dcode[dcode >= 0], return_counts=True)
    if main is None:
        main = _main_device(codes, counts)
    elif main not in codes:
        codes = np.sort(np.append(codes, main))
    labels = [f"{host}/{'mtia' if c % 2 else 'gpu'}{c // 2}" for c in codes.tolist()]
    device = np.full(idx.size, codes.size, dtype=np.int64)
    dcode_idx = np.full(idx.size, -1, dtype=np.int64)  # each kept event's, found among the device events
    if dev_idx.size:
        at = np.minimum(np.searchsorted(dev_idx, idx), dev_idx.size - 1)
        dcode_idx = np.where(dev_idx[at] == idx, dcode[at], -1)
    on_dev = on_dev & (dcode_idx >= 0)
    device[on_dev] = np.searchsorted(codes, dcode_idx[on_dev])
    device[sync] = np.searchsorted(codes, main) if main is not None else codes.size
    dev_main = ("mtia" if main % 2 else "gpu", main // 2) if main is not None else None
    return [*labels, None], device, dev_main


def _main_device(codes: np.ndarray, counts: np.ndarray) -> int | None:
    """The device code that ran most device events (the lowest of a tie), None where there are none."""
    return int(codes[np.argmax(counts)]) if codes.size else None


def _named(
    c: Columns, v: _Vocab, idx: np.ndarray, comm: np.ndarray, sync: np.ndarray, pg_suffix: str
) -> tuple[pa.Array, pa.Array, pa.Array]:
    """(function, kind, resource) of the kept events: each distinct (category, name, process group, sync) named
    once (traces repeat the same kernels thousands of times), the strings built in C from each distinct one."""
    pg_names = [*c.pg_dict, pg_suffix]
    pg = np.full(idx.size, len(c.pg_dict), dtype=np.int64)  # the job's one process group, when there is one
    if c.pg_dict:
        own = np.array([bool(s) for s in c.pg_dict], dtype=bool)[c.pg[idx]] & comm
        pg[own] = c.pg[idx][own]
    sync_i = sync.astype(np.int64)
    cat, name = v.cat[idx], v.name[idx]
    key = ((cat.astype(np.int64) * max(len(v.name_dict), 1) + name) * len(pg_names) + pg) * 2 + sync_i
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    named = [_classify(v.cats[cat[j]], v.name_dict[name[j]], pg_names[pg[j]], bool(sync_i[j])) for j in first.tolist()]
    which = which.reshape(-1)
    fn, kind, res = (_take([t[i] for t in named], which) for i in range(3))
    return fn, kind, res


def _drop(c: Columns, column: str) -> None:
    """Free a column :func:`_read_events` has taken what it needs from (an empty one in its place)."""
    setattr(c, column, np.empty(0, dtype=getattr(c, column).dtype))


def _take(strings: list[str | None], which: np.ndarray) -> pa.Array:
    """``strings[which]`` as an Arrow string array (None: null)."""
    return pc.take(pa.array(strings, pa.string()), pa.array(which, pa.int64()))


def _code_of(strings: list[str], s: str) -> int:
    try:
        return strings.index(s)
    except ValueError:
        return -1


def _lookup(keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``values`` at the first position of each query in ``keys``; -1 where absent (or the query is -1)."""
    out = np.full(queries.size, -1, dtype=np.int64)
    if keys.size == 0:
        return out
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    pos = np.minimum(np.searchsorted(sk, queries), sk.size - 1)
    hit = (queries >= 0) & (sk[pos] == queries)
    out[hit] = values[order][pos[hit]]
    return out


def _flow_launch(c: Columns, dev_stream: np.ndarray, dev_ts: np.ndarray) -> np.ndarray:
    """Launch time of device events from flow events: a flow starts (``s``) at the launch and ends (``f``) where
    the device event starts, on its timeline; NaN where no flow ends on the event."""
    out = np.full(dev_ts.size, np.nan)
    is_f = c.flow_is_end
    n_f = int(is_f.sum())
    if n_f == 0:
        return out
    fid, fts, fstream = c.flow_id, c.flow_ts, c.flow_stream.astype(np.int64)
    # (timeline, start) of each flow end and each device event, as one comparable number
    t0 = float(min(fts.min(), dev_ts.min()))
    span = float(max(fts.max(), dev_ts.max()) - t0) + 1.0
    f_key = fstream[is_f] * span + (fts[is_f] - t0)
    d_key = dev_stream.astype(np.int64) * span + (dev_ts - t0)
    order = np.argsort(f_key, kind="stable")
    pos = np.minimum(np.searchsorted(f_key[order], d_key), n_f - 1)
    hit = np.flatnonzero(f_key[order][pos] == d_key)
    if hit.size == 0:
        return out
    starts_id, first = np.unique(fid[~is_f], return_index=True)
    if starts_id.size == 0:
        return out
    want = fid[is_f][order][pos[hit]]
    p = np.minimum(np.searchsorted(starts_id, want), starts_id.size - 1)
    ok = starts_id[p] == want
    out[hit[ok]] = fts[~is_f][first][p[ok]]
    return out


def _profiler_steps(
    name_dict: list[str], name: np.ndarray, is_step: np.ndarray, ts: np.ndarray, dur: np.ndarray
) -> tuple[dict[int, tuple[float, float]], str]:
    bounds: dict[int, tuple[float, float]] = {}
    for i in np.flatnonzero(is_step):
        text = name_dict[name[i]]
        m = _STEP.match(text)
        if not m:
            continue
        digits = m.group(1)
        if len(digits) > 10 or int(digits) > MAX_STEP:
            raise TraceError(f"{_cap(text)}: a step number beyond {MAX_STEP}")
        bounds.setdefault(int(digits), (float(ts[i]), float(ts[i] + dur[i])))
    return bounds, "ProfilerStep"


def _inferred_steps(
    name_dict: list[str],
    name: np.ndarray,
    is_ann: np.ndarray,
    is_opt_step: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    stream: np.ndarray,
    is_cpu: np.ndarray,
    is_dev: np.ndarray,
) -> tuple[dict[int, tuple[float, float]], str]:
    """Iterations of a trace without ``ProfilerStep#N``: optimizer steps, else a repeating top-level region, else one step."""
    work = is_cpu | is_dev
    if not work.any():
        return {}, "whole trace"
    t_first = float(ts[work].min())
    t_last = float((ts + dur)[work].max())
    opt = np.flatnonzero(is_cpu & is_opt_step)
    by_opt = _optimizer_steps(ts[opt], dur[opt], stream[opt], t_first)
    if by_opt:
        return by_opt, "Optimizer.step"
    top = np.flatnonzero(is_cpu & is_ann & ~_nested(stream, ts, dur, is_cpu))
    by_region = _region_steps(np.array(name_dict, dtype=object)[name[top]], ts[top], dur[top], t_first, t_last)
    return by_region or ({0: (t_first, t_last)}, "whole trace")


def _region_steps(
    text: np.ndarray, ts: np.ndarray, dur: np.ndarray, t_first: float, t_last: float
) -> tuple[dict[int, tuple[float, float]], str] | None:
    """Iterations as the occurrences of the top-level annotation (these, in the trace's order: their names' text,
    starts and durations) that repeats and covers most time, if it covers at least half the trace; else None.
    Ties go to the name sorting first."""
    if not text.size:
        return None
    u, inv, counts = np.unique(text, return_inverse=True, return_counts=True)
    total = np.bincount(inv, weights=dur)
    total[counts < 2] = 0.0
    best = int(np.argmax(total))
    if total[best] < 0.5 * (t_last - t_first):
        return None
    occ = np.flatnonzero(inv == best)
    occ = occ[np.argsort(ts[occ], kind="stable")]
    return {i: (float(ts[j]), float(ts[j] + dur[j])) for i, j in enumerate(occ)}, f"region {u[best]}"


def _optimizer_steps(
    ts: np.ndarray, dur: np.ndarray, stream: np.ndarray, t_first: float
) -> dict[int, tuple[float, float]] | None:
    """Iterations that each end with an ``Optimizer.step`` (these events'), the first beginning with the trace's
    work at ``t_first``; None with fewer than two.  A wrapping optimizer's inner step is not another."""
    top = np.flatnonzero(~_nested(stream, ts, dur, np.ones(ts.size, dtype=bool)))
    if top.size < 2:
        return None
    opt_end = np.sort(ts[top] + dur[top])
    begin = np.concatenate([[t_first], opt_end[:-1]])
    return {i: (float(b), float(e)) for i, (b, e) in enumerate(zip(begin, opt_end))}


def _starts(names: pa.Array, prefix: str) -> np.ndarray:
    return np.asarray(pc.starts_with(names, prefix).to_numpy(zero_copy_only=False))


def _has(names: pa.Array, sub: str, ignore_case: bool = False) -> np.ndarray:
    return np.asarray(pc.match_substring(names, sub, ignore_case=ignore_case).to_numpy(zero_copy_only=False))


def _nested(stream: np.ndarray, ts: np.ndarray, dur: np.ndarray, among: np.ndarray) -> np.ndarray:
    """For the ``among`` events: does another of them on the same thread enclose it?

    A running maximum of the end times over each thread's events in start order (threads are few, events many:
    one vectorised pass per thread).  Exact in the trace's own times: the threads are not joined into one
    series by an offset, which loses microseconds once a stray ``ts`` of 0 stretches a thread's span to 1e15."""
    out = np.zeros(ts.size, dtype=bool)
    idx = np.flatnonzero(among)
    if idx.size == 0:
        return out
    thread = stream[idx].astype(np.int64)
    order = np.lexsort((-dur[idx], ts[idx], thread))
    start = ts[idx][order]
    end = start + dur[idx][order]
    inside = np.zeros(order.size, dtype=bool)
    cuts = np.flatnonzero(np.diff(thread[order])) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [order.size]]), strict=True):
        inside[lo + 1 : hi] = start[lo + 1 : hi] < np.maximum.accumulate(end[lo : hi - 1])
    out[idx[order]] = inside
    return out


def _classify(cat: str, name: str, pg: str, sync: bool) -> tuple[str, str, str]:
    """(function, kind, resource) of a kept event; ``pg`` names its process group ("[default_pg]" or "")."""
    if sync:
        return _cap(name), "sync", "none"
    if cat in COPY_CATS:
        resource = "pcie" if ("HtoD" in name or "DtoH" in name) else "nvlink" if "PtoP" in name else "gpu"
        return _cap(name), "memcpy", resource
    if cat in CPU_CATS:
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
    key = kernel_key(name)  # device work: kernels, and other accelerators' device events
    if "nccl" in name.lower():
        return key, "p2p" if _P2P.search(key) else "collective", "nic"
    return key, "compute", "gpu"


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
