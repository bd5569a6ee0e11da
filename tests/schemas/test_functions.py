"""The function table's many-records check (``ft.bad_owners``) on compact tables, as the shard and step stages call it:
names dictionary-encoded, several records' rows concatenated, each record's rows in parts (a window table's steps, a
slice's workers)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.schemas import functions as ft
from tests.tiers import examples

FUNCTIONS = ["fwd.gemm", "bwd.gemm", "nccl:all_reduce[dp]", "loader.next"]
KINDS = ["compute", "compute", "collective", "dataloader"]


def record(parts: int) -> pa.Table:
    """One record's compact rows: ``parts`` parts (steps, workers) of the four functions each."""
    n = parts * len(FUNCTIONS)
    return ft.complete(
        pa.table(
            {
                "function": pa.array(FUNCTIONS * parts).dictionary_encode(),
                "kind": pa.array(KINDS * parts).dictionary_encode(),
                "resource": pa.array([ft.default_resource(k) for k in KINDS] * parts).dictionary_encode(),
                "calls": pa.array(np.full(n, 2, dtype=np.int32)),
                "total_us": pa.array(np.full(n, 100.0, dtype=np.float32)),
                "critical_us": pa.array(np.full(n, 90.0, dtype=np.float32)),
                "wait_us": pa.array(np.full(n, np.nan, dtype=np.float32)),
            }
        )
    )


def spoil(t: pa.Table, column: str, row: int, v) -> pa.Table:
    typ = t.schema.field(column).type
    col = t.column(column).to_pylist()
    col[row] = v
    arr = (
        pa.array(col, type=pa.string()).dictionary_encode() if pa.types.is_dictionary(typ) else pa.array(col, type=typ)
    )
    return t.set_column(t.column_names.index(column), column, arr)


@settings(max_examples=examples(80), deadline=None)
@given(
    spoilt=st.lists(
        st.tuples(
            st.integers(0, 5),
            st.sampled_from(["total_us", "critical_us", "wait_us", "calls", "kind", "resource", "function"]),
            st.integers(0, 11),
            st.sampled_from([-1.0, math.inf, math.nan, None, "quantum", "fwd.gemm", 7]),
        ),
        max_size=4,
    ),
    shuffled=st.booleans(),
)
def test_the_many_records_check_refuses_exactly_the_records_a_part_by_part_check_refuses(spoilt, shuffled):
    """Six records of three parts each (a function once per part), some spoilt: absurd values, unknown kinds, a name
    twice in a part.  Rows in record order (the stages' case, counted without a sort) or shuffled (sorted)."""
    tables = [record(3) for _ in range(6)]
    for i, column, row, v in spoilt:
        try:
            tables[i] = spoil(tables[i], column, row, v)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            continue
    t = ft.concat(tables)
    owner = np.repeat(np.arange(6), 12)
    part = np.tile(np.repeat(np.arange(3), 4), 6)
    if shuffled:
        order = np.random.default_rng(len(spoilt)).permutation(t.num_rows)
        t, owner, part = t.take(pa.array(order)), owner[order], part[order]
    got = ft.bad_owners(t, owner, 6, part=part)
    for i in range(6):
        mine = owner == i
        want = ft.refusal(t.filter(pa.array(mine)), part[mine]) is not None
        assert got[i] == want, (i, spoilt)


def test_a_dictionary_column_is_checked_by_its_entries_and_its_nulls():
    t = ft.concat([record(1), spoil(record(1), "kind", 2, None), spoil(record(1), "resource", 0, "gpu!")])
    assert ft.bad_owners(t, np.repeat(np.arange(3), 4), 3).tolist() == [False, True, True]


def test_an_lz4_payload_reads_only_to_the_size_its_record_declares():
    """The shard stage's slices carry their rows as one LZ4 block; the reader allocates the declared size, bounded."""
    t = record(2)
    packed, size = ft.pack_lz4(t)
    assert ft.pack(ft.read_compact(packed, "lz4", window=False, size=size), "none") == ft.pack(
        t, "none"
    )  # NaN != NaN for equals
    for bad_size, why in ((0, "declared size"), (ft.MAX_TABLE_BYTES + 1, "declared size"), (size - 1, "unreadable")):
        try:
            ft.read_compact(packed, "lz4", window=False, size=bad_size)
        except ft.RecordError as err:
            assert err.reason == "bad_function_table" and why in err.detail, err.detail
        else:
            raise AssertionError(f"size {bad_size} was read")
    try:
        ft.read_compact(b"\x1f" + bytes(200), "lz4", window=False, size=4096)
    except ft.RecordError as err:
        assert err.reason == "bad_function_table"
    else:
        raise AssertionError("garbage was read")
