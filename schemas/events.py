"""Raw inputs of the host-side summariser and of ``lockstep diagnose``.

- The **op-event table**: one row per executed function on one worker, times on
  that worker's own clock (only differences within a worker mean anything).
- The **hardware-sample table**: one row per sample of one metric on one worker.

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

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("worker", pa.int64(), nullable=False),
        pa.field("t_us", pa.float64(), nullable=False),  # same clock as the worker's op events
        pa.field("metric", pa.string(), nullable=False),  # a hardware column of the function table, e.g. sm_clock_mhz
        pa.field("value", pa.float64(), nullable=False),
    ]
)
SAMPLE_REQUIRED = ("worker", "t_us", "metric", "value")

__all__ = ["FUNCTION_KINDS", "OP_EVENT_REQUIRED", "OP_EVENT_SCHEMA", "SAMPLE_REQUIRED", "SAMPLE_SCHEMA"]
