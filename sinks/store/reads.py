"""Reading the findings file: someone's SQL, checked and bounded (statement, relations, time, rows, memory,
tenant sandbox), and the errors of the store."""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from ...schemas.errors import LockstepError
from .writes import registered

log = logging.getLogger("lockstep.sinks.store")


class StoreError(LockstepError, RuntimeError):
    """The findings file cannot be opened or a query is not allowed."""


class StoreLocked(StoreError):
    """Another process (the running sink) holds the DuckDB file."""


class QueryBusy(StoreError):
    """As many queries as the sink allows at once are running; ask again in a moment."""


def one(row: tuple[Any, ...] | None, what: str) -> tuple[Any, ...]:
    """The row of a query that always returns one (an aggregate, a row the migrations insert)."""
    if row is None:
        raise StoreError(f"{what}: the store has no row for it; is the file a findings store written by this version?")
    return row


@dataclass(frozen=True)
class QueryLimits:
    """What one query may use.  ``memory_bytes`` and ``threads`` bound each DuckDB instance that runs someone's
    SQL: the sink's own (its writer and at most ``concurrent`` queries share it), each tenant sandbox, and the
    read-only connection of a command that opens the file itself."""

    timeout_s: float = 20.0  # then the query is interrupted (lockstep query waits 30 s for the sink's answer)
    max_rows: int = 100_000  # a larger result is refused: add a LIMIT or aggregate
    max_bytes: int = 64 << 20  # so is one whose text and blobs add up to more (estimated while it is fetched)
    memory_bytes: int = 1 << 30  # DuckDB's memory_limit; no spilling to disk (max_temp_directory_size 0)
    threads: int = 2
    concurrent: int = 2  # queries at once through the sink; more are refused (QueryBusy)


QUERY_LIMITS = QueryLimits()


def duckdb_config(limits: QueryLimits = QUERY_LIMITS) -> dict:
    """Settings of every DuckDB instance that runs someone's SQL, locked once it is open: no files but its
    own, no network, no extensions, no Python objects by name, bounded memory and threads."""
    return {
        "enable_external_access": False,
        "autoload_known_extensions": False,
        "autoinstall_known_extensions": False,
        "allow_community_extensions": False,
        "python_enable_replacements": False,
        "memory_limit": f"{limits.memory_bytes}B",
        "max_temp_directory_size": "0B",
        "threads": limits.threads,
        "lock_configuration": True,
    }


#: statements someone's SQL may be (DuckDB's parser says which): a query, or EXPLAIN of one
ALLOWED_STATEMENTS = ("SELECT", "EXPLAIN")
_EXPLAIN = re.compile(r"\s*EXPLAIN\s*(?:\([^)]*\)\s*)?(?:ANALY[SZ]E\b)?", re.IGNORECASE)


#: table functions a query may call: generators and the catalog.  Every other one is refused: the file readers
#: (``read_blob``, ``read_csv``, ``glob``, ...) would reach the sink's own database file, which DuckDB lets them
#: read even without external access, and the sink closing a handle of it would drop its lock on the file
#: (POSIX locks belong to the process); ``query()`` runs SQL that cannot be checked here.
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "json_each",
        "json_tree",
        "duckdb_tables",
        "duckdb_views",
        "duckdb_columns",
        "duckdb_constraints",
        "duckdb_indexes",
        "duckdb_schemas",
        "duckdb_databases",
        "duckdb_types",
        "duckdb_functions",
        "duckdb_keywords",
        "pragma_table_info",
    }
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_relations(con: duckdb.DuckDBPyConnection, select: str) -> None:
    """Every relation a SELECT reads (DuckDB's own parse tree) is a table, view or CTE by name, or an allowed
    table function; a quoted name with a dot or a slash would be a file (``FROM 'x.duckdb'``)."""
    try:
        tree = json.loads(
            one(con.execute("SELECT json_serialize_sql(?::VARCHAR)", [select]).fetchone(), "the parse tree")[0]
        )
    except (duckdb.Error, RecursionError, ValueError) as exc:
        raise StoreError(f"the query cannot be checked ({type(exc).__name__}); simplify it") from None
    if tree.get("error"):
        raise StoreError(f"the query cannot be checked: {tree.get('error_message', 'not a plain SELECT')}")
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "TABLE_FUNCTION":
            name = str((node.get("function") or {}).get("function_name", ""))
            if name.lower() not in TABLE_FUNCTIONS:
                raise StoreError(
                    f"table function {name}() is disabled in queries (reading files, running SQL from text); "
                    f"allowed: {', '.join(sorted(TABLE_FUNCTIONS))}"
                )
        elif kind == "BASE_TABLE" and not _IDENTIFIER.fullmatch(str(node.get("table_name", ""))):
            raise StoreError(
                f"{str(node.get('table_name'))[:80]!r} is not a table name (reading files is disabled in queries)"
            )
        stack.extend(node.values())


