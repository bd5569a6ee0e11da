"""What the one-shot Kafka commands (``trigger``, ``raw``, ``topics``, ``simulate --publish``) do before they talk to
Kafka: their logging, with librdkafka's own lines quiet below DEBUG, and one line if Kafka cannot be reached."""

from __future__ import annotations

from ..config import Settings


def reach_kafka(settings: Settings) -> None:
    """Set up logging (librdkafka's lines only at ``--log-level DEBUG``) and raise
    :class:`~lockstep.kafka.KafkaUnavailable` (exit status 69) within ``connect_timeout_s`` if no bootstrap server
    takes a connection."""
    from ..kafka import check_reachable
    from ..logs import setup_logging

    setup_logging(settings.log_level, settings.log_format, client_logs=False)
    check_reachable(settings.bootstrap_servers or "", settings.connect_timeout_s)
