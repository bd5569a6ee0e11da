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


def pack_lz4(table: pa.Table) -> tuple[bytes, int]:
    """Arrow IPC stream as one LZ4 block, and the stream's size (the reader allocates that, bounded).  For the
    processor's own internal records (``StepSlice``): about as small as zstd here, read twice as fast."""
    raw = pack(table, "none")
    return bytes(cramjam.lz4.compress_block(raw, store_size=False)), len(raw)


def unpack_ipc(data: bytes, codec: str = "zstd", max_bytes: int = MAX_TABLE_BYTES, size: int = 0) -> pa.Table:
    """Decompress (bounded: :func:`~.compression.zstd_decompress`; an LZ4 block to the ``size`` its record
    declares, at most ``max_bytes``) and read an Arrow IPC stream; raises RecordError('bad_function_table')."""
    try:
        if len(data) > max_bytes:
            raise RecordError("bad_function_table", f"payload of {len(data)} bytes, over {max_bytes}")
        if codec == "lz4":
            if not 0 < size <= max_bytes:
                raise RecordError(
                    "bad_function_table", f"an lz4 payload needs its declared size, 1 to {max_bytes} bytes, not {size}"
                )
            raw: bytes | memoryview = memoryview(cramjam.lz4.decompress_block(data, output_len=size))
        else:
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
    bad = bad_owners(t, np.repeat(np.arange(len(tables)), n), len(tables))
    out: list[RecordError | None] = [None] * len(tables)
    for i in np.flatnonzero(bad):
        out[i] = _refusal(tables[i])
    return out