def _statements(con: duckdb.DuckDBPyConnection, sql: str) -> list:
    try:
        return con.extract_statements(sql)
    except duckdb.Error as exc:
        raise StoreError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None


def _kind(statement) -> str:
    return str(statement.type).split(".")[-1]


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """Allow exactly one statement, a SELECT (``WITH``, ``FROM``-first, ``VALUES``, ``DESCRIBE``, ``SUMMARIZE`` are
    SELECTs to DuckDB) or EXPLAIN of a SELECT, ANALYZE or not: ``EXPLAIN ANALYZE`` runs its statement, so what
    it explains must be a query too.  Everything else is refused (PRAGMA, SET, ATTACH, COPY, INSTALL, LOAD, CALL, ...),
    and so is a SELECT that reads anything but tables, views and :data:`TABLE_FUNCTIONS`.  Returns the statement's
    kind (``SELECT`` or ``EXPLAIN``)."""
    statements = _statements(con, sql)
    if not statements:
        raise StoreError("no SQL statement given")
    if len(statements) > 1:
        raise StoreError(f"one read-only statement at a time, got {len(statements)}")
    kind = _kind(statements[0])
    if kind not in ALLOWED_STATEMENTS:
        raise StoreError(f"only read-only queries are allowed (SELECT, EXPLAIN SELECT); got {kind}")
    select = statements[0].query
    if kind == "EXPLAIN":
        explain = _EXPLAIN.match(select)
        try:
            inner = _statements(con, select[explain.end() :]) if explain else []
        except StoreError:  # what follows EXPLAIN [(options)] [ANALYZE] is no statement on its own
            inner = []
        if len(inner) != 1 or _kind(inner[0]) != "SELECT":
            raise StoreError("EXPLAIN only of a SELECT (EXPLAIN ANALYZE runs the statement it explains)")
        select = inner[0].query
    _check_relations(con, select)
    return kind


def tenant_sandbox(
    src: duckdb.DuckDBPyConnection, tenant: str, limits: QueryLimits = QUERY_LIMITS
) -> duckdb.DuckDBPyConnection:
    """A new in-memory database holding only ``tenant``'s rows, locked down before any user SQL runs.

    Every table with a ``tenant`` column is copied with its own DDL and only that tenant's rows; tables
    without one (offsets, migrations, the pager's cursor) are left out; the views are recreated from the
    file's own definitions.  The instance has no file or network access, no extensions, no Python
    replacement scans, the memory and threads of ``limits``, and its configuration locked.  Rows of other
    tenants are not in this database, so no SQL run in it (``query()``, ``duckdb_tables()``, subqueries) can reach them.
    """
    box = duckdb.connect(":memory:", config=duckdb_config(limits))
    here = "table_catalog = current_database() AND table_schema = 'main'"
    tenanted = {
        r[0]
        for r in src.execute(
            f"SELECT table_name FROM information_schema.columns WHERE {here} AND column_name = 'tenant'"
        ).fetchall()
    }
    tables = src.execute(
        "SELECT table_name, sql FROM duckdb_tables() WHERE database_name = current_database() AND schema_name = 'main'"
    ).fetchall()
    for name, ddl in (t for t in tables if t[0] in tenanted):
        box.execute(ddl)
        with registered(
            box, "_rows", src.sql(f'SELECT * FROM "{name}" WHERE tenant = $1', params=[tenant]).to_arrow_table()
        ):
            box.execute(f'INSERT INTO "{name}" SELECT * FROM _rows')
    views = src.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND database_name = current_database() AND schema_name = 'main'"
    ).fetchall()
    for name, ddl in views:
        try:
            box.execute(ddl)
        except duckdb.CatalogException:  # it reads a table that tenants do not see
            log.debug("view %s left out of the tenant sandbox", name)
    return box


