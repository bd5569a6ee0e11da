"""StepResult <-> StepReport: how the step stage hands its reduction to the window stage."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.events import read_connections_ipc
from ...schemas.functions import float_columns, pack, unpack_ipc
from ...schemas.records import RecordError, StepClosed, StepReport
from .step import GROUP_SCHEMA, LINK_SHAPE, OUTLIER_SCHEMA, WORKER_SCHEMA, StepResult

#: columns of the step report's tables added after its first release (a missing one reads as not measured)
_ADDED = (
    LINK_SHAPE + tuple(f"peer_{c}" for c in LINK_SHAPE) + ("work_rest_us", "work_rest_mad_us", "order", "order_work_us")
)
MAX_VALUE = 1e15  # no measure in a step report is larger (in µs ~31 years); beyond it, corruption that could overflow
#: the columns of the step report's tables that are times (µs, never NaN), and their lower bound
TIMES = {
    "step_time_us": 1.0,
    "work_us": 0.0,
    "wait_us": 0.0,
    "worker_work_us": 0.0,
    "peer_work_us": 0.0,
    "work_mad_us": 0.0,
    "excess_us": -MAX_VALUE,
    "own_us": 0.0,
}


@dataclass(frozen=True)
class _Bounds:
    """What every float column of one of the tables may hold: NaN (a measure not taken) unless it is a time."""

    names: list[str]
    low: np.ndarray
    nan_ok: np.ndarray

    @classmethod
    def of(cls, schema: pa.Schema) -> _Bounds:
        names = [f.name for f in schema if pa.types.is_floating(f.type)]
        return cls(
            names, np.array([TIMES.get(n, -MAX_VALUE) for n in names]), np.array([n not in TIMES for n in names])
        )

    def check(self, table: pa.Table, what: str) -> None:
        if not table.num_rows:
            return
        v = float_columns(table, self.names)
        low, nan_ok = self.low[:, None], self.nan_ok[:, None]
        bad = (~(((v >= low) & (v <= MAX_VALUE)) | (nan_ok & np.isnan(v)))).any(axis=1)  # NaN compares false
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            name, low = self.names[i], self.low[i]
            what_it_is = f"NaN or within ±{MAX_VALUE:g}" if self.nan_ok[i] else f"a time in [{low:g}, {MAX_VALUE:g}] µs"
            raise RecordError("invalid", f"StepReport.{what}.{name} holds a value that is not {what_it_is}")


_BOUNDS = {
    "outliers": _Bounds.of(OUTLIER_SCHEMA),
    "groups": _Bounds.of(GROUP_SCHEMA),
    "workers": _Bounds.of(WORKER_SCHEMA),
}


def step_report(
    result: StepResult,
    *,
    window_start: int,
    window_steps: int,
    expected_workers: int,
    bytes_in: int,
    policy: str,
    tenant: str,
    closed: StepClosed,
) -> StepReport:
    return StepReport(
        job=result.job,
        window=result.window,
        step=result.step,
        window_start=window_start,
        window_steps=window_steps,
        expected_workers=expected_workers,
        workers_seen=result.workers_seen,
        bytes_in=bytes_in,
        step_time_us=result.step_time_us,
        step_time_median_us=result.step_time_median_us,
        work_max_us=result.work_max_us,
        healthy_work_max_us=result.healthy_work_max_us,
        outliers=pack(result.outliers),
        groups=pack(result.groups),
        workers=pack(result.workers) if result.workers is not None else b"",
        connections=pack(result.connections) if result.connections is not None else b"",
        policy=policy,
        tenant=tenant,
        closed=closed,
    )


def step_result(report: StepReport) -> StepResult:
    """Raises RecordError('bad_function_table') when a payload is unreadable, RecordError('invalid')
    when a time in it is not one (not finite, negative, a step under a microsecond)."""
    return StepResult(
        job=report.job,
        window=report.window,
        step=report.step,
        workers_seen=report.workers_seen,
        step_time_us=report.step_time_us,
        step_time_median_us=report.step_time_median_us,
        work_max_us=report.work_max_us,
        healthy_work_max_us=report.healthy_work_max_us,
        outliers=_table(report.outliers, OUTLIER_SCHEMA, "outliers"),
        groups=_table(report.groups, GROUP_SCHEMA, "groups"),
        workers=_table(report.workers, WORKER_SCHEMA, "workers") if report.workers else None,
        connections=read_connections_ipc(report.connections, "StepReport.connections") if report.connections else None,
    )


def _not_measured(t: pa.DataType, n: int) -> pa.Array:
    """A column a step stage one release older did not write: NaN, or empty lists."""
    if pa.types.is_list(t):
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], t.value_type))
    return pa.array(np.full(n, np.nan), t)


def _table(data: bytes, schema: pa.Schema, what: str) -> pa.Table:
    """An Arrow payload of a step report, cast to its schema (the window stage reads columns by name)."""
    table = unpack_ipc(data)
    if not table.schema.equals(schema, check_metadata=False):
        # a step stage one release older wrote it (mid-upgrade): evidence columns added since are not measured
        for f in schema:
            if f.name in _ADDED and f.name not in table.column_names:
                table = table.append_column(f.name, _not_measured(f.type, table.num_rows))
        try:
            table = table.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise RecordError(
                "bad_function_table", f"StepReport.{what} is not the {what} table of this version ({exc})"
            ) from None
    _BOUNDS[what].check(table, what)
    if what == "groups":
        _check_order(table)
    return table


def _check_order(groups: pa.Table) -> None:
    """A group table's ``order`` and ``order_work_us`` name one work per worker: lists of the same lengths, no
    nulls, works that are times."""
    order, work = groups.column("order").combine_chunks(), groups.column("order_work_us").combine_chunks()
    same = pc.equal(pc.list_value_length(order), pc.list_value_length(work))
    values = pc.list_flatten(work).to_numpy(zero_copy_only=False)
    if (
        order.null_count
        or work.null_count
        or pc.all(same).as_py() is False
        or pc.list_flatten(order).null_count
        or not ((values >= 0.0) & (values <= MAX_VALUE)).all()
    ):
        raise RecordError("invalid", "StepReport.groups.order and .order_work_us are not one time per worker")
