"""The function table: one worker's functions x execution characteristics for one step.

This is the columnar heart of a :class:`~lockstep.schemas.records.FeatureBatch`.
One row per function (a normalised kernel name, a collective with its process
group, a Python call site, a data-loader call).  Times are microseconds measured
on the worker's own clock; only the summaries cross hosts, never timestamps.

Hardware columns hold the behaviour of the resource the function depends on
*while it ran*: the mean of the samples that overlap its executions, and since
version 2 their standard deviation (``<metric>_sd``) and 95th percentile
(``<metric>_p95``); NaN where the sampler had nothing (no GPU, no samples,
metric not applicable; the spread also with fewer than two samples).

Schema evolution: version 1 readers require :data:`REQUIRED`; every other
column is optional and filled with its null value when absent; unknown extra
columns are ignored.  New columns are only ever added.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import cramjam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .compression import CompressionError, read_ipc_stream, zstd_decompress
from .records import FUNCTION_KINDS, RecordError

VERSION = 2

RESOURCES = ("gpu", "pcie", "nvlink", "nic", "cpu", "storage", "none")

#: column -> (arrow type, meaning).  Order is the order on the wire.
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "function": (pa.string(), "stable function key, identical across workers"),
    "kind": (
        pa.string(),
        "compute | memcpy | collective | p2p | python | dataloader | optimizer | other | sync "
        "(the host blocked until the device caught up: synchronize, a blocking copy)",
    ),
    "resource": (pa.string(), "hardware the function depends on: gpu | pcie | nvlink | nic | cpu | storage | none"),
    "calls": (pa.int32(), "executions in the step"),
    "total_us": (pa.float32(), "sum of execution durations, waits included"),
    "critical_us": (
        pa.float32(),
        "time on the worker's critical path credited to this function "
        "(GPU kernels > copies > communication > CPU; overlaps counted once)",
    ),
    "wait_us": (
        pa.float32(),
        "part of critical_us spent waiting for peers (collectives, p2p); NaN if not measured locally",
    ),
    "first_start_us": (pa.float32(), "first start relative to the step's start (order within the step)"),
    "mean_us": (pa.float32(), "mean duration per call"),
    "p50_us": (pa.float32(), "median duration per call"),
    "p95_us": (pa.float32(), "95th percentile duration per call"),
    "max_us": (pa.float32(), "longest call"),
    "bytes": (pa.float32(), "bytes moved (collectives, p2p, copies, storage reads); NaN if not applicable"),
    "samples": (pa.int32(), "hardware samples that overlapped the function"),
    "sm_clock_mhz": (pa.float32(), "GPU SM clock"),
    "sm_active": (pa.float32(), "GPU SM activity / utilisation, 0..1"),
    "gpu_power_w": (pa.float32(), "GPU board power"),
    "gpu_temp_c": (pa.float32(), "GPU temperature"),
    "clock_events": (pa.uint64(), "OR of NVML clock-event (throttle) reason bits seen"),
    "pcie_gbps": (pa.float32(), "PCIe throughput of the worker's GPU, GB/s (rx+tx)"),
    "nvlink_gbps": (pa.float32(), "NVLink throughput of the worker's GPU, GB/s"),
    "nic_gbps": (pa.float32(), "throughput of the worker's NIC / bond, GB/s"),
    "cpu_self": (pa.float32(), "CPU used by the worker's process, in cores"),
    "cpu_other": (pa.float32(), "CPU used by other processes on the host, share of all cores 0..1"),
    "mem_used_frac": (pa.float32(), "host memory in use, 0..1"),
    "disk_read_mbps": (pa.float32(), "host disk reads, MB/s"),
}
#: hardware characteristic columns (NaN = not sampled): the mean of a metric's samples while the function
#: ran; its spread is ``<metric>_sd`` and its peak ``<metric>_p95``
HARDWARE = (
    "sm_clock_mhz",
    "sm_active",
    "gpu_power_w",
    "gpu_temp_c",
    "pcie_gbps",
    "nvlink_gbps",
    "nic_gbps",
    "cpu_self",
    "cpu_other",
    "mem_used_frac",
    "disk_read_mbps",
)
# version 2 (additive): the shape of each metric while the function ran, not only its level.  In a ring
# every member's mean throughput is the slowest link's; the slow link is busy all the time (low spread,
# low peak) while its peers burst and idle.
for _m in HARDWARE:
    COLUMNS[f"{_m}_sd"] = (
        pa.float32(),
        f"standard deviation of the {_m} samples that overlapped the function's executions",
    )
for _m in HARDWARE:
    COLUMNS[f"{_m}_p95"] = (
        pa.float32(),
        f"95th percentile of the {_m} samples that overlapped the function's executions",
    )
REQUIRED = ("function", "kind", "calls", "total_us", "critical_us")
SCHEMA = pa.schema(
    [pa.field(name, typ, nullable=name not in REQUIRED) for name, (typ, _doc) in COLUMNS.items()],
    metadata={"lockstep.function_table.version": str(VERSION)},
)
NUMERIC = tuple(n for n, (t, _) in COLUMNS.items() if pa.types.is_integer(t) or pa.types.is_floating(t))
#: spread and peak of each sampled metric (NaN = fewer than two samples, or not sampled)
SPREAD = tuple(f"{m}_sd" for m in HARDWARE)
PEAK = tuple(f"{m}_p95" for m in HARDWARE)

_KIND_SET = frozenset(FUNCTION_KINDS)
_RESOURCE_SET = frozenset(RESOURCES)
_KINDS_ARRAY = pa.array(FUNCTION_KINDS)
_RESOURCES_ARRAY = pa.array(RESOURCES)


def default_resource(kind: str) -> str:
    return {
        "compute": "gpu",
        "memcpy": "pcie",
        "collective": "nic",
        "p2p": "nic",
        "python": "cpu",
        "dataloader": "cpu",
        "optimizer": "gpu",
        "sync": "none",  # a wait, not work: the device work it waits for is credited to that work
    }.get(kind, "none")


def _null_array(typ: pa.DataType, n: int) -> pa.Array:
    if pa.types.is_floating(typ):
        return pa.array(np.full(n, np.nan, dtype=typ.to_pandas_dtype()))
    if pa.types.is_integer(typ):
        return pa.array(np.zeros(n, dtype=typ.to_pandas_dtype()))
    return pa.nulls(n, typ)


def make_table(columns: dict[str, object]) -> pa.Table:
    """Build a function table from column -> sequence; missing optional columns get nulls."""
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise ValueError(f"function table needs columns {missing}")
    n = len(columns["function"])  # type: ignore[arg-type]
    arrays = []
    for name, (typ, _) in COLUMNS.items():
        if name in columns:
            arrays.append(pa.array(columns[name], type=typ))
        elif name == "resource":
            arrays.append(pa.array([default_resource(k) for k in cast("Iterable[str]", columns["kind"])], type=typ))
        else:
            arrays.append(_null_array(typ, n))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def pack(table: pa.Table, codec: str = "zstd") -> bytes:
    """Arrow IPC stream, then compressed as a whole (per-buffer compression does not pay for 20 rows)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    raw: bytes = sink.getvalue().to_pybytes()
    if codec == "zstd":
        return bytes(cramjam.zstd.compress(raw, level=3))
    if codec == "none":
        return raw
    raise ValueError(f"unknown codec {codec!r}")


