"""Raw inputs of the host-side summariser and of ``lockstep diagnose``.

- The **op-event table**: one row per executed function on one worker, times on
  that worker's own clock (only differences within a worker mean anything).
- The **hardware-sample table**: one row per sample of one metric on one worker.
- The **connection table**: one row per TCP connection of one worker over a window.

Both are Arrow tables (Parquet or CSV on disk).  The summariser turns them into
one function table (:mod:`lockstep.schemas.functions`) per worker and step.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from .functions import unpack_ipc
from .records import FUNCTION_KINDS, MAX_CONNECTIONS, Connection, RecordError

OP_EVENT_SCHEMA = pa.schema(
    [
        pa.field("worker", pa.int64(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("function", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),  # one of FUNCTION_KINDS
        pa.field("start_us", pa.float64(), nullable=False),
        pa.field("duration_us", pa.float64(), nullable=False),
        # optional
        pa.field("host", pa.string()),
        pa.field("device", pa.string()),
        pa.field("resource", pa.string()),  # gpu | pcie | nvlink | nic | cpu | storage | none
        pa.field("bytes", pa.float64()),
        pa.field("stream", pa.string()),  # thread / CUDA stream the event ran on
    ]
)
OP_EVENT_REQUIRED = ("worker", "step", "function", "kind", "start_us", "duration_us")
#: optional columns of a collective's instance, where the trace records them (torch's ``record_param_comms``
#: ``Seq`` and process group): the collective's sequence number in its process group, the same on every member
#: rank, and the group; null elsewhere.  A table with them matches collectives across ranks by (group, number)
#: (:mod:`lockstep.streams.diagnosis.collectives`); the trace reader adds them only to a trace that has them.
COLLECTIVE_FIELDS = (
    pa.field("collective_seq", pa.int64()),
    pa.field("process_group", pa.string()),
)
OP_EVENT_SEQ_SCHEMA = pa.schema([*OP_EVENT_SCHEMA, *COLLECTIVE_FIELDS])
#: one worker's numbered collective instances in one step (the summariser's, beside its function table): what
#: matching them across ranks needs, a few rows per collective call
COLLECTIVE_INSTANCE_SCHEMA = pa.schema(
    [
        pa.field("function", pa.string(), nullable=False),
        pa.field("process_group", pa.string()),
        pa.field("collective_seq", pa.int64(), nullable=False),
        pa.field("duration_us", pa.float64(), nullable=False),
    ]
)
#: bounds of an op event's values: what records can carry (schemas.records Rank, Step) and what a profiler
#: measures (an event of more than about 11.6 days, or a time beyond the year 5000, is a broken input)
MAX_WORKER = 10_000_000
MAX_STEP = 2**31 - 1
MAX_DURATION_US = 1e12
MAX_TIME_US = 1e17

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("worker", pa.int64(), nullable=False),
        pa.field("t_us", pa.float64(), nullable=False),  # same clock as the worker's op events
        pa.field("metric", pa.string(), nullable=False),  # a hardware column of the function table, e.g. sm_clock_mhz
        pa.field("value", pa.float64(), nullable=False),
    ]
)
SAMPLE_REQUIRED = ("worker", "t_us", "metric", "value")

#: the **connection table**: one row per TCP connection of one worker's training process during a window (its
#: counters' change over the window, its RTT at the end), read from the kernel's ``tcp_info`` by the agent
#: (``producers/agent/tcpdiag.py``).  ``local`` and ``peer`` are ``address:port``; a connection between two workers
#: appears on both with the two swapped, which is how the diagnosis knows which worker is at its other end
#: (:mod:`lockstep.streams.diagnosis.links`).  ``segs_out`` and ``retrans`` are the data segments the worker sent and
#: those it sent again: a lossy path shows at its sender.
CONNECTION_SCHEMA = pa.schema(
    [
        pa.field("worker", pa.int64(), nullable=False),
        pa.field("local", pa.string(), nullable=False),
        pa.field("peer", pa.string(), nullable=False),
        pa.field("segs_out", pa.int64(), nullable=False),
        pa.field("retrans", pa.int64(), nullable=False),
        pa.field("bytes_sent", pa.int64()),
        pa.field("rtt_us", pa.float64()),  # smoothed RTT at the window's end
        pa.field("min_rtt_us", pa.float64()),
        pa.field("busy_us", pa.int64()),  # time with data in flight, in the window
        pa.field("rwnd_limited_us", pa.int64()),  # ... held back by the peer's receive window
        pa.field("sndbuf_limited_us", pa.int64()),  # ... held back by the sender's buffer
    ]
)
CONNECTION_REQUIRED = ("worker", "local", "peer", "segs_out", "retrans")
_CONNECTION_FIELDS = [f.name for f in CONNECTION_SCHEMA if f.name != "worker"]


def connection_records(table: pa.Table) -> list[Connection]:
    """One worker's connection table -> the ``connections`` of its ``WindowFeatures`` (those that sent most, at most
    MAX_CONNECTIONS; a record bounds what it carries)."""
    if table.num_rows > MAX_CONNECTIONS:
        table = table.sort_by([("segs_out", "descending")]).slice(0, MAX_CONNECTIONS)
    return [Connection(**row) for row in table.select(_CONNECTION_FIELDS).to_pylist()]


def read_connections_ipc(data: bytes, what: str) -> pa.Table:
    """A record's connection table (an Arrow IPC stream, zstd) as CONNECTION_SCHEMA; raises
    RecordError('bad_function_table') when it is not one (columns, types, a negative count or worker)."""
    table = unpack_ipc(data)
    for f in CONNECTION_SCHEMA:  # a column an older processor's table has not: empty
        if f.nullable and f.name not in table.column_names:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    try:
        table = table.select(CONNECTION_SCHEMA.names).cast(CONNECTION_SCHEMA)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise RecordError("bad_function_table", f"{what} is not a connection table ({exc})") from None
    for name in ("worker", "segs_out", "retrans"):
        col = table.column(name)
        if col.null_count or (table.num_rows and pc.min(col).as_py() < 0):
            raise RecordError("bad_function_table", f"{what}.{name} holds an empty or negative value")
    return table


def connection_table(workers: list[int], connections: list[list[Connection]]) -> pa.Table:
    """Workers' ``WindowFeatures.connections`` -> one connection table (CONNECTION_SCHEMA)."""
    rows = [
        {"worker": w, **{k: getattr(c, k) for k in _CONNECTION_FIELDS}}
        for w, conns in zip(workers, connections, strict=True)
        for c in conns
    ]
    return pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)


__all__ = [
    "COLLECTIVE_FIELDS",
    "COLLECTIVE_INSTANCE_SCHEMA",
    "CONNECTION_REQUIRED",
    "CONNECTION_SCHEMA",
    "FUNCTION_KINDS",
    "MAX_DURATION_US",
    "MAX_STEP",
    "MAX_TIME_US",
    "MAX_WORKER",
    "OP_EVENT_REQUIRED",
    "OP_EVENT_SCHEMA",
    "OP_EVENT_SEQ_SCHEMA",
    "SAMPLE_REQUIRED",
    "SAMPLE_SCHEMA",
    "connection_records",
    "connection_table",
    "read_connections_ipc",
]
