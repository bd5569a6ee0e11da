"""Publishing records to Kafka with confluent-kafka.

Idempotent, ``acks=all``, zstd, murmur2 partitioning (see :func:`~lockstep.kafka.clients.producer_config`).
Delivery errors are counted and kept; :meth:`Publisher.flush` raises
:class:`DeliveryError` when any record was not delivered, so a caller never
believes a record arrived that did not.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

from ..schemas.errors import LockstepError
from ..schemas.records import encode
from .clients import CONFLUENT, Clients, ProducerClient

log = logging.getLogger(__name__)


class DeliveryError(LockstepError, RuntimeError):
    """Kafka did not acknowledge some records."""


class PublisherClosed(LockstepError, RuntimeError):
    """A record was sent through a :class:`Publisher` after its :meth:`~Publisher.close`."""


@dataclass
class PublishStats:
    records: Counter = field(default_factory=Counter)  # topic -> records acknowledged
    bytes: Counter = field(default_factory=Counter)  # topic -> value bytes acknowledged
    failed: Counter = field(default_factory=Counter)  # topic -> records not delivered
    errors: list[str] = field(default_factory=list)  # first errors, for the message


class Publisher:
    """Thin shell over a Kafka producer that speaks Lockstep records (every process but the host agent,
    whose :class:`~lockstep.producers.agent.outbox.Outbox` never waits and spools instead)."""

    def __init__(self, config: dict, *, buffer_wait_s: float = 5.0, clients: Clients = CONFLUENT):
        self._owned: ProducerClient | None = clients.producer(config)  # None once closed
        self._buffer_wait_s = buffer_wait_s
        self.stats = PublishStats()
        self._lock = threading.Lock()

    @property
    def _producer(self) -> ProducerClient:
        if self._owned is None:
            raise PublisherClosed("the publisher is closed")
        return self._owned

    def _on_delivery(self, err: KafkaError | None, msg) -> None:  # runs inside poll()/flush()
        topic = msg.topic()
        with self._lock:
            if err is None:
                self.stats.records[topic] += 1
                self.stats.bytes[topic] += len(msg.value() or b"")
            else:
                self.stats.failed[topic] += 1
                if len(self.stats.errors) < 10:
                    self.stats.errors.append(f"{topic}: {err.str()}")
                log.warning("delivery to %s failed: %s", topic, err.str())

    def send_raw(self, topic: str, key: bytes | None, value: bytes, headers: list | None = None) -> None:
        """Queue one value; waits for room (up to ``buffer_wait_s``) if the local queue is full."""
        waited = 0.0
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=self._on_delivery)
                break
            except BufferError:
                if waited >= self._buffer_wait_s:
                    raise
                self._producer.poll(0.05)
                waited += 0.05
        self._producer.poll(0)

    def send(self, topic: str, key: str | bytes, record) -> int:
        """Encode and queue a record; returns the encoded size."""
        value = encode(record)
        self.send_raw(topic, key.encode() if isinstance(key, str) else key, value)
        return len(value)

    def poll(self, timeout: float = 0) -> None:
        self._producer.poll(timeout)

    def pending(self) -> int:
        return len(self._owned) if self._owned is not None else 0

    def flush(self, timeout_s: float = 30.0) -> None:
        left = self._producer.flush(timeout_s)
        if left:
            raise DeliveryError(f"{left} record(s) still undelivered after {timeout_s}s")
        if sum(self.stats.failed.values()):
            raise DeliveryError(
                f"{sum(self.stats.failed.values())} record(s) were not delivered: " + "; ".join(self.stats.errors[:3])
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then let go of the producer: librdkafka's threads and
        connections end with it, not when the publisher is freed (a broker stopped while a client is connected waits
        for it).  What was not delivered by then is dropped, counted in :attr:`stats` and logged.  Closing again does
        nothing; sending after it raises :class:`PublisherClosed`."""
        producer, self._owned = self._owned, None
        if producer is None:
            return
        left = producer.flush(timeout_s)
        if left:
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(1.0)  # serves the purge callbacks: they count the records as failed
            log.warning("closed with %d record(s) undelivered after %.1f s: dropped", left, timeout_s)
