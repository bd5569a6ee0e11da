"""``lockstep processor``: the faust stream processor (detector, step and window stages)."""

from __future__ import annotations

import logging

from .. import config

log = logging.getLogger("lockstep.processor")


def register(sub) -> None:
    p = sub.add_parser(
        "processor", help="run the stream processor (faust worker: detector, shard, step and window stages)"
    )
    p.add_argument("--http-port", type=int, default=6066, help="port of /healthz and /metrics (default 6066)")
    p.add_argument(
        "--http-host", default="127.0.0.1", help="address to serve them on (default 127.0.0.1; 0.0.0.0 in containers)"
    )
    p.add_argument(
        "--roles",
        default="heartbeats,detect,shards,steps,windows,hangs",
        help="comma-separated agents to run (default: all)",
    )
    config.add_arguments(p, command="processor")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..broker import kafka_or_embedded
    from ..kafka import check_reachable, ensure_topics
    from ..logs import setup_logging
    from ..streams.app import ROLES, build_app, changelog_topics, run_worker, serve_http
    from ..streams.policy import load_policy

    settings = config.load(args)
    setup_logging(settings.log_level, settings.log_format)
    policy = load_policy(settings.policy)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise config.ConfigError(f"--roles: unknown role(s) {sorted(unknown)}; known: {', '.join(ROLES)}")
    with kafka_or_embedded(settings) as s:
        # one line (exit 69) within connect_timeout_s if Kafka is not there, not librdkafka's retries
        check_reachable(s.bootstrap_servers or "", s.connect_timeout_s)
        ensure_topics(
            s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions), timeout_s=s.connect_timeout_s
        )
        app, st = build_app(s, policy, roles=roles)
        http = serve_http(st, args.http_host, args.http_port)
        log.info(
            "processor %s starting: Kafka %s, topics %s.* (%d partitions), roles %s, policy %s (%s); /healthz and /metrics at %s",
            s.processor_id,
            s.bootstrap_servers,
            s.topic_prefix,
            s.partitions,
            ",".join(roles),
            policy.ref,
            s.policy or "built in",
            http.url,
        )
        try:
            run_worker(app, s.log_level, s.log_format)
        finally:
            http.stop()
    return 0
