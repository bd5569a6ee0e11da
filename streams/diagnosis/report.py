"""StepResult <-> StepReport: how the step stage hands its reduction to the window stage."""

from __future__ import annotations

import pyarrow as pa

from ...schemas.functions import pack, unpack_ipc
from ...schemas.records import RecordError, StepReport
from .step import GROUP_SCHEMA, OUTLIER_SCHEMA, StepResult


def step_report(
    result: StepResult,
    *,
    window_start: int,
    window_steps: int,
    expected_workers: int,
    bytes_in: int,
    policy: str,
    tenant: str,
    closed: str,
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
        policy=policy,
        tenant=tenant,
        closed=closed,  # type: ignore[arg-type]
    )


def step_result(report: StepReport) -> StepResult:
    """Raises RecordError('bad_function_table') when a payload is unreadable."""
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
    )


def _table(data: bytes, schema: pa.Schema, what: str) -> pa.Table:
    """An Arrow payload of a step report, cast to its schema (the window stage reads columns by name)."""
    table = unpack_ipc(data)
    if table.schema.equals(schema, check_metadata=False):
        return table
    try:
        return table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise RecordError("bad_function_table", f"StepReport.{what} is not the {what} table of this version ({exc})") from None
