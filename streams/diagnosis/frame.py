"""StepFrame: every worker's function table for one step, as flat columns.

The unit the step analysis works on.  Rows are (worker, function); worker
metadata lives in per-worker arrays indexed by ``row_worker``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ...schemas import functions as ft
from ...schemas.records import WorkerMeta


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
    labels: list[dict[str, str]]
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
        """From one conformed function table per worker (the stream processor's path)."""
        n_rows = np.fromiter((t.num_rows for t in tables), dtype=np.int64, count=len(tables))
        row_worker = np.repeat(np.arange(len(tables), dtype=np.int32), n_rows)
        # one contiguous table: the analysis reads whole columns, 10,000 chunks would cost more than the copy
        table = pa.concat_tables(tables).combine_chunks() if tables else ft.SCHEMA.empty_table()
        return cls(
            job=job,
            window=window,
            step=step,
            rank=np.fromiter((w.rank for w in workers), dtype=np.int64, count=len(workers)),
            host=np.array([w.host for w in workers], dtype=object),
            device=np.array([w.device or f"{w.host}/gpu{w.local_rank}" for w in workers], dtype=object),
            nic=np.array([w.nic for w in workers], dtype=object),
            switch=np.array([w.switch for w in workers], dtype=object),
            group=np.array([peer_group_key(w.labels, peer_keys) for w in workers], dtype=object),
            labels=[dict(w.labels) for w in workers],
            step_time_us=np.asarray(step_times_us, dtype=np.float64),
            has_hardware=np.array([h != "none" for h in (hardware or ["none"] * len(workers))], dtype=bool),
            row_worker=row_worker,
            functions=table,
        )
