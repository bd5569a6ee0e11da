"""``lockstep report``: the findings store as one HTML page with pictures (see :mod:`lockstep.sinks.report`)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("report", help="write an HTML page with pictures of the findings, their evidence and the windows")
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--out", type=Path, default=Path("lockstep-report.html"), help="the page to write (default lockstep-report.html)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--since", help="only findings and windows since: ISO time or an age (30m, 6h, 2d)")
    p.add_argument("--tenant", help="only this tenant (the queries run on that tenant's rows only)")
    p.add_argument("--open", action="store_true", help="only problems not cleared yet: the latest finding of each open incident")
    p.add_argument("--limit", type=int, default=50, help="most findings and windows shown (default 50)")
    p.add_argument("--json", action="store_true", help='print {"out", "findings", "windows"} instead of a sentence')
    p.set_defaults(func=run)


def gather(db, job=None, since=None, tenant=None, open_only=False, limit=50):
    """(findings, windows, causes) for the report, read through :func:`lockstep.sinks.sink.query`."""
    import msgspec

    from ..schemas.records import Finding
    from ..sinks.report import CauseRow, WindowRow
    from ..sinks.sink import query
    from .findings import fetch, where

    findings = [msgspec.convert(r, Finding) for r in fetch(db, job, since, None, limit, tenant, open_only)]
    cond, params = where(job, since, time_column="closed_at")
    _, rows = query(db, "SELECT job, window_id, start_step, steps, coverage, findings, closed, CAST(closed_at AS VARCHAR) FROM windows"
                    f"{cond} ORDER BY closed_at DESC LIMIT {int(limit)}", params, tenant=tenant)  # fmt: skip
    windows = [WindowRow(*r) for r in rows]
    # the gpu_hours_lost_by_cause view's figures, for the selected job only when one is selected
    _, rows = query(db, """
        SELECT cause, count(*), count(*) FILTER (WHERE status = 'open'),
               coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0),
               coalesce(sum(gpu_hours_per_day * epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at) / 86400), 0)
        FROM incidents""" + (" WHERE job = ?" if job else "") + " GROUP BY cause ORDER BY 5 DESC", [job] if job else [], tenant=tenant)  # fmt: skip
    causes = [CauseRow(*r) for r in rows]
    return findings, windows, causes


def run(args) -> int:
    from .. import config
    from ..output import print_json
    from ..sinks.report import render

    db = args.db or config.load(None).db
    findings, windows, causes = gather(db, args.job, args.since, args.tenant, args.open, args.limit)
    scope = ", ".join(x for x in (f"job {args.job}" if args.job else "", f"tenant {args.tenant}" if args.tenant else "",
                                  f"since {args.since}" if args.since else "", "open problems" if args.open else "") if x)  # fmt: skip
    page = render(findings, windows, causes, title=f"Lockstep report: {Path(db).name}", scope=scope)
    try:
        args.out.write_text(page)
    except OSError as exc:
        raise config.ConfigError(f"--out: cannot write {args.out}: {exc.strerror}") from None
    if args.json:
        print_json({"out": str(args.out), "findings": len(findings), "windows": len(windows)})
    else:
        print(f"wrote {args.out}: {len(findings)} finding(s), {len(windows)} window(s); open it in a browser")
    return 0

