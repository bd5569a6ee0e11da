"""Creating the pipeline's topics (:mod:`.names`) with one partition count, and asking for their ids."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, NewTopic

from ..config import Settings
from ..schemas.errors import LockstepError
from .clients import MAX_BATCH_BYTES, KafkaUnavailable, admin
from .names import Topics

log = logging.getLogger("lockstep.kafka")


class TopicError(LockstepError, RuntimeError):
    """Topics could not be created, do not exist, or exist with a different partition count."""


def ensure_topics(settings: Settings, extra: dict[str, int] | None = None, timeout_s: float = 15.0) -> Topics:
    """Create the pipeline's topics (and ``extra`` name -> partitions); check partition counts."""
    topics = Topics.named(settings.topic_prefix)
    wanted = dict.fromkeys(topics.all(), settings.partitions)
    wanted.update(extra or {})
    client = admin(settings)
    try:
        existing = client.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise KafkaUnavailable(
            f"Kafka at {settings.bootstrap_servers} did not answer within {timeout_s:g} s: {reason}"
        ) from None
    new = [
        NewTopic(
            name,
            num_partitions=n,
            replication_factor=settings.replication_factor,
            config={
                "max.message.bytes": str(MAX_BATCH_BYTES),
                **({"cleanup.policy": "compact"} if name.endswith("-changelog") else {}),
            },
        )
        for name, n in wanted.items()
        if name not in existing
    ]
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


#: what a broker that has no topic ids answers
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


def topic_ids(client: AdminClient, names: set[str] | list[str], timeout_s: float = 10.0) -> dict[str, str]:
    """Each topic's Kafka topic id (a new one whenever the topic is created again: another broker, a topic deleted
    and recreated).  Topics whose id the broker does not tell, or that it could not describe in time, are left out."""
    if not names:
        return {}
    try:
        futures = client.describe_topics(TopicCollection(sorted(names)), request_timeout=timeout_s)
    except (KafkaException, ValueError, TypeError) as exc:
        log.warning("could not ask Kafka for topic ids (%s); offsets are checked against the log's end only", exc)
        return {}
    ids = {}
    for name, fut in futures.items():
        try:
            tid = str(fut.result(timeout=timeout_s).topic_id or "")
        except Exception as exc:  # a topic the broker cannot describe: its offsets are checked by the log's end
            log.warning("could not describe topic %s (%s)", name, exc)
            continue
        if tid and tid != _NO_TOPIC_ID:
            ids[name] = tid
    return ids