def bad_owners(t: pa.Table, owner: np.ndarray, n_owners: int, part: np.ndarray | None = None) -> np.ndarray:
    """Which owners' rows fail the values check of :func:`conform`, in one vectorised pass over ``t`` (the rows of
    many records; ``owner``: the record of each row).  A function may be named once per owner, or once per owner and
    ``part`` (a window table's step).  Reads the columns ``t`` has of :data:`SCHEMA` (a compact table lacks some)."""
    ok = _known(t.column("kind"), _KINDS_ARRAY) & _known(t.column("resource"), _RESOURCES_ARRAY)
    ok &= t.column("function").is_valid().to_numpy(zero_copy_only=False)
    for name in _TIMES:  # finite and >= 0 (False for NaN)
        v = t.column(name).to_numpy(zero_copy_only=False)
        ok &= (v >= 0) & (v < np.inf)
    for name in _OPTIONAL:  # NaN, or finite and >= 0
        if name in t.column_names:
            v = t.column(name).to_numpy(zero_copy_only=False)
            ok &= ~((v < 0) | (v == np.inf))
    ok &= t.column("calls").to_numpy(zero_copy_only=False) >= 0
    bad = np.bincount(owner, weights=~ok, minlength=n_owners) > 0
    codes = (
        pc.fill_null(pc.dictionary_encode(t.column("function")).combine_chunks().indices, -1)
        .to_numpy(zero_copy_only=False)
        .astype(np.int64)
        + 1
    )
    span = int(codes.max(initial=0)) + 1
    group = owner.astype(np.int64) if part is None else owner.astype(np.int64) * (int(part.max(initial=0)) + 1) + part
    if group.size > 1 and (group[1:] >= group[:-1]).all():  # each table's (step's) rows together, as records are read
        change = np.r_[True, group[1:] != group[:-1]]
        starts = np.flatnonzero(change)
        key = (np.cumsum(change) - 1) * span + codes  # (table number, function)
        if starts.size * span < 8 * key.size + (1 << 20):  # a dense key range: count, no sort
            dup = np.flatnonzero(np.bincount(key) > 1)
        else:
            pairs, counts = np.unique(key, return_counts=True)
            dup = pairs[counts > 1]
        bad[owner[starts[dup // span]]] = True  # a function named twice in one table (step)
        return bad
    pairs, counts = np.unique(group * span + codes, return_counts=True)
    dup = pairs[counts > 1] // span
    if part is not None:
        dup //= int(part.max(initial=0)) + 1
    bad[dup] = True
    return bad


def _known(col: pa.ChunkedArray, allowed: pa.Array) -> np.ndarray:
    """Per row: a value of ``allowed`` (False for null).  A dictionary column of a few chunks is checked once per
    dictionary entry; one of many small chunks (a shard's records, a dictionary each) in Arrow's own pass."""
    if pa.types.is_dictionary(col.type) and col.num_chunks <= 4:
        parts = []
        for chunk in col.chunks:
            ok = np.append(
                pc.fill_null(pc.is_in(chunk.dictionary, allowed), False).to_numpy(zero_copy_only=False), False
            )  # [-1]: null
            idx = chunk.indices
            codes = (
                idx.to_numpy(zero_copy_only=False)
                if not idx.null_count
                else pc.fill_null(idx, -1).to_numpy(zero_copy_only=False)
            )
            parts.append(
                ok[np.where((codes >= 0) & (codes < ok.size - 1), codes, -1)]
            )  # an index past the dictionary: unknown
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
    return np.asarray(pc.fill_null(pc.is_in(col, allowed), False).to_numpy(zero_copy_only=False), dtype=bool)


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
    if not names:
        return np.empty((0, t.num_rows))
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
    present = [c for c in _OPTIONAL if c in t.column_names]  # a compact table has fewer
    opt = float_columns(t, present)
    ok = np.isnan(opt) | ((opt >= 0) & (opt < np.inf))
    if not ok.all():
        name = present[int(np.flatnonzero(~ok.all(axis=1))[0])]
        raise RecordError("bad_function_table", f"{name} must be >= 0 (NaN for unknown), not negative or infinite")
    calls = t.column("calls")
    if calls.null_count or calls.to_numpy(zero_copy_only=False).min() < 0:
        raise RecordError("bad_function_table", "calls must be >= 0 (and present)")
    if len(set(fn.to_pylist())) != t.num_rows:
        raise RecordError("bad_function_table", "function names must be unique within a step")


# --------------------------------------------------------------------------- window tables (one worker's whole window)
#
# A ``WindowFeatures`` record carries one worker's steps of a window in one table: a ``step`` column, then
# only what the diagnosis reads (:data:`COMPACT`), function names (and kinds, resources) dictionary-encoded
# once per record, and optional columns that no row of the record has a value for left out (a reader fills
# them: NaN, 0).  The processor's step frames hold the same columns.

#: the link metrics whose shape the diagnosis reads (a ring's culprit is steady while its ring-mates burst)
LINK_SHAPE = ("nic_gbps_sd", "nic_gbps_p95", "nvlink_gbps_sd", "nvlink_gbps_p95")
#: what the diagnosis reads of a function table: not ``first_start_us``, ``p50_us``, ``max_us``, nor the spread
#: and peak of the metrics other than the links'
COMPACT = (
    (
        "function",
        "kind",
        "resource",
        "calls",
        "total_us",
        "critical_us",
        "wait_us",
        "mean_us",
        "p95_us",
        "bytes",
        "samples",
        "clock_events",
    )
    + HARDWARE
    + LINK_SHAPE
)
_NAMES = ("function", "kind", "resource")
DICTIONARY = pa.dictionary(pa.int32(), pa.string())
#: the compact table (the processor's step frames): names dictionary-encoded, every column present
COMPACT_SCHEMA = pa.schema(
    [pa.field(n, DICTIONARY if n in _NAMES else COLUMNS[n][0], nullable=n not in REQUIRED) for n in COMPACT],
    metadata={"lockstep.function_table.version": str(VERSION)},
)
WINDOW_VERSION = 1
#: a window table (``WindowFeatures.functions``): a step column, then the compact table's columns; optional ones
#: may be absent (a reader fills them); rows of one step are consecutive
WINDOW_SCHEMA = pa.schema(
    [pa.field("step", pa.int32(), nullable=False), *COMPACT_SCHEMA],
    metadata={"lockstep.window_table.version": str(WINDOW_VERSION)},
)
_WINDOW_TYPES = {f.name: f.type for f in WINDOW_SCHEMA}
_WINDOW_REQUIRED = ("step", *REQUIRED)


def _null_fill(typ: pa.DataType) -> object:
    return float("nan") if pa.types.is_floating(typ) else 0


def compact(table: pa.Table) -> pa.Table:
    """A function table in :data:`SCHEMA` as a compact table (:data:`COMPACT_SCHEMA`): the columns the diagnosis reads."""
    arrays = [pc.dictionary_encode(table.column(n)) if n in _NAMES else table.column(n) for n in COMPACT]
    return pa.Table.from_arrays(arrays, schema=COMPACT_SCHEMA)


def window_table(steps: list[int] | np.ndarray, tables: list[pa.Table]) -> pa.Table:
    """One worker's function tables of several steps (each in :data:`SCHEMA`) as one window table: a ``step``
    column, then the compact columns, names dictionary-encoded once (:func:`pack_window` leaves empty columns out)."""
    t = pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0]
    step = pa.array(np.repeat(np.asarray(steps, dtype=np.int32), [x.num_rows for x in tables]), pa.int32())
    return pa.Table.from_arrays([step, *compact(t).columns], schema=WINDOW_SCHEMA)


def pack_window(table: pa.Table, codec: str = "zstd") -> bytes:
    """A window table (:data:`WINDOW_SCHEMA`) on the wire: optional columns without any value (all NaN, all 0) left
    out, the rest as an Arrow IPC stream compressed as a whole."""
    keep = [
        i
        for i, f in enumerate(table.schema)
        if f.name in _WINDOW_REQUIRED or f.type == DICTIONARY or _has_values(table.column(i))
    ]
    if len(keep) < table.num_columns:
        table = table.select(keep)
    return pack(table, codec)


def _has_values(col: pa.ChunkedArray) -> bool:
    """Any value that is not null, NaN (floats) or 0 (counts)."""
    if col.null_count == len(col):
        return False
    v = col.to_numpy(zero_copy_only=False) if col.num_chunks != 1 else col.chunk(0).to_numpy(zero_copy_only=False)
    return bool((~np.isnan(v)).any()) if v.dtype.kind == "f" else bool(v.any())


def read_compact(data: bytes, codec: str = "zstd", *, window: bool = True, size: int = 0) -> pa.Table:
    """Read a window table (``window``; without: a compact table, a ``StepSlice``'s), bounded like :func:`unpack_ipc`.
    Its values are checked later, many records at once (:func:`bad_owners`).  Columns are cast to
    :data:`WINDOW_SCHEMA`'s types, unknown ones dropped, absent optional ones left absent (:func:`complete` fills
    them; ``resource`` follows from ``kind``).  Raises RecordError('bad_function_table')."""
    t = unpack_ipc(data, codec, size=size)
    names = t.column_names
    what = "window table" if window else "compact function table"
    missing = [c for c in (_WINDOW_REQUIRED if window else REQUIRED) if c not in names]
    if missing:
        raise RecordError("bad_function_table", f"{what} lacks required columns {missing}")
    if window and t.num_rows == 0:
        raise RecordError("bad_function_table", f"{what} has no rows")
    if (
        "resource" in names
        and (window or "step" not in names)
        and t.schema.equals(_canonical(tuple(names)), check_metadata=False)
    ):
        return t  # what our agents and shard stages send: nothing to cast
    fields, arrays = [], []
    for name in names:
        typ = _WINDOW_TYPES.get(name)
        if typ is None or (name == "step" and not window):
            continue  # a column of a later version
        col = t.column(name)
        try:
            col = col.cast(typ) if col.type != typ else col
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise RecordError("bad_function_table", f"column {name}: cannot read {col.type} as {typ} ({exc})") from None
        fields.append(WINDOW_SCHEMA.field(name))
        arrays.append(col)
    if "resource" not in names:
        kinds = t.column("kind").to_pylist()
        fields.append(WINDOW_SCHEMA.field("resource"))
        arrays.append(pa.array([default_resource(k) for k in kinds], pa.string()).dictionary_encode())
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=WINDOW_SCHEMA.metadata))


