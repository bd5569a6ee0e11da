"""Kafka in memory, for unit tests of the code around the clients (what httpx's ``MockTransport`` is to httpx).

``MemoryKafka(topics).clients()`` makes producers and consumers that share one in-memory log: topics with
partitions and offsets; a producer's records are readable at once and its delivery reports run inside
``poll()``/``flush()``, as librdkafka's do; consumers ``assign()`` (offsets, ``OFFSET_BEGINNING``/``OFFSET_END``)
or ``subscribe()`` (every partition, through ``on_assign``) and ``consume()``.  Nothing else of a broker:
no groups, commits, compression or time-outs, and keys are partitioned by CRC32, not murmur2.
Integration tests use a real broker.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, TIMESTAMP_CREATE_TIME, KafkaError, Message, TopicPartition

from .clients import Clients


@dataclass
class _TopicMeta:
    partitions: dict[int, None]
    error: KafkaError | None = None


@dataclass
class _ClusterMeta:
    topics: dict[str, _TopicMeta] = field(default_factory=dict)


class MemoryKafka:
    """Topics (name -> partitions) in memory, shared by every client :meth:`clients` makes."""

    def __init__(self, topics: Mapping[str, int] | None = None):
        self._changed = threading.Condition()
        self._log: dict[str, list[list[Message]]] = {}
        for name, n in (topics or {}).items():
            self.create(name, n)

    def create(self, topic: str, partitions: int = 1) -> None:
        with self._changed:
            self._log.setdefault(topic, [[] for _ in range(partitions)])

    def clients(self) -> Clients:
        """Clients over these topics (the configuration they are given is ignored)."""
        return Clients(producer=lambda config: MemoryProducer(self), consumer=lambda config: MemoryConsumer(self))

    def messages(self, topic: str) -> list[Message]:
        """Everything in ``topic``, partition by partition."""
        with self._changed:
            return [m for part in self._log[topic] for m in part]

    # ------------------------------------------------------------------ for the clients

    def _metadata(self, topic: str | None) -> _ClusterMeta:
        with self._changed:
            names = [topic] if topic else list(self._log)
            return _ClusterMeta(
                {
                    t: _TopicMeta(dict.fromkeys(range(len(self._log[t]))))
                    if t in self._log
                    else _TopicMeta({}, KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
                    for t in names
                }
            )

    def _append(self, topic: str, key: bytes | None, value: bytes | None, headers: Any) -> Message | None:
        with self._changed:
            parts = self._log.get(topic)
            if parts is None:
                return None
            p = zlib.crc32(key) % len(parts) if key is not None else 0
            msg = Message(
                topic=topic,
                partition=p,
                offset=len(parts[p]),
                key=key,
                value=value,
                headers=headers,
                timestamp=(TIMESTAMP_CREATE_TIME, int(time.time() * 1000)),
            )
            parts[p].append(msg)
            self._changed.notify_all()
            return msg

    def _length(self, topic: str, partition: int) -> int:
        with self._changed:
            return len(self._log[topic][partition])


class MemoryProducer:
    def __init__(self, kafka: MemoryKafka):
        self._kafka = kafka
        self._reports: list[tuple[Callable[..., None] | None, KafkaError | None, Message]] = []

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Any = None,
        on_delivery: Callable[..., None] | None = None,
        **kw: Any,
    ) -> None:
        if isinstance(key, str):
            key = key.encode()
        msg = self._kafka._append(topic, key, value, headers)
        if msg is not None:
            self._reports.append((on_delivery, None, msg))
        else:  # librdkafka reports an unknown topic in the delivery report
            self._reports.append(
                (on_delivery, KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART), Message(topic=topic, key=key, value=value))
            )

    def poll(self, timeout: float = 0.0) -> int:
        reports, self._reports = self._reports, []
        for callback, err, msg in reports:
            if callback is not None:
                callback(err, msg)
        return len(reports)

    def flush(self, timeout: float = 0.0) -> int:
        self.poll()
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        pass  # every record is delivered at once: nothing waits

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMeta:
        return self._kafka._metadata(topic)

    def __len__(self) -> int:
        return len(self._reports)


class MemoryConsumer:
    def __init__(self, kafka: MemoryKafka):
        self._kafka = kafka
        self._next: dict[tuple[str, int], int] = {}
        self._subscribed: tuple[list[str], Callable[..., None] | None] | None = None
        self.closed = False

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMeta:
        return self._kafka._metadata(topic)

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = -1, cached: bool = False
    ) -> tuple[int, int]:
        return 0, self._kafka._length(partition.topic, partition.partition)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._next = {}
        for tp in partitions:
            end = self._kafka._length(tp.topic, tp.partition)
            self._next[(tp.topic, tp.partition)] = end if tp.offset == OFFSET_END else 0 if tp.offset < 0 else tp.offset

    def subscribe(self, topics: list[str], on_assign: Callable[..., None] | None = None) -> None:
        self._subscribed = (topics, on_assign)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        if self._subscribed is not None:  # assigned at the first consume, as librdkafka does in its poll
            topics, on_assign = self._subscribed
            self._subscribed = None
            parts = [
                TopicPartition(t, p, OFFSET_BEGINNING)
                for t in topics
                for p in self._kafka._metadata(t).topics[t].partitions
            ]
            if on_assign is not None:
                on_assign(self, parts)
            else:
                self.assign(parts)
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._kafka._changed:
            while True:
                out: list[Message] = []
                for (topic, p), offset in self._next.items():
                    part = self._kafka._log[topic][p]
                    taken = part[offset : offset + num_messages - len(out)]
                    out += taken
                    self._next[(topic, p)] = offset + len(taken)
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out
                self._kafka._changed.wait(left)

    def close(self) -> None:
        self.closed = True
