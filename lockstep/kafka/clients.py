"""Kafka wiring shared by every process: topic names, topic creation, client settings."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from .config import ConfigError, Settings

log = logging.getLogger(__name__)
#: librdkafka's own log lines go through Python logging (not straight to stderr)
librdkafka_log = logging.getLogger("lockstep.librdkafka")


class TopicError(RuntimeError):
    """Topics could not be created, or exist with a different partition count."""


@dataclass(frozen=True)
class Topics:
    """Every topic of the pipeline, with its key."""

    heartbeats: str  # StepHeartbeat, key job
    control: str  # ProfileTrigger, RawRequest, key job
    features: str  # FeatureBatch, key job:step
    stepreports: str  # StepReport / WindowTimeout (internal), key job
    findings: str  # Finding, key job
    windows: str  # WindowReport, key job
    deadletter: str  # DeadLetter, key: the original key
    raw: str  # RawTrace (answers to a RawRequest on control), key job
    series: str  # StepSeries, DeviationMap (the pictures: step times, deviation maps), key job

    @classmethod
    def named(cls, prefix: str = "lockstep") -> Topics:
        return cls(**{f: f"{prefix}.{f}" for f in cls.__dataclass_fields__})

    def all(self) -> list[str]:
        return [getattr(self, f) for f in self.__dataclass_fields__]


def features_key(job: str, step: int) -> bytes:
    return f"{job}:{step}".encode()


def common_config(settings: Settings) -> dict[str, str]:
    if not settings.bootstrap_servers:
        raise ConfigError("bootstrap_servers: no Kafka to connect to (start the embedded broker or pass --bootstrap-servers)")
    return {"bootstrap.servers": settings.bootstrap_servers, "logger": librdkafka_log, **settings.kafka}


def producer_config(settings: Settings, **overrides: object) -> dict:
    """Idempotent, acks=all, zstd, murmur2 (the partitioner faust/aiokafka/Java use).

    Never auto-creates a topic: librdkafka's producer asks the broker to by default, and a
    broker then creates it with its own partition count (Tansu: 4), which the pipeline's
    check refuses.  Topics come from :func:`ensure_topics`; a record for a topic that does
    not exist yet times out, and an agent keeps it in its spool until the topic appears.
    """
    cfg: dict[str, object] = {
        "allow.auto.create.topics": False,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "zstd",
        "partitioner": "murmur2_random",
        "linger.ms": 5,
        "message.timeout.ms": 30000,
    }
    cfg.update(common_config(settings))
    cfg.update(overrides)
    return cfg


def consumer_config(settings: Settings, group: str | None, **overrides: object) -> dict:
    cfg: dict[str, object] = {
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": max(500, settings.session_timeout_ms // 6),
        "enable.partition.eof": False,
        "fetch.wait.max.ms": settings.fetch_wait_ms,
    }
    if group:
        cfg["group.id"] = group
    else:  # librdkafka wants a group id even for assign()-only consumers
        cfg["group.id"] = "lockstep-reader"
    cfg.update(common_config(settings))
    cfg.update(overrides)
    return cfg


def admin(settings: Settings) -> AdminClient:
    return AdminClient(common_config(settings))


def ensure_topics(settings: Settings, extra: dict[str, int] | None = None, timeout_s: float = 15.0) -> Topics:
    """Create the pipeline's topics (and ``extra`` name -> partitions); check partition counts."""
    topics = Topics.named(settings.topic_prefix)
    wanted = {name: settings.partitions for name in topics.all()}
    wanted.update(extra or {})
    client = admin(settings)
    try:
        existing = client.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise TopicError(f"cannot reach Kafka at {settings.bootstrap_servers}: {exc}") from None
    new = [
        NewTopic(name, num_partitions=n, replication_factor=settings.replication_factor,
                 config={"cleanup.policy": "compact"} if name.endswith("-changelog") else {})
        for name, n in wanted.items()
        if name not in existing
    ]  # fmt: skip
    if new:
        for name, fut in client.create_topics(new, operation_timeout=timeout_s).items():
            try:
                fut.result(timeout=timeout_s)
                log.info("created topic %s", name)
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise TopicError(f"cannot create topic {name}: {exc.args[0].str()}") from None
    meta = client.list_topics(timeout=timeout_s).topics
    for name, n in wanted.items():
        if name not in meta:
            raise TopicError(f"topic {name} does not exist after creation")
        have = len(meta[name].partitions)
        if have != n:
            raise TopicError(
                f"topic {name} has {have} partitions but {n} are configured; every topic of the pipeline "
                "needs the same partition count (set --partitions to match, or recreate the topics)"
            )
    return topics


def faust_broker_kwargs(settings: Settings) -> dict:
    """Translate librdkafka security settings into faust's ``broker_credentials``."""
    kwargs: dict[str, object] = {"broker": f"kafka://{settings.bootstrap_servers}"}
    k = settings.kafka
    protocol = k.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return kwargs
    import faust

    ctx = None
    if "SSL" in protocol:
        ctx = ssl.create_default_context(cafile=k.get("ssl.ca.location"))
        if k.get("ssl.certificate.location"):
            ctx.load_cert_chain(k["ssl.certificate.location"], k.get("ssl.key.location"), k.get("ssl.key.password"))
    if "SASL" in protocol:
        mech = k.get("sasl.mechanism", k.get("sasl.mechanisms", "PLAIN")).upper()
        kwargs["broker_credentials"] = faust.SASLCredentials(
            username=k.get("sasl.username"), password=k.get("sasl.password"), mechanism=mech, ssl_context=ctx
        )
    elif ctx is not None:
        kwargs["broker_credentials"] = faust.SSLCredentials(ctx)
    return kwargs


def read_all(settings: Settings, topics: list[str], quiet_s: float = 0.3) -> dict[str, list[tuple[bytes | None, bytes | None]]]:
    """Every (key, value) in the topics, partition by partition in offset order (for demos and tests)."""
    c = Consumer(consumer_config(settings, None))
    out: dict[str, list] = {t: [] for t in topics}
    try:
        assign, high = [], {}
        for topic in topics:
            for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
                low, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
                if hi > low:
                    assign.append(TopicPartition(topic, p, low))
                    high[(topic, p)] = hi
        c.assign(assign)
        # Tansu reports the last batch's base offset + 1 as the high watermark, a lower bound
        # of the real end: read past it until every partition stays quiet
        pos = {k: 0 for k in high}
        quiet = 0
        while quiet < 2:
            msgs = c.consume(5000, timeout=quiet_s)
            for msg in msgs:
                if not msg.error():
                    out[msg.topic()].append((msg.key(), msg.value()))
                    pos[(msg.topic(), msg.partition())] = msg.offset() + 1
            caught_up = all(pos[k] >= h for k, h in high.items())
            quiet = quiet + 1 if (not msgs and caught_up) else 0
    finally:
        c.close()
    return out
