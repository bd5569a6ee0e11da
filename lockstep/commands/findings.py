"""``lockstep findings``: list findings, as a table or as the Finding records (--json)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("findings", help="list findings (table, or --json for the Finding records)")
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--since", help="only findings created since: ISO time (2026-11-29T10:00) or an age (30m, 6h, 2d)")
    p.add_argument("--cause", help="only this cause")
    p.add_argument("--tenant", help="only this tenant (the query runs on that tenant's rows only)")
    p.add_argument(
        "--open", action="store_true", help="only problems not cleared yet: the latest finding of each open incident"
    )
    p.add_argument("--limit", type=int, default=100, help="most findings listed (default 100)")
    p.add_argument("--json", action="store_true", help="print the Finding records as a JSON list")
    p.set_defaults(func=run)


def store_runner(db, tenant=None, show_progress: bool = False):
    """``run(sql, params)`` on the findings file (or the running sink), with the tenant rule, and a status
    line on a terminal while a query takes longer than a second."""
    from ..app.progress import Progress
    from ..sinks.sink import query

    def run(sql: str, params: list | None = None):
        with Progress(show_progress, "querying", delay_s=1.0):
            return query(db, sql, params, tenant=tenant)

    return run


def positive_limit(limit: int) -> int:
    from ..config import ConfigError

    if limit < 1:
        raise ConfigError(f"--limit: {limit} must be at least 1")
    return limit


def run(args) -> int:
    from .. import config
    from ..app.output import findings_table, print_json
    from ..app.progress import wanted
    from ..sinks.reportdata import fetch_findings

    db = args.db or config.load(None).db
    found = fetch_findings(
        store_runner(db, args.tenant, wanted(args.json)),
        args.job,
        args.since,
        args.cause,
        positive_limit(args.limit),
        args.open,
    )
    if args.json:
        print_json(found)
    else:
        print(findings_table(found))
    return 0
