"""Collectives matched across ranks by (process group, number, function): each instance's wait, and the function
tables' ``wait_us`` set where every call of a cell was matched."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from lockstep.schemas import functions as ft
from lockstep.schemas.events import COLLECTIVE_INSTANCE_SCHEMA
from lockstep.streams.diagnosis.collectives import Instances, by_worker_step, matched_waits, with_matched_waits

AR, K = "nccl:all_reduce", "ncclDevKernel_AllReduce"


def inst(worker: int, step: int, rows: list[tuple[str, str | None, int, float]]) -> Instances:
    f, g, n, d = zip(*rows) if rows else ((), (), (), ())
    table = pa.table(
        {"function": list(f), "process_group": list(g), "collective_seq": list(n), "duration_us": list(d)},
        schema=COLLECTIVE_INSTANCE_SCHEMA,
    )
    return Instances(worker, step, table)


def waits_of(t: pa.Table) -> dict[tuple[int, int, str], tuple[int, float]]:
    d = t.to_pydict()
    return {
        (w, s, f): (m, x) for w, s, f, m, x in zip(d["worker"], d["step"], d["function"], d["matched"], d["wait_us"])
    }


def test_a_window_that_starts_one_collective_later_is_matched_by_number_not_position():
    """Rank 1's window starts one all-reduce later and its step 1 ends one later: by position its calls pair with
    rank 0's neighbours.  By number each is compared with itself: rank 0 waits 30 at number 5 (rank 1 arrived
    late), rank 1 waits 10 at number 7 only."""
    r0 = [
        inst(0, 1, [(AR, "0", 4, 100.0), (AR, "0", 5, 130.0), (AR, "0", 6, 100.0)]),
        inst(0, 2, [(AR, "0", 7, 100.0)]),
    ]
    r1 = [inst(1, 1, [(AR, "0", 5, 100.0), (AR, "0", 6, 100.0), (AR, "0", 7, 110.0)]), inst(1, 2, [(AR, "0", 8, 90.0)])]
    got = waits_of(matched_waits(r0 + r1))
    # number 4 and number 8 are in one trace each: not matched
    assert got == {(0, 1, AR): (2, 30.0), (0, 2, AR): (1, 0.0), (1, 1, AR): (3, 10.0)}


def test_groups_and_functions_are_separate_instances():
    """The same number in another process group, or of another function (the CPU region against the kernel), is
    another instance; a group's name may be absent (null is a group of its own)."""
    got = waits_of(
        matched_waits(
            [
                inst(0, 3, [(AR, "0", 1, 50.0), (K, "0", 1, 500.0), (K, "1", 1, 80.0), (K, None, 9, 10.0)]),
                inst(1, 3, [(AR, "0", 1, 70.0), (K, "0", 1, 400.0), (K, "1", 1, 200.0), (K, None, 9, 15.0)]),
            ]
        )
    )
    assert got == {
        (0, 3, AR): (1, 0.0),
        (1, 3, AR): (1, 20.0),
        (0, 3, K): (3, 100.0 + 0.0 + 0.0),
        (1, 3, K): (3, 0.0 + 120.0 + 5.0),
    }


def test_one_call_in_two_rows_counts_once_with_its_durations_summed():
    got = waits_of(matched_waits([inst(0, 1, [(K, "0", 1, 30.0), (K, "0", 1, 30.0)]), inst(1, 1, [(K, "0", 1, 40.0)])]))
    assert got == {(0, 1, K): (2, 20.0), (1, 1, K): (1, 0.0)}


def test_nothing_numbered_matches_nothing():
    assert matched_waits([]).num_rows == 0
    assert matched_waits([inst(0, 1, []), inst(1, 1, [])]).num_rows == 0
    assert matched_waits([inst(0, 1, [(K, "0", 1, 3.0)])]).num_rows == 0  # one rank alone


def _table() -> pa.Table:
    return ft.make_table(
        {
            "function": [AR, K, "gemm"],
            "kind": ["collective", "collective", "compute"],
            "calls": [2, 3, 4],
            "total_us": [10.0, 20.0, 30.0],
            "critical_us": [10.0, 20.0, 30.0],
        }
    )


def test_the_wait_is_set_where_every_call_of_the_cell_was_matched():
    waits = matched_waits(
        [
            inst(0, 5, [(AR, "0", 1, 8.0), (AR, "0", 2, 6.0), (K, "0", 1, 9.0), (K, "0", 2, 9.0), (K, "1", 1, 9.0)]),
            inst(1, 5, [(AR, "0", 1, 5.0), (AR, "0", 2, 5.0), (K, "0", 1, 4.0), (K, "0", 2, 4.0)]),
        ]
    )
    cells = by_worker_step(waits)
    assert sorted(cells) == [(0, 5), (1, 5)]
    out = with_matched_waits(_table(), cells[(0, 5)])
    assert out.schema == ft.SCHEMA
    wait = out.column("wait_us").to_pylist()
    # all-reduce: both calls matched, 3 + 1; the kernel: 2 of its 3 calls (group 1's is in no other trace): the
    # cell keeps the step stage's estimate; gemm is no collective
    assert wait[0] == pytest.approx(4.0) and math.isnan(wait[1]) and math.isnan(wait[2])
    table = _table()
    assert with_matched_waits(table, cells.get((0, 6))) is table  # another step: the table as it was
    assert by_worker_step(matched_waits([])) == {}


def test_the_waits_come_sorted_by_worker_and_step():
    parts = [
        inst(w, s, [(K, "0", 10 * s + 1, 5.0 + w), (AR, "0", 10 * s + 2, 1.0 + w)]) for w in (2, 0, 1) for s in (4, 3)
    ]
    cells = by_worker_step(matched_waits(parts))
    assert sorted(cells) == [(w, s) for w in (0, 1, 2) for s in (3, 4)]
    for (w, s), t in cells.items():
        assert set(t.column("worker").to_pylist()) == {w} and set(t.column("step").to_pylist()) == {s}
        assert dict(zip(t.column("function").to_pylist(), t.column("wait_us").to_pylist())) == {K: w, AR: w}
