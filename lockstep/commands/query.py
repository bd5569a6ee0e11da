"""``lockstep query "SQL"``: read-only SQL on the findings file, also while the sink runs."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("query", help="run read-only SQL on the findings database (works while the sink runs)")
    p.add_argument("sql", help='a SELECT statement, e.g. "SELECT cause, count(*) FROM findings GROUP BY cause"')
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument(
        "--tenant", help="only this tenant's rows exist for the query (tables and views; enforced by the engine)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of rows (objects)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import config
    from ..app.output import print_json, table
    from ..app.progress import wanted
    from .findings import store_runner

    db = args.db or config.load(None).db
    cols, rows = store_runner(db, args.tenant, wanted(args.json))(args.sql)
    if args.json:
        print_json([dict(zip(cols, r)) for r in rows])
    else:
        print(table(cols, rows))
    return 0