def refusal(t: pa.Table, part: np.ndarray | None = None) -> RecordError | None:
    """Why :func:`bad_owners` refused one record's rows: the first failing check of :func:`conform`'s, each ``part``
    (a window table's step, a slice's worker) checked alone."""
    if part is None:
        return _refusal(t)
    for v in np.unique(part):
        err = _refusal(t.filter(pa.array(part == v)))
        if err is not None:
            return err
    return None


_CANONICAL: dict[tuple[str, ...], pa.Schema] = {}


def _canonical(names: tuple[str, ...]) -> pa.Schema:
    """:data:`WINDOW_SCHEMA` restricted to ``names`` (in that order), or an impossible schema for unknown names."""
    schema = _CANONICAL.get(names)
    if schema is None:
        if len(_CANONICAL) > 1024:
            _CANONICAL.clear()
        known = all(n in _WINDOW_TYPES for n in names)
        schema = _CANONICAL[names] = pa.schema([WINDOW_SCHEMA.field(n) for n in names]) if known else pa.schema([])
    return schema


def concat(tables: list[pa.Table]) -> pa.Table:
    """Compact (or window) tables of several records as one; a column some of them left out is null there
    (:func:`complete` fills it)."""
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="none")
    except pa.ArrowInvalid:  # different column sets
        return pa.concat_tables(tables, promote_options="default")


