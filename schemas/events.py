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

from .records import FUNCTION_KINDS

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
    ]
)
CONNECTION_REQUIRED = ("worker", "local", "peer", "segs_out", "retrans")

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
]
