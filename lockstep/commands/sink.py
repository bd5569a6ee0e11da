"""``lockstep sink``: the DuckDB findings sink, with its read-only query endpoint and the pager."""

from __future__ import annotations

import logging
import signal

from .. import config

log = logging.getLogger("lockstep.sink")


def register(sub) -> None:
    p = sub.add_parser(
        "sink",
        help="run the DuckDB sink (findings, windows, triggers, incidents; pages; serves read-only SQL and the live page)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="port of the live page (/), /healthz, /metrics and /query (default: any free port)",
    )
    p.add_argument(
        "--http-host", default="127.0.0.1", help="address to serve them on (default 127.0.0.1; 0.0.0.0 in containers)"
    )
    config.add_arguments(p, command="sink")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..broker import kafka_or_embedded
    from ..kafka import Publisher, admin, check_reachable, consumer_config, ensure_topics, producer_config, topic_ids
    from ..logs import setup_logging
    from ..metrics import Metrics
    from ..sinks.http import QueryServer
    from ..sinks.paging import routes
    from ..sinks.paging.incidents import IncidentPolicy
    from ..sinks.paging.pager import Pager
    from ..sinks.sink import Sink
    from ..sinks.store import FindingsStore

    settings = config.load(args)
    setup_logging(settings.log_level, settings.log_format)
    paging = routes.load(settings.routes) if settings.routes else None  # validated before anything starts
    # the store next: a file that is not a findings store, or one another sink holds, stops it before Kafka is asked
    store = FindingsStore(
        settings.db,
        IncidentPolicy(resolve_min_coverage=settings.resolve_min_coverage, stale_after_s=settings.resolve_after_s),
        series_keep_steps=settings.series_keep_steps,
    )
    try:
        with kafka_or_embedded(settings) as s:
            # one line (exit 69) within connect_timeout_s if Kafka is not there, not librdkafka's retries
            check_reachable(s.bootstrap_servers or "", s.connect_timeout_s)
            topics = ensure_topics(s, timeout_s=s.connect_timeout_s)
            publisher = Publisher(producer_config(s))
            metrics = Metrics("sink")
            pager = Pager(store, paging, metrics).start() if paging else None
            sink = Sink(
                store,
                consumer_config(s, s.sink_group),
                [topics.findings, topics.windows, topics.control, topics.series],
                topics.deadletter,
                publisher,
                metrics,
                control_topic=topics.control,
                pager=pager,
                retention_s=s.retention,
                topic_ids=lambda names: topic_ids(admin(s), names),
            )
            server = QueryServer(sink, s.db, port=args.http_port, host=args.http_host).start()
            log.info(
                "sink writing %s; live page at %s/ and read-only SQL at %s/query (token in %s; `lockstep report --live-url` "
                "prints the page's address with it); paging %s; retention %s",
                s.db,
                server.url,
                server.url,
                server.sidecar,
                f"{len(paging.routes)} route(s) from {s.routes}" if paging else "off (no --routes)",
                f"{s.retention:.0f} s (pruned hourly)" if s.retention else "off (everything is kept)",
            )

            def stop(signum, frame):
                sink.stop()

            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
            try:
                sink.run()
            finally:
                if pager:
                    pager.stop()
                server.stop()
                publisher.close()
    finally:
        store.close()
    return 0
