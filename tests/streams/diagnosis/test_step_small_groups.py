"""The step analysis' comparison of small groups (2 to ``ratio_peers_max`` workers) where the other workers have no
work in a function: they did not run it, or ran it in no time.  The rise is over at least a microsecond (as the
robust z's scale is), so it is finite and within what a step report may carry."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.schemas import functions as ft
from lockstep.schemas.records import WorkerMeta
from lockstep.streams.diagnosis import StepFrame, analyze_step, step_report, step_result
from lockstep.streams.policy import Policy


def step(tables: list[dict[str, float]]):
    workers = [WorkerMeta(rank=i, host=f"h{i}") for i in range(len(tables))]
    t = [
        ft.make_table(
            {
                "function": list(fns),
                "kind": ["compute"] * len(fns),
                "calls": [1] * len(fns),
                "total_us": list(fns.values()),
                "critical_us": list(fns.values()),
            }
        )
        for fns in tables
    ]
    policy = Policy()
    frame = StepFrame.from_tables("j", "w0", 0, workers, [100_000.0] * len(t), t, policy.diagnosis.peer_group_keys)
    return analyze_step(frame, policy.diagnosis)


@pytest.mark.parametrize("peer_time", [None, 0.0, 1e-9, 0.5])
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_function_the_other_workers_did_not_run_or_ran_in_no_time_rises_by_its_work_in_microseconds(
    peer_time, workers
):
    others = {"fwd": 60_000.0} | ({} if peer_time is None else {"only0": peer_time})
    r = step([{"fwd": 60_000.0, "only0": 5_000.0}] + [others] * (workers - 1))
    rows = [o for o in r.outliers.to_pylist() if o["worker"] == 0]  # the others may be far below it: ``low``
    # of two, by ratio; of three or four that agree, the robust z flags it first (its scale is floored at 1 us too)
    assert [(o["function"], o["signal"]) for o in rows] == [("only0", "ratio" if workers == 2 else "work")]
    assert rows[0]["z"] == pytest.approx(5_000.0 - (peer_time or 0.0))  # (work - other) / max(other, 1 us)
    assert rows[0]["present"] == (1 if peer_time is None else workers)
    report = step_report(
        r,
        window_start=0,
        window_steps=1,
        expected_workers=workers,
        bytes_in=0,
        policy="p",
        tenant="",
        closed="complete",
    )
    assert np.isfinite(step_result(report).outliers.column("z").to_numpy()).all()


def test_above_a_microsecond_the_rise_is_the_ratio_less_one_as_before():
    r = step([{"fwd": 60_000.0, "opt": 3_000.0}, {"fwd": 60_000.0, "opt": 1_000.0}])
    (row,) = [o for o in r.outliers.to_pylist() if o["worker"] == 0]
    assert (row["worker"], row["function"], row["z"], row["peer_work_us"]) == (0, "opt", 2.0, 1_000.0)
