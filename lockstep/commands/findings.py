"""``lockstep findings``: list findings, as a table or as the Finding records (--json)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("findings", help="list findings (table, or --json for the Finding records)")
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--since", help="only findings created since: ISO time (2026-11-29T10:00) or an age (30m, 6h, 2d)")
    p.add_argument("--cause", help="only this cause")
    p.add_argument("--tenant", help="only this tenant (the query runs on that tenant's rows only)")
    p.add_argument("--open", action="store_true", help="only problems not cleared yet: the latest finding of each open incident")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print the Finding records as a JSON list")
    p.set_defaults(func=run)


def parse_since(value: str) -> dt.datetime:
    from ..config import ConfigError

    m = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if m:
        secs = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) - dt.timedelta(seconds=secs)
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--since: {value!r} is neither an ISO time nor an age like 30m, 6h, 2d") from None
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def where(job=None, since=None, cause=None, time_column="created_at") -> tuple[str, list]:
    """The `` WHERE ...`` clause (or "") and its parameters for the --job, --since and --cause selections."""
    conds, params = [], []
    for cond, value in (("job = ?", job), ("cause = ?", cause), (f"{time_column} >= ?", parse_since(since).isoformat() if since else None)):
        if value:
            conds.append(cond)
            params.append(value)
    return (f" WHERE {' AND '.join(conds)}" if conds else ""), params


def fetch(db, job=None, since=None, cause=None, limit=100, tenant=None, open_only=False) -> list[dict]:
    from ..sinks.sink import query

    cond, params = where(job, since, cause)
    sql = f"SELECT record FROM {'open_findings' if open_only else 'findings'}{cond}"
    sql += f" ORDER BY step_time_share DESC, created_at DESC LIMIT {int(limit)}"
    _, rows = query(db, sql, params, tenant=tenant)
    return [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in rows]


def run(args) -> int:
    from .. import config
    from ..output import findings_table, print_json

    db = args.db or config.load(None).db
    found = fetch(db, args.job, args.since, args.cause, args.limit, args.tenant, args.open)
    if args.json:
        print_json(found)
    else:
        print(findings_table(found))
    return 0
