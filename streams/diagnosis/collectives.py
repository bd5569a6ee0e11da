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
    (WAIT_SCHEMA); an instance one worker holds alone is not matched."""
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
    _, inst = np.unique(np.stack([gcode, seq, fcode]), axis=1, return_inverse=True)
    inst = inst.reshape(-1)
    n_i = int(inst.max()) + 1
    wkeys, wi = np.unique(np.stack([inst, worker]), axis=1, return_inverse=True)
    wi = wi.reshape(-1)
    per_worker = np.bincount(wi, weights=dur)  # a call split in rows on one worker: their sum
    members = np.bincount(wkeys[0], minlength=n_i)
    shortest = np.full(n_i, np.inf)
    np.minimum.at(shortest, wkeys[0], per_worker)
    matched = members[inst] >= 2
    # each call's wait, on the call's first row (the others add nothing)
    first = np.zeros(wi.size, dtype=bool)
    first[np.unique(wi, return_index=True)[1]] = True
    wait = np.where(first, per_worker[wi] - shortest[inst], 0.0)
    rows = np.flatnonzero(matched)
    if rows.size == 0:
        return WAIT_SCHEMA.empty_table()
    ckeys, ci = np.unique(np.stack([worker[rows], step[rows], fcode[rows]]), axis=1, return_inverse=True)
    ci = ci.reshape(-1)
    return pa.Table.from_arrays(
        [
            pa.array(ckeys[0], pa.int64()),
            pa.array(ckeys[1], pa.int64()),
            pa.array(fnames[ckeys[2]].tolist(), pa.string()),
            pa.array(np.bincount(ci, minlength=ckeys.shape[1]).astype(np.int32)),
            pa.array(np.bincount(ci, weights=wait[rows], minlength=ckeys.shape[1])),
        ],
        schema=WAIT_SCHEMA,
    )


def with_matched_waits(functions: pa.Table, worker: int, step: int, waits: pa.Table) -> pa.Table:
    """The worker's function table for the step with ``wait_us`` set from ``waits`` (:func:`matched_waits`) for the
    functions whose every call was matched; the table itself when none was."""
    if waits.num_rows == 0 or functions.num_rows == 0:
        return functions
    mine = waits.filter(pc.and_(pc.equal(waits.column("worker"), worker), pc.equal(waits.column("step"), step)))
    if mine.num_rows == 0:
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


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = arr.dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), np.asarray(
        enc.dictionary.to_pylist(), dtype=object
    )