#: the most an Arrow payload (a function table, a step report's table) may expand to; a function table
#: of this size holds about 100,000 functions, thousands of times what an agent sends
MAX_TABLE_BYTES = 64 << 20


def unpack_ipc(data: bytes, codec: str = "zstd", max_bytes: int = MAX_TABLE_BYTES) -> pa.Table:
    """Decompress (bounded: :func:`~.compression.zstd_decompress`) and read an Arrow IPC stream;
    raises RecordError('bad_function_table')."""
    try:
        if len(data) > max_bytes:
            raise RecordError("bad_function_table", f"payload of {len(data)} bytes, over {max_bytes}")
        raw = zstd_decompress(data, max_bytes) if codec == "zstd" else data
        return read_ipc_stream(raw)
    except RecordError:
        raise
    except CompressionError as exc:
        raise RecordError("bad_function_table", str(exc)) from None
    except Exception as exc:  # cramjam / arrow raise many types for garbage
        raise RecordError("bad_function_table", f"unreadable Arrow payload ({type(exc).__name__}: {exc})") from None


def unpack(data: bytes, codec: str = "zstd") -> pa.Table:
    """Read and validate a function table, conforming it to :data:`SCHEMA`."""
    table = unpack_ipc(data, codec)
    return conform(table)


def read(data: bytes, codec: str = "zstd") -> pa.Table:
    """Read a function table whose values are checked later, a whole step at once (:func:`check_tables`).

    A table already in :data:`SCHEMA` (what agents send) is returned as read; any other is conformed
    and checked here (:func:`unpack`).  Raises RecordError('bad_function_table')."""
    table = unpack_ipc(data, codec)
    if table.num_rows and table.schema.equals(SCHEMA, check_metadata=False):
        return table
    return conform(table)


