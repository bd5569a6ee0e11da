"""StepFrame: every worker's function table for one step, as flat columns.

The unit the step analysis works on.  Rows are (worker, function); worker
metadata lives in per-worker arrays indexed by ``row_worker``.  Built from one
function table per worker (:meth:`StepFrame.from_tables`: ``FeatureBatch``es,
trace files) or from columnar parts, a per-worker table (:data:`WORKER_SCHEMA`)
and their rows (:meth:`StepFrame.from_parts`: the shard stage's ``StepSlice``s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ...schemas import functions as ft
from ...schemas.records import WorkerMeta

#: the workers of a ``StepSlice`` (and of a step frame built from slices): metadata, step time, rows in the function table
WORKER_SCHEMA = pa.schema(
    [
        ("rank", pa.int64()),
        ("host", pa.string()),
        ("device", pa.string()),  # resolved: the worker's device, else host/gpu<local rank>
        ("nic", pa.string()),
        ("switch", pa.string()),
        ("group", pa.string()),  # peer-group key under the window's policy
        ("step_time_us", pa.float64()),
        ("hardware", pa.bool_()),  # the worker's sampler saw hardware
        ("rows", pa.int32()),  # its rows in the function table, which follow the workers' order
    ]
)


def worker_columns(workers: list[WorkerMeta], peer_keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """The metadata columns of :data:`WORKER_SCHEMA` for these workers."""
    return {
        "rank": [w.rank for w in workers],
        "host": [w.host for w in workers],
        "device": [w.device or f"{w.host}/gpu{w.local_rank}" for w in workers],
        "nic": [w.nic for w in workers],
        "switch": [w.switch for w in workers],
        "group": [peer_group_key(w.labels, peer_keys) for w in workers],
    }


def peer_group_key(labels: dict[str, str], keys: tuple[str, ...]) -> str:
    """Canonical peer-group key from a worker's labels, e.g. ``pp=1``; '' is the whole job."""
    return ";".join(f"{k}={labels[k]}" for k in keys if labels.get(k, "") != "")


@dataclass
class StepFrame:
    job: str
    window: str
    step: int
    # per worker
    rank: np.ndarray  # int64
    host: np.ndarray  # object (str)
    device: np.ndarray
    nic: np.ndarray
    switch: np.ndarray
    group: np.ndarray  # peer-group key per worker
    step_time_us: np.ndarray  # float64
    has_hardware: np.ndarray  # bool: the worker's sampler saw hardware
    # per row
    row_worker: np.ndarray  # int32 index into the per-worker arrays
    functions: pa.Table  # conformed to lockstep.schemas.functions.SCHEMA

    @property
    def n_workers(self) -> int:
        return int(self.rank.size)

    def column(self, name: str) -> np.ndarray:
        column: np.ndarray = self.functions.column(name).to_numpy(zero_copy_only=False)
        return column

    @classmethod
    def from_tables(
        cls,
        job: str,
        window: str,
        step: int,
        workers: list[WorkerMeta],
        step_times_us: list[float] | np.ndarray,
        tables: list[pa.Table],
        peer_keys: tuple[str, ...],
        hardware: list[str] | None = None,
    ) -> StepFrame:
        """From one conformed function table per worker (``FeatureBatch``es, trace files)."""
        n_rows = np.fromiter((t.num_rows for t in tables), dtype=np.int64, count=len(tables))
        row_worker = np.repeat(np.arange(len(tables), dtype=np.int32), n_rows)
        # one contiguous table: the analysis reads whole columns, 10,000 chunks would cost more than the copy
        table = pa.concat_tables(tables).combine_chunks() if tables else ft.SCHEMA.empty_table()
        meta = worker_columns(workers, peer_keys)
        return cls(
            job=job,
            window=window,
            step=step,
            rank=np.asarray(meta["rank"], dtype=np.int64),
            host=np.array(meta["host"], dtype=object),
            device=np.array(meta["device"], dtype=object),
            nic=np.array(meta["nic"], dtype=object),
            switch=np.array(meta["switch"], dtype=object),
            group=np.array(meta["group"], dtype=object),
            step_time_us=np.asarray(step_times_us, dtype=np.float64),
            has_hardware=np.array([h != "none" for h in (hardware or ["none"] * len(workers))], dtype=bool),
            row_worker=row_worker,
            functions=table,
        )

    @classmethod
    def from_parts(cls, job: str, window: str, step: int, workers: pa.Table, functions: pa.Table) -> StepFrame:
        """From a per-worker table (:data:`WORKER_SCHEMA`) and the workers' rows, in that order (a compact table)."""

        def col(name: str) -> np.ndarray:
            return np.asarray(workers.column(name).to_numpy(zero_copy_only=False))

        rows = col("rows").astype(np.int64)
        return cls(
            job=job,
            window=window,
            step=step,
            rank=col("rank").astype(np.int64),
            host=col("host"),
            device=col("device"),
            nic=col("nic"),
            switch=col("switch"),
            group=col("group"),
            step_time_us=col("step_time_us").astype(np.float64),
            has_hardware=col("hardware").astype(bool),
            row_worker=np.repeat(np.arange(rows.size, dtype=np.int32), rows),
            functions=functions,
        )
