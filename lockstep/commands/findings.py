"""``lockstep findings``: list findings, as a table or as the Finding records (--json)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("findings", help="list findings (table, or --json for the Finding records)")
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--since", help="only findings created since: ISO time (2026-11-29T10:00) or an age (30m, 6h, 2d)")
    from ..schemas.records import CAUSES

    p.add_argument(
        "--cause", choices=list(CAUSES), metavar="CAUSE", help=f"only this cause: one of {', '.join(CAUSES)}"
    )
    p.add_argument("--tenant", help="only this tenant (the query runs on that tenant's rows only)")
    p.add_argument(
        "--open", action="store_true", help="only problems not cleared yet: the latest finding of each open incident"
    )
    p.add_argument("--limit", type=int, default=100, help="most findings listed (default 100)")
    p.add_argument("--json", action="store_true", help="print the Finding records as a JSON list")
    p.add_argument(
        "--windows",
        action="store_true",
        help="list the profiling windows instead, with how each ended (complete, timeout, failed and why; open: "
        "triggered, not reported yet)",
    )
    p.set_defaults(func=run)


def store_runner(db, tenant=None, show_progress: bool = False):
    """``run(sql, params)`` on the findings file (or the running sink), with the tenant rule, and a status
    line on a terminal while a query takes longer than a second."""
    from ..app.progress import Progress
    from ..sinks.http import query

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
    from ..sinks.report.data import fetch_findings

    db = args.db or config.load(None).db
    if args.windows:
        return _windows(args, store_runner(db, args.tenant, wanted(args.json)))
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
        print(findings_table(found, _acknowledged(store_runner(db, args.tenant, False)) if args.open else None))
        note = _unfinished(store_runner(db, args.tenant, False), args)
        if note:
            print(note)
    return 0


def _windows(args, run) -> int:
    import dataclasses

    from ..app.output import print_json, windows_table
    from ..sinks.report.data import fetch_windows

    rows = [dataclasses.asdict(w) for w in fetch_windows(run, args.job, args.since, positive_limit(args.limit))]
    for w in rows:
        w["bytes_per_worker"] = None if w["bytes_per_worker"] != w["bytes_per_worker"] else w["bytes_per_worker"]
    if args.json:
        print_json(rows)
    else:
        print(windows_table(rows))
    return 0


def _acknowledged(run) -> dict[str, str]:
    """Open incidents acknowledged by hand (``lockstep incident ack``): their latest finding's id -> "who, when"."""
    _, rows = run(
        "SELECT f.id, coalesce(i.acked_by, 'someone'), strftime(i.acked_at, '%Y-%m-%d %H:%M') FROM open_findings f "
        "JOIN incidents i ON i.id = f.incident_id WHERE i.acked_at IS NOT NULL"
    )
    return {r[0]: f"{r[1]}, {r[2]} UTC" for r in rows}


def _unfinished(run, args) -> str:
    """A line under the findings when windows of the selection failed or have not reported: a window that found
    nothing because it failed must not read as a healthy job."""
    from ..sinks.report.data import fetch_windows

    rows = fetch_windows(run, args.job, args.since, 1000)
    failed = sum(w.closed == "failed" for w in rows)
    waiting = sum(w.closed == "open" for w in rows)
    if not failed and not waiting:
        return ""
    parts = [f"{failed} window{'s' if failed != 1 else ''} failed"] if failed else []
    parts += [f"{waiting} trigger{'s' if waiting != 1 else ''} not reported yet"] if waiting else []
    return f"\n{' and '.join(parts)}: lockstep findings --windows"
