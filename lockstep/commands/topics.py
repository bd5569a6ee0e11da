"""``lockstep topics``: create the pipeline's topics (idempotent) and list them."""

from __future__ import annotations

from .. import config
from ._kafka import reach_kafka


def register(sub) -> None:
    p = sub.add_parser("topics", help="create the pipeline's topics with the configured partitions, and list them")
    config.add_arguments(p, command="topics")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.output import print_json, table
    from ..broker import kafka_or_embedded
    from ..kafka import admin, ensure_topics
    from ..streams.app import changelog_topics

    settings = config.load(args)
    if not settings.bootstrap_servers:
        raise config.ConfigError("bootstrap_servers: `lockstep topics` needs a running Kafka (--bootstrap-servers)")
    reach_kafka(settings)
    with kafka_or_embedded(settings) as s:
        ensure_topics(
            s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions), timeout_s=s.connect_timeout_s
        )
        meta = admin(s).list_topics(timeout=10).topics
        rows = sorted(
            (n, len(t.partitions)) for n, t in meta.items() if n.startswith((s.topic_prefix + ".", s.processor_id))
        )
    if args.json:
        print_json([{"topic": n, "partitions": p} for n, p in rows])
    else:
        print(table(["topic", "partitions"], rows))
    return 0
