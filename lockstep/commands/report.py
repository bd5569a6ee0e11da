"""``lockstep report``: the findings store as one HTML page with pictures (see :mod:`lockstep.sinks.report.page`).

``--live-url`` prints instead the address of the running sink's live page, with its token (read from
the sink's address file, which only the database file's owner can read).
"""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write an HTML page with pictures of the findings, their evidence, the jobs' step times and the windows",
    )
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("lockstep-report.html"),
        help="the page to write (default lockstep-report.html)",
    )
    p.add_argument("--job", help="only this job")
    p.add_argument("--since", help="only findings and windows since: ISO time or an age (30m, 6h, 2d)")
    p.add_argument("--tenant", help="only this tenant (the queries run on that tenant's rows only)")
    p.add_argument(
        "--open", action="store_true", help="only problems not cleared yet: the latest finding of each open incident"
    )
    p.add_argument("--limit", type=int, default=50, help="most findings and windows shown (default 50)")
    p.add_argument(
        "--live-url",
        action="store_true",
        help="print the running sink's live page address (with its token) instead of writing a page",
    )
    p.add_argument(
        "--json", action="store_true", help='print {"out", "findings", "windows"} (or {"url"}) instead of a sentence'
    )
    p.set_defaults(func=run)


def live_url(db: Path, tenant: str | None = None, job: str | None = None) -> str:
    """The live page of the sink that holds ``db``, with the token from its address file."""
    from urllib.parse import urlencode

    from ..sinks.http import sidecar
    from ..sinks.store import StoreError

    side = sidecar(db)
    try:
        announced = json.loads(side.read_text())
        url, token = announced["url"], announced["token"]
    except FileNotFoundError:
        raise StoreError(
            f"no sink is running on {db} ({side} does not exist); start `lockstep sink --db {db}`"
        ) from None
    except PermissionError:
        raise StoreError(
            f"{side} is not readable by this user: the live page is for the database file's owner"
        ) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise StoreError(f"{side} is not a sink's address file") from None
    query = {"token": token, **({"tenant": tenant} if tenant else {}), **({"job": job} if job else {})}
    return f"{url}/?{urlencode(query)}"


def run(args) -> int:
    from .. import config
    from ..app.output import plural, print_json
    from ..app.progress import wanted
    from ..sinks.report.data import gather
    from ..sinks.report.page import render
    from .findings import positive_limit, store_runner

    db = args.db or config.load(None).db
    if args.live_url:
        url = live_url(db, args.tenant, args.job)
        print_json({"url": url}) if args.json else print(url)
        return 0
    data = gather(
        store_runner(db, args.tenant, wanted(args.json)), args.job, args.since, args.open, positive_limit(args.limit)
    )
    scope = ", ".join(
        x
        for x in (
            f"job {args.job}" if args.job else "",
            f"tenant {args.tenant}" if args.tenant else "",
            f"since {args.since}" if args.since else "",
            "open problems" if args.open else "",
        )
        if x
    )
    page = render(data, title=f"Lockstep report: {Path(db).name}", scope=scope)
    try:
        args.out.write_text(page)
    except OSError as exc:
        raise config.ConfigError(f"--out: cannot write {args.out}: {exc.strerror}") from None
    if args.json:
        print_json({"out": str(args.out), "findings": len(data.findings), "windows": len(data.windows)})
    else:
        print(
            f"wrote {args.out}: {plural(len(data.findings), 'finding')}, {plural(len(data.windows), 'window')}; open it in a browser"
        )
    return 0
