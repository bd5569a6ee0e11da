"""``lockstep test-page``: send a test page through the routes of a routes file, now, and say what each receiver answered."""

from __future__ import annotations

import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "test-page", help="send a test page through each route of a routes file and print what the receivers answered"
    )
    p.add_argument(
        "--routes",
        type=Path,
        required=True,
        help="the routes file the sink would use (secrets from its *_env variables)",
    )
    p.add_argument("--route", action="append", help="only this route (repeatable; default: every route)")
    p.add_argument(
        "--no-resolve",
        action="store_true",
        help="leave the test incident open (default: resolve it right after the trigger)",
    )
    p.add_argument("--json", action="store_true", help="print one object per route and action instead of lines")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.output import print_json, table
    from ..config import ConfigError
    from ..sinks.paging import routes
    from ..sinks.paging.pager import send_test

    paging = routes.load(args.routes)
    chosen = [r for r in paging.routes if not args.route or r.name in args.route]
    unknown = sorted(set(args.route or ()) - {r.name for r in paging.routes})
    if unknown:
        raise ConfigError(
            f"--route: no route named {', '.join(unknown)} in {args.routes} (it has {', '.join(r.name for r in paging.routes)})"
        )
    now = time.time()
    results = []
    for route in chosen:
        incident = f"lockstep-test-{route.name}-{int(now)}"
        for action in ("trigger",) if args.no_resolve else ("trigger", "resolve"):
            resp = send_test(route, paging, action, incident, time.time())
            ok = resp.status is not None and 200 <= resp.status < 300
            results.append(
                {
                    "route": route.name,
                    "receiver": route.receiver,
                    "action": action,
                    "incident": incident,
                    "status": resp.status,
                    "ok": ok,
                    "error": "" if ok else resp.error or f"HTTP {resp.status}",
                }
            )
    if args.json:
        print_json(results)
    else:
        print(
            table(
                ["route", "receiver", "action", "status", "result"],
                [
                    (r["route"], r["receiver"], r["action"], r["status"] or "-", "delivered" if r["ok"] else r["error"])
                    for r in results
                ],
            )
        )
    return 0 if all(r["ok"] for r in results) else 1
