"""``lockstep processor``: the faust stream processor (detector, step and window stages)."""

from __future__ import annotations

from .. import config


def register(sub) -> None:
    p = sub.add_parser("processor", help="run the stream processor (faust worker: detector, step and window stages)")
    config.add_arguments(p)
    p.add_argument("--http-port", type=int, default=6066, help="port of /healthz and /metrics (default 6066)")
    p.add_argument("--http-host", default="127.0.0.1", help="address to serve them on (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--roles", default="detect,steps,windows", help="comma-separated agents to run (default: all)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..cli import setup_logging
    from ..kafka import ensure_topics
    from ..runtime import kafka
    from ..streams.app import build_app, changelog_topics, run_worker
    from ..streams.policy import load_policy

    settings = config.load(args)
    setup_logging(settings.log_level)
    policy = load_policy(settings.policy)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    unknown = set(roles) - {"detect", "steps", "windows"}
    if unknown:
        raise config.ConfigError(f"--roles: unknown role(s) {sorted(unknown)}; known: detect, steps, windows")
    with kafka(settings) as s:
        ensure_topics(s, extra={name: s.partitions for name in changelog_topics(s.processor_id)})
        app, _ = build_app(s, policy, http_port=args.http_port, http_host=args.http_host, roles=roles)
        run_worker(app, s.log_level)
    return 0
