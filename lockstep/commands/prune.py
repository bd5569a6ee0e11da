"""``lockstep prune --older-than 30d``: delete old rows from the findings file (also while the sink runs)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "prune",
        help="delete findings, windows, series and resolved incidents older than an age (through the sink when it runs)",
        description="Delete findings, windows, triggers, heatmaps, step series, the detector's news, resolved "
        "incidents with their events, and finished page deliveries older than --older-than. Open incidents keep "
        "what they need; the Kafka offsets stay. When a sink holds the file the sink does it (its HTTP port, the "
        "token beside the file); otherwise this command opens the file. The sink's `retention` setting does the "
        "same hourly. DuckDB reuses the space; the file does not shrink.",
    )
    p.add_argument(
        "--older-than", required=True, metavar="AGE", help="age bound: 30d, 12h, 90m, or a number of seconds"
    )
    p.add_argument("--db", type=Path, default=None, help="DuckDB file (default: settings db, lockstep.duckdb)")
    p.add_argument("--json", action="store_true", help="print the rows deleted per table as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import config
    from ..app.output import print_json, table
    from ..sinks.operator import prune

    try:
        age = config.age_s(args.older_than)
    except ValueError as exc:
        raise config.ConfigError(f"--older-than: {exc}") from None
    db = args.db or config.load(None).db
    pruned = prune(db, age)
    if args.json:
        print_json(pruned)
    else:
        print(table(["table", "rows deleted"], sorted(pruned.items())))
        print(f"{sum(pruned.values())} row(s) older than {args.older_than} deleted from {db}")
    return 0
