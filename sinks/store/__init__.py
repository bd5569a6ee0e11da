"""The DuckDB findings store: versioned migrations, idempotent upserts, offsets in the same transaction.

One process (the sink) holds the file read-write.  Rows and the Kafka offsets
that produced them commit together, so after a crash the sink resumes exactly
where its last transaction ended: nothing lost, nothing twice.  The same
transaction keeps the incidents (:mod:`..paging.incidents`) and appends their events,
which the pager (:mod:`..paging.pager`) turns into pages.

SQL names follow the records, except where SQL reserves the word:
``Finding.window`` is the column ``window_id`` and ``Finding.group`` is ``peer_group``.
The tables and views are listed in docs/store.md ("Tables and views").

The package: :mod:`.migrations` (the schema), :mod:`.writes` (records as rows, upserts, transactions),
:mod:`.reads` (someone's SQL, checked and bounded; the store's errors) and :class:`FindingsStore`
(:mod:`.findings`), the sink's read-write handle that uses them.
"""

from .findings import FindingsStore
from .migrations import MIGRATIONS
from .reads import (
    ALLOWED_STATEMENTS,
    QUERY_LIMITS,
    TABLE_FUNCTIONS,
    QueryBusy,
    QueryLimits,
    StoreError,
    StoreLocked,
    check_read_only,
    duckdb_config,
    jsonable,
    one,
    open_read_only,
    run_query,
    tenant_sandbox,
)
from .writes import Batch, epoch_us, findings_table, registered, transaction, triggers_table, upsert, windows_table

__all__ = [
    "ALLOWED_STATEMENTS",
    "MIGRATIONS",
    "QUERY_LIMITS",
    "TABLE_FUNCTIONS",
    "Batch",
    "FindingsStore",
    "QueryBusy",
    "QueryLimits",
    "StoreError",
    "StoreLocked",
    "check_read_only",
    "duckdb_config",
    "epoch_us",
    "findings_table",
    "jsonable",
    "one",
    "open_read_only",
    "registered",
    "run_query",
    "tenant_sandbox",
    "transaction",
    "triggers_table",
    "upsert",
    "windows_table",
]
