"""``lockstep jobs``: every job the findings file has seen, costliest first (works while the sink runs)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "jobs",
        help="list the jobs seen: last step, workers, step time, open incidents, findings, cost (works while the sink runs)",
    )
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--tenant", help="only this tenant's jobs (the query runs on that tenant's rows only)")
    p.add_argument("--limit", type=int, default=200, help="most jobs listed (default 200)")
    p.add_argument("--json", action="store_true", help="print a JSON list of jobs (objects)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from .. import config
    from ..app.output import print_json, table
    from ..app.progress import wanted
    from ..sinks.jobs import fetch_jobs
    from ..units import duration_us, number
    from .findings import positive_limit, store_runner

    db = args.db or config.load(None).db
    jobs = fetch_jobs(store_runner(db, args.tenant, wanted(args.json)), args.job, positive_limit(args.limit))
    if args.json:
        print_json([dataclasses.asdict(j) for j in jobs])
        return 0
    if not jobs:
        print("no jobs yet" + (f" named {args.job}" if args.job else ""))
        return 0
    headers = ["job", "tenant", "state", "last step", "workers", "step time", "open incidents", "findings"]
    headers += ["lost now, per day", "lost so far", "last seen (UTC)"]
    rows = [
        [
            j.job,
            j.tenant or "-",
            "ended" if j.ended else "seen",
            number(j.last_step),
            number(j.workers),
            "-" if j.step_time_us is None else duration_us(j.step_time_us),
            j.open_incidents,
            j.findings,
            f"{number(j.gpu_hours_per_day)} {j.hours_unit}-h",
            f"{number(j.gpu_hours_lost)} {j.hours_unit}-h",
            (j.last_seen or "-")[:19],
        ]
        for j in jobs
    ]
    print(table(headers, rows))
    return 0