def check_tables(tables: list[pa.Table]) -> list[RecordError | None]:
    """The values check of :func:`conform` for many tables in :data:`SCHEMA` at once (one step of a job:
    thousands of small tables): one vectorised pass over their concatenation, then the exact reason for
    the few that fail.  Returns, per table, None or the RecordError its record goes to the dead letters with."""
    if not tables:
        return []
    try:
        t = pa.concat_tables(tables, promote_options="none")
    except pa.ArrowInvalid:  # not all in SCHEMA (only ft.read's tables are): one at a time
        return [_refusal(x) for x in tables]
    n = np.fromiter((x.num_rows for x in tables), dtype=np.int64, count=len(tables))
    owner = np.repeat(np.arange(len(tables)), n)
    ok = pc.fill_null(
        pc.and_(pc.is_in(t.column("kind"), _KINDS_ARRAY), pc.is_in(t.column("resource"), _RESOURCES_ARRAY)), False
    ).to_numpy(zero_copy_only=False)
    ok &= t.column("function").is_valid().to_numpy(zero_copy_only=False)
    times = float_columns(t, _TIMES)
    ok &= ((times >= 0) & (times < np.inf)).all(axis=0)
    opt = float_columns(t, _OPTIONAL)
    ok &= (np.isnan(opt) | ((opt >= 0) & (opt < np.inf))).all(axis=0)
    ok &= t.column("calls").to_numpy(zero_copy_only=False) >= 0
    bad = np.bincount(owner, weights=~ok, minlength=len(tables)) > 0
    codes = (
        pc.fill_null(pc.dictionary_encode(t.column("function")).combine_chunks().indices, -1).to_numpy(
            zero_copy_only=False
        )
        + 1
    )
    span = int(codes.max(initial=0)) + 1
    pairs, counts = np.unique(owner * span + codes, return_counts=True)
    bad[pairs[counts > 1] // span] = True  # a function named twice in one table
    out: list[RecordError | None] = [None] * len(tables)
    for i in np.flatnonzero(bad):
        out[i] = _refusal(tables[i])
    return out


def _refusal(table: pa.Table) -> RecordError | None:
    try:
        _check_values(table)
    except RecordError as err:
        return err
    return None


def conform(table: pa.Table) -> pa.Table:
    """Check a function table against the contract and cast it to :data:`SCHEMA`."""
    if table.num_rows and table.schema.equals(SCHEMA, check_metadata=False):  # what our agents send: nothing to cast
        out = table.replace_schema_metadata(SCHEMA.metadata)
        if any(c.num_chunks != 1 for c in out.columns):
            out = out.combine_chunks()
        _check_values(out)
        return out
    names = set(table.column_names)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise RecordError("bad_function_table", f"function table lacks required columns {missing}")
    n = table.num_rows
    if n == 0:
        raise RecordError("bad_function_table", "function table has no rows")
    arrays = []
    for name, (typ, _) in COLUMNS.items():
        if name in names:
            col = table.column(name)
            try:
                col = col.cast(typ) if col.type != typ else col
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise RecordError(
                    "bad_function_table", f"column {name}: cannot read {col.type} as {typ} ({exc})"
                ) from None
            arrays.append(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
        elif name == "resource":
            kinds = table.column("kind").to_pylist()
            arrays.append(pa.array([default_resource(k) for k in kinds], type=typ))
        else:
            arrays.append(_null_array(typ, n))
    out = pa.Table.from_arrays(arrays, schema=SCHEMA)
    _check_values(out)
    return out


#: finite and >= 0
_TIMES = ("total_us", "critical_us")
#: >= 0, or NaN for unknown; never negative or infinite
_OPTIONAL = ("wait_us", "first_start_us", "mean_us", "p50_us", "p95_us", "max_us", "bytes") + SPREAD + PEAK


def float_columns(t: pa.Table, names: tuple[str, ...] | list[str]) -> np.ndarray:
    """The named float columns as one array, a row per column (nulls read as NaN)."""
    return np.stack([t.column(n).to_numpy(zero_copy_only=False) for n in names])


def _check_values(t: pa.Table) -> None:
    """A few whole-table checks (a feature batch is a few dozen rows: call overhead, not rows, is the cost)."""
    fn = t.column("function")
    if fn.null_count:
        raise RecordError("bad_function_table", "function names must not be null")
    kinds = set(t.column("kind").to_pylist())
    bad = kinds - _KIND_SET
    if bad:
        raise RecordError(
            "bad_function_table", f"unknown function kind(s) {sorted(map(str, bad))}; allowed: {FUNCTION_KINDS}"
        )
    res = set(t.column("resource").to_pylist()) - _RESOURCE_SET
    if res:
        raise RecordError("bad_function_table", f"unknown resource(s) {sorted(map(str, res))}; allowed: {RESOURCES}")
    times = float_columns(t, _TIMES)
    ok = (times >= 0) & (times < np.inf)  # False for NaN
    if not ok.all():
        name = _TIMES[int(np.flatnonzero(~ok.all(axis=1))[0])]
        raise RecordError("bad_function_table", f"{name} must be finite and >= 0")
    opt = float_columns(t, _OPTIONAL)
    ok = np.isnan(opt) | ((opt >= 0) & (opt < np.inf))
    if not ok.all():
        name = _OPTIONAL[int(np.flatnonzero(~ok.all(axis=1))[0])]
        raise RecordError("bad_function_table", f"{name} must be >= 0 (NaN for unknown), not negative or infinite")
    if t.column("calls").to_numpy(zero_copy_only=False).min() < 0:
        raise RecordError("bad_function_table", "calls must be >= 0")
    if len(set(fn.to_pylist())) != t.num_rows:
        raise RecordError("bad_function_table", "function names must be unique within a step")


def describe() -> str:
    """Human-readable schema, as published in schemas/arrow/function_table.txt."""
    lines = [f"# Lockstep function table, version {VERSION} (Arrow IPC stream, zstd-compressed as a whole)", ""]
    for name, (typ, doc) in COLUMNS.items():
        req = "required" if name in REQUIRED else "optional"
        lines.append(f"{name:16s} {typ!s:8s} {req:8s} {doc}")
    return "\n".join(lines) + "\n"
