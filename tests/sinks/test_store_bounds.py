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


def test_one_value_larger_than_the_bound_is_refused_inside_duckdb(tmp_path):
    """Before: `SELECT repeat('x', 500000000)` reached Python whole and was refused only then: the sink grew 1.9 GB
    (955 MB now, DuckDB's own string); a list counted 16 bytes, so `list(range)` of millions was answered."""
    store = FindingsStore(tmp_path / "f.duckdb")
    limits = QueryLimits(max_bytes=1 << 20)
    for sql in (
        "SELECT repeat('x', 2000000) AS s",
        "SELECT list(range) FROM range(300000)",  # ~2 MB as text
        "SELECT {'a': repeat('y', 2000000)} AS s",
        "SELECT 1 AS n, repeat('x', 600000)::BLOB AS b, repeat('z', 600000) AS t",  # two columns that add up
    ):
        with pytest.raises(StoreError, match="larger than 1 MiB") as err:
            run_query(store.con, sql, limits=limits)
        assert "lockstep" not in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(StoreError, match="larger than 1 MiB"):  # rows that add up, fetched a few at a time
        run_query(store.con, "SELECT range(1000) AS l FROM range(300)", limits=limits)  # ~5.9 KB a row as text


def test_sized_queries_keep_their_order_names_parameters_and_null_values(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    cols, rows = run_query(store.con, "SELECT range AS a, range * ? AS a FROM range(3000) ORDER BY range DESC", [2])
    assert cols == ["a", "a"] and rows[:2] == [(2999, 5998), (2998, 5996)] and len(rows) == 3000
    assert run_query(store.con, "SELECT NULL AS x, [1, NULL] AS l -- a comment\n ;  ")[1] == [(None, [1, None])]
    assert run_query(store.con, "SELECT $1 AS p", ["v"])[1] == [("v",)]
    assert run_query(store.con, "FROM range(2)")[1] == [(0,), (1,)]
    assert run_query(store.con, "DESCRIBE SELECT 1 AS a")[1][0][:2] == ("a", "INTEGER")
    assert run_query(store.con, "EXPLAIN SELECT 1")[0]  # EXPLAIN: the plan, not sized
    _cols, rows = run_query(store.con, "SELECT 'x' AS s", tenant="acme")
    assert rows == [("x",)]