class _Deadline:
    """Interrupts the connection a query runs on once ``timeout_s`` have passed (DuckDB stops at its next vector)."""

    def __init__(self, timeout_s: float):
        self.fired = False
        self._con: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            self._con = con
            if self.fired:
                con.interrupt()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            if self._con is not None:
                self._con.interrupt()

    def cancel(self) -> None:
        self._timer.cancel()


def run_query(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params: list | None = None,
    tenant: str | None = None,
    limits: QueryLimits = QUERY_LIMITS,
) -> tuple[list[str], list[tuple]]:
    """Someone's SQL, read-only: one allowed statement (:func:`check_read_only`) in a read-only transaction of
    ``con``; with ``tenant``, inside :func:`tenant_sandbox` (only that tenant's rows exist there).  Interrupted
    after ``limits.timeout_s``; a result of more than ``limits.max_rows`` rows is refused.  Raises StoreError."""
    kind = check_read_only(con, sql)
    deadline = _Deadline(limits.timeout_s)
    box = None
    try:
        deadline.watch(con)
        con.execute("BEGIN TRANSACTION READ ONLY")
        try:
            if tenant is not None:
                box = tenant_sandbox(con, tenant, limits)
                deadline.watch(box)
            target = box if box is not None else con
            if kind == "SELECT":  # each row's size computed and bounded by DuckDB, before Python sees a value
                cols, rows = _fetch_sized(target, sql, params, limits)
            else:  # EXPLAIN: a plan's text
                cur = target.execute(sql, params or [])
                cols = [d[0] for d in cur.description] if cur.description else []
                rows = _fetch(cur, limits)
        finally:
            con.execute("ROLLBACK")
    except duckdb.InterruptException:
        if not deadline.fired:
            raise StoreError("the query was interrupted (the sink is stopping)") from None
        raise StoreError(f"the query ran longer than {limits.timeout_s:g} s, the most a query may take") from None
    except duckdb.OutOfMemoryException:
        raise StoreError(
            f"the query needs more than {limits.memory_bytes >> 20} MiB, the most a query may use"
        ) from None
    except duckdb.Error as exc:
        message = str(exc).splitlines()[0]
        if _TOO_LARGE in message:  # our own error() in the size check
            raise StoreError(_too_large(limits)) from None
        raise StoreError(message) from None
    finally:
        deadline.cancel()
        if box is not None:
            box.close()
    if len(rows) > limits.max_rows:
        raise StoreError(
            f"the result has more than {limits.max_rows} rows, the most a query may return: add a LIMIT or aggregate"
        )
    return cols, rows


_FETCH_ROWS = 2048
#: what one fetch of a sized result may hold: the rows of the next fetch are as many as fit, judged by the largest
#: row so far (from 16 rows at first up to _FETCH_ROWS)
_FETCH_BYTES = 8 << 20
_FIRST_FETCH_ROWS = 16
_TOO_LARGE = "lockstep: a row of the result is larger than the bound"
#: DuckDB types whose values are a few bytes each (counted 16); text and blobs count their length, anything else
#: (lists, structs, maps, arrays, unions, enums, JSON) the length of its text
_FIXED_SIZE = frozenset(
    [
        "boolean",
        "tinyint",
        "smallint",
        "integer",
        "bigint",
        "hugeint",
        "utinyint",
        "usmallint",
        "uinteger",
        "ubigint",
        "uhugeint",
        "float",
        "double",
        "decimal",
        "date",
        "time",
        "time_tz",
        "timestamp",
        "timestamp_s",
        "timestamp_ms",
        "timestamp_ns",
        "timestamp_tz",
        "interval",
        "uuid",
    ]
) | {"timestamp with time zone", "time with time zone"}


def _too_large(limits: QueryLimits) -> str:
    return (
        f"the result is larger than {limits.max_bytes >> 20} MiB, the most a query may return: "
        "select fewer columns, add a LIMIT or aggregate"
    )


