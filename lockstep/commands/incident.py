"""``lockstep incident ack|resolve ID``: acknowledge or resolve an incident by hand (also while the sink runs)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("incident", help="acknowledge or resolve an incident by hand (through the sink when it runs)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, what in (
        (
            "ack",
            "acknowledge an open incident: it stays open, the routes that paged it are told, no other route pages it",
        ),
        ("resolve", "resolve an open incident: it ends (the routes that paged it are told); seen again, it reopens"),
    ):
        a = actions.add_parser(name, help=what, description=what)
        a.add_argument("id", help="the incident's id (lockstep findings --open, or SELECT id FROM incidents)")
        a.add_argument("--by", default=None, help="who (default: this user's login name)")
        a.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
        a.add_argument("--tenant", help="the incident must be this tenant's")
        a.add_argument("--json", action="store_true", help="print the incident as JSON")
        a.set_defaults(func=run, what="acknowledge" if name == "ack" else "resolve")


def login() -> str:
    """This user's login name; ``uid N`` where it has none (a container's user without a passwd entry)."""
    import getpass
    import os

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def run(args) -> int:
    from .. import config
    from ..app.output import print_json
    from ..sinks.operator import change_incident

    db = args.db or config.load(None).db
    by = (args.by or "").strip() or login()
    inc, changed = change_incident(db, args.what, args.id, by, args.tenant)
    if args.json:
        print_json({"incident": inc, "changed": changed})
        return 0
    if args.what == "acknowledge":
        print(
            f"incident {inc['id']} ({inc['job']}: {inc['cause']}) "
            + (f"acknowledged by {inc['acked_by']}" if changed else f"was already acknowledged by {inc['acked_by']}")
        )
    else:
        print(
            f"incident {inc['id']} ({inc['job']}: {inc['cause']}) "
            + ("resolved" if changed else f"was already resolved ({inc['resolved_reason']}, by {inc['resolved_by']})")
        )
    return 0
