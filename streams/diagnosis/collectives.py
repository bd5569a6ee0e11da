"""Collectives matched across ranks by their sequence number: each instance's wait, where the traces number them.

Pure and vectorised.  A collective's duration on a rank includes its wait for the last member to arrive; the
last to arrive waits least, so its duration is the transfer, and every other member's wait is its excess over
that.  Without numbers the step stage can only compare each worker's *total* of a function in a step with the
shortest total (:func:`lockstep.streams.diagnosis.step._work`): instances are paired by the step they fell in and
their function's name, so a rank whose window holds one instance more or less (a collective of another process
group under the same kernel name, a window that starts one collective later, an instance that falls in the next
step on one rank) compares different calls.  ``torch.profiler`` numbers each collective in its process group
(``record_param_comms``'s ``Seq``): the same (group, number, function) on two ranks is the same call, so its wait
is exact.

:func:`matched_waits` gives, per (worker, step, function), the waits of its numbered instances that at least one
other worker's trace holds too, and how many of its calls those are; :func:`with_matched_waits` puts them in the
function tables' ``wait_us`` where every call of the cell was matched (the step stage then uses them instead of
its estimate); a cell with an instance no other trace holds (its group's other members were not traced) keeps the
estimate, as does everything when no trace numbers its collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...schemas.events import COLLECTIVE_INSTANCE_SCHEMA

#: per (worker, step, function) with numbered instances: the matched ones' waits summed, and how many they are
WAIT_SCHEMA = pa.schema(
    [
        ("worker", pa.int64()),
        ("step", pa.int64()),
        ("function", pa.string()),
        ("matched", pa.int32()),  # calls of the cell whose (group, number) another worker's trace holds
        ("wait_us", pa.float64()),  # their waits: each one's excess over the shortest of its instances
    ]
)


@dataclass(frozen=True)
class Instances:
    """One worker's numbered collective instances in one step (COLLECTIVE_INSTANCE_SCHEMA)."""

    worker: int
    step: int
    table: pa.Table


def matched_waits(parts: list[Instances]) -> pa.Table:
    """Each numbered instance's wait (its duration minus the shortest duration of the same (process group, number,
    function) on any worker), summed per (worker, step, function) over the instances at least two workers hold
    (WAIT_SCHEMA, sorted by worker, step); an instance one worker holds alone is not matched."""
    parts = [p for p in parts if p.table.num_rows]
    if not parts:
        return WAIT_SCHEMA.empty_table()
    n = np.fromiter((p.table.num_rows for p in parts), dtype=np.int64, count=len(parts))
    t = pa.concat_tables([p.table.cast(COLLECTIVE_INSTANCE_SCHEMA) for p in parts])
    worker = np.repeat(np.fromiter((p.worker for p in parts), dtype=np.int64, count=len(parts)), n)
    step = np.repeat(np.fromiter((p.step for p in parts), dtype=np.int64, count=len(parts)), n)
    fcode, fnames = _codes(t.column("function"))
    gcode, _ = _codes(pc.fill_null(t.column("process_group"), ""))
    seq = t.column("collective_seq").to_numpy()
    dur = t.column("duration_us").to_numpy()
    # the instance: (group, number, function); one worker's rows of one instance are one call of it
    inst = _key(gcode, seq, fcode)
    n_i = int(inst.max()) + 1
    wi = _key(inst, worker)  # the calls
    first = np.unique(wi, return_index=True)[1]  # each call's first row
    call_inst = inst[first]
    per_call = np.bincount(wi, weights=dur)  # a call split in rows on one worker: their sum
    members = np.bincount(call_inst, minlength=n_i)
    shortest = np.full(n_i, np.inf)
    np.minimum.at(shortest, call_inst, per_call)
    rows = np.flatnonzero(members[inst] >= 2)
    if rows.size == 0:
        return WAIT_SCHEMA.empty_table()
    # each call's wait on its first row (the others add nothing)
    wait = np.zeros(wi.size)
    wait[first] = per_call - shortest[call_inst]
    ci = _key(worker[rows], step[rows], fcode[rows])  # the cells, in (worker, step, function) order
    cell_first = rows[np.unique(ci, return_index=True)[1]]
    n_c = cell_first.size
    return pa.Table.from_arrays(
        [
            pa.array(worker[cell_first], pa.int64()),
            pa.array(step[cell_first], pa.int64()),
            pa.array(fnames[fcode[cell_first]].tolist(), pa.string()),
            pa.array(np.bincount(ci, minlength=n_c).astype(np.int32)),  # rows: as the function table counts calls
            pa.array(np.bincount(ci, weights=wait[rows], minlength=n_c)),
        ],
        schema=WAIT_SCHEMA,
    )


def by_worker_step(waits: pa.Table) -> dict[tuple[int, int], pa.Table]:
    """:func:`matched_waits`' rows of each (worker, step) (its rows are sorted so): one pass, not a filter per
    function table."""
    if waits.num_rows == 0:
        return {}
    w = waits.column("worker").to_numpy()
    s = waits.column("step").to_numpy()
    cut = np.flatnonzero((np.diff(w) != 0) | (np.diff(s) != 0)) + 1
    bounds = np.concatenate([[0], cut, [w.size]])
    return {(int(w[a]), int(s[a])): waits.slice(a, b - a) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())}


def with_matched_waits(functions: pa.Table, mine: pa.Table | None) -> pa.Table:
    """A worker's function table for a step with ``wait_us`` set from ``mine`` (its rows of :func:`matched_waits`,
    :func:`by_worker_step`) for the functions whose every call was matched; the table itself when none was."""
    if mine is None or mine.num_rows == 0 or functions.num_rows == 0:
        return functions
    at = pc.index_in(functions.column("function"), value_set=mine.column("function"))
    at = np.asarray(at.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    hit = at >= 0
    pos = np.where(hit, at, 0)
    calls = functions.column("calls").to_numpy(zero_copy_only=False)
    matched = mine.column("matched").to_numpy()[pos]
    whole = hit & (matched == calls)
    if not whole.any():
        return functions
    wait = np.asarray(functions.column("wait_us").to_numpy(zero_copy_only=False), dtype=np.float64).copy()
    wait[whole] = mine.column("wait_us").to_numpy()[pos][whole]
    i = functions.schema.get_field_index("wait_us")
    field = functions.schema.field(i)
    return functions.set_column(i, field, pa.array(wait, pa.float64()).cast(field.type))


def _key(*cols: np.ndarray) -> np.ndarray:
    """Dense codes 0..k-1 of the rows' tuples of ``cols``, in the tuples' lexicographic order."""
    key = np.zeros(cols[0].size, dtype=np.int64)
    for c in cols:
        values, code = np.unique(c, return_inverse=True)
        key = np.unique(key * values.size + code.reshape(-1), return_inverse=True)[1].reshape(-1)
    return key


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = arr.dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), np.asarray(
        enc.dictionary.to_pylist(), dtype=object
    )