def _row_bytes(types: list[duckdb.sqltypes.DuckDBPyType]) -> str:
    """A DuckDB expression: the bytes of a row of these columns (by position, whatever their names)."""
    parts = []
    for i, t in enumerate(types, start=1):
        if t.id in _FIXED_SIZE:
            parts.append("16")
        elif t.id == "blob":
            parts.append(f"coalesce(octet_length(#{i}), 0)")
        elif t.id == "varchar":
            parts.append(f"coalesce(strlen(#{i}), 0)")
        else:
            parts.append(f"coalesce(strlen(CAST(#{i} AS VARCHAR)), 0)")
    return " + ".join(parts) or "0"


def _fetch_sized(
    con: duckdb.DuckDBPyConnection, sql: str, params: list | None, limits: QueryLimits
) -> tuple[list[str], list[tuple]]:
    """A SELECT's columns and rows, each row's size computed by DuckDB beside it (the query wrapped: ``SELECT *,
    <size> FROM (<sql>)``): a row larger than ``max_bytes`` is refused inside DuckDB (one value of 500 MB never
    reaches Python, where it took +1.9 GB), the rows are counted by those sizes (lists and structs too: they counted
    16 bytes each), and each fetch takes as many rows as fit in :data:`_FETCH_BYTES` judged by the largest so far, so
    that rows of 400 KB are refused after a few fetches of a few MiB, not in one of 2,048 rows (800 MB)."""
    sql = sql.rstrip()
    while sql.endswith(";"):
        sql = sql[:-1].rstrip()
    rel = con.sql(sql, params=params or None)  # bound, not run: the columns and their types
    cols, size = list(rel.columns), _row_bytes(rel.types)
    cur = con.execute(
        f"SELECT *, CASE WHEN ({size}) > {limits.max_bytes} THEN error('{_TOO_LARGE}') ELSE ({size}) END "
        f"FROM (\n{sql}\n) AS lockstep_query",
        params or [],
    )
    rows: list[tuple] = []
    total, largest, n = 0, 1, _FIRST_FETCH_ROWS
    while len(rows) <= limits.max_rows:
        chunk = cur.fetchmany(min(n, limits.max_rows + 1 - len(rows)))
        if not chunk:
            break
        for row in chunk:
            total += row[-1]
            largest = max(largest, row[-1])
        if total > limits.max_bytes:
            raise StoreError(_too_large(limits))
        rows.extend(row[:-1] for row in chunk)
        n = max(1, min(_FETCH_ROWS, _FETCH_BYTES // largest))
    return cols, rows


def _fetch(cur: duckdb.DuckDBPyConnection, limits: QueryLimits) -> list[tuple]:
    """The result's rows, fetched a chunk at a time: at most ``max_rows`` + 1 of them, and refused as soon as their
    size passes ``max_bytes`` (text and blobs by length, anything else 16 bytes), before the rest is fetched."""
    rows: list[tuple] = []
    size = 0
    while len(rows) <= limits.max_rows:
        chunk = cur.fetchmany(min(_FETCH_ROWS, limits.max_rows + 1 - len(rows)))
        if not chunk:
            break
        size += sum(len(v) if isinstance(v, (str, bytes)) else 16 for row in chunk for v in row)
        if size > limits.max_bytes:
            raise StoreError(
                f"the result is larger than {limits.max_bytes >> 20} MiB, the most a query may return: "
                "select fewer columns, add a LIMIT or aggregate"
            )
        rows.extend(chunk)
    return rows


def open_read_only(path: Path | str, limits: QueryLimits = QUERY_LIMITS) -> duckdb.DuckDBPyConnection:
    """The findings file, read-only, locked down (:func:`duckdb_config`): for commands that query it while no sink runs."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path} does not exist (run the demo or a sink first)")
    try:
        con = duckdb.connect(str(path), read_only=True, config=duckdb_config(limits))
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise StoreLocked(f"{path} is held by a running sink") from None
        raise StoreError(f"cannot open {path}: {exc}") from None
    found = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() AND schema_name = 'main' "
        "AND table_name = 'findings'"
    ).fetchone()
    if not (found and found[0]):
        con.close()
        raise StoreError(
            f"{path} is a DuckDB file but not a Lockstep findings store (no findings table): give the --db of "
            "`lockstep sink` or of the demo"
        )
    return con


def jsonable(value):
    """DuckDB values -> JSON-able values (timestamps as ISO strings, JSON columns parsed)."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than a parser's stack (50,000 '[')
            return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
