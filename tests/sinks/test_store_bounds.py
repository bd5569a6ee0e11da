"""The store against hostile text and large results: text cut at write, JSON that nests without bound read as text,
results bounded in bytes as well as rows."""

from __future__ import annotations

import msgspec
import pytest

from lockstep.sinks.store import Batch, FindingsStore, QueryLimits, StoreError, jsonable
from lockstep.sinks.store.reads import run_query
from lockstep.sinks.store.writes import MAX_TEXT_CHARS
from tests.sinks.test_store import finding, window


def test_a_forged_function_of_50000_brackets_is_stored_and_read_back_as_text(tmp_path):
    """Before: every /query, `lockstep findings` and `lockstep query` touching it failed with RecursionError."""
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([msgspec.structs.replace(finding(), function="[" * 50_000)], [window()], {}), now=100.0)
    _cols, rows = store.query("SELECT function, evidence FROM findings")
    values = [jsonable(v) for v in rows[0]]
    assert values[0] == "[" * 50_000 and isinstance(values[1], list)


def test_text_longer_than_the_bound_is_cut_at_write(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(
        Batch([msgspec.structs.replace(finding(), function="f" * (MAX_TEXT_CHARS + 5000))], [window()], {}), 1.0
    )
    (n,) = store.con.execute("SELECT length(function) FROM findings").fetchone()
    assert n == MAX_TEXT_CHARS


def test_a_result_is_bounded_in_bytes_not_only_in_rows(tmp_path):
    """Before: `SELECT repeat('x', 30000) || range FROM range(100000)` as a tenant took the sink to 12.6 GB."""
    store = FindingsStore(tmp_path / "f.duckdb")
    limits = QueryLimits(max_bytes=8 << 20)
    with pytest.raises(StoreError, match="larger than 8 MiB"):
        run_query(store.con, "SELECT repeat('x', 30000) || range FROM range(100000)", limits=limits)
    _cols, rows = run_query(store.con, "SELECT repeat('x', 30000) || range FROM range(100)", limits=limits)
    assert len(rows) == 100  # 3 MB: under the bound
    with pytest.raises(StoreError, match="more than 100000 rows"):
        run_query(store.con, "SELECT range FROM range(100001)", limits=limits)