def complete(t: pa.Table, schema: pa.Schema = COMPACT_SCHEMA) -> pa.Table:
    """``t`` (columns of ``schema``, some absent or null) with every column of ``schema``: absent and null values
    filled (NaN, 0), names dictionary-encoded."""
    n = t.num_rows
    arrays = []
    for f in schema:
        if f.name not in t.column_names:
            arrays.append(_null_array(f.type, n) if f.type != DICTIONARY else pa.nulls(n, f.type))
            continue
        col = t.column(f.name)
        if col.null_count and f.type != DICTIONARY:
            col = pc.fill_null(col, pa.scalar(_null_fill(f.type), f.type))
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=schema)


def describe() -> str:
    """Human-readable schema, as published in schemas/arrow/function_table.txt."""
    lines = [f"# Lockstep function table, version {VERSION} (Arrow IPC stream, zstd-compressed as a whole)", ""]
    for name, (typ, doc) in COLUMNS.items():
        req = "required" if name in REQUIRED else "optional"
        lines.append(f"{name:16s} {typ!s:8s} {req:8s} {doc}")
    return "\n".join(lines) + "\n"


def describe_window() -> str:
    """Human-readable window table schema, as published in schemas/arrow/window_table.txt."""
    lines = [
        f"# Lockstep window table, version {WINDOW_VERSION}: one worker's steps of a window (WindowFeatures.functions;",
        "# Arrow IPC stream, zstd-compressed as a whole).  One row per (step, function); names dictionary-encoded;",
        "# optional columns without any value in the record are left out (readers fill NaN, or 0 for counts).",
        "",
    ]
    for f in WINDOW_SCHEMA:
        doc = "the step of the window this row belongs to" if f.name == "step" else COLUMNS[f.name][1]
        req = "required" if f.name in _WINDOW_REQUIRED else "optional"
        lines.append(f"{f.name:16s} {'dictionary<string>' if f.type == DICTIONARY else str(f.type):18s} {req:8s} {doc}")
    return "\n".join(lines) + "\n"
