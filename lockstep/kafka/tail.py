"""Reading topics without a consumer group: a :class:`Tail` from their end or their start, and :func:`ask`.

A tail is what an agent, the simulated fleet, ``lockstep trigger`` and ``lockstep raw`` need: the
records that arrive from now on, decoded, of the types they expect, filtered (:meth:`Tail.records`).
Read ``from_start``, it is what the demo, the load run and the tests need: everything a topic holds
(:meth:`Tail.read_to_end`, :func:`read_all`).  Nothing is committed.

The embedded broker reports the base offset of the last batch + 1 as the high watermark, a lower
bound of the real end when batches hold several records: reading "to the end" therefore reads past
the watermarks until every partition stays quiet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, TopicPartition

from ..config import Settings
from ..schemas.records import RecordError, decode
from .clients import CONFLUENT, Clients, ConsumerClient, consumer_config
from .publisher import Publisher
from .topics import TopicError

log = logging.getLogger("lockstep.kafka")

R = TypeVar("R")


@dataclass(frozen=True)
class Message:
    """One record as read from Kafka."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_s: float | None  # Kafka's timestamp (producer time), None when the broker gave none


class Tail:
    """Topics read from where each partition ends when :meth:`open` runs, or with ``from_start`` from its start.

    ``config`` is a consumer's configuration (:func:`~lockstep.kafka.clients.consumer_config`); its group id is
    never joined.  ``clients`` makes the consumer (confluent-kafka's by default).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: str | Sequence[str],
        *,
        from_start: bool = False,
        clients: Clients = CONFLUENT,
    ):
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self._config = dict(config)
        self._from_start = from_start
        self._clients = clients
        self._consumer: ConsumerClient | None = None
        self._ends: dict[tuple[str, int], int] = {}  # non-empty partitions -> high watermark when opened
        self._next: dict[tuple[str, int], int] = {}  # partition -> offset after the last record read
        #: records that could not be decoded (a record of another type is not counted: topics carry several)
        self.bad_records = 0

    @property
    def is_open(self) -> bool:
        return self._consumer is not None

    def open(self, timeout_s: float = 10.0) -> Tail:
        """Take position at every partition's end (or start).  :class:`TopicError` if a topic does not exist;
        ``KafkaException`` if Kafka does not answer."""
        consumer = self._clients.consumer(self._config)
        try:
            assignment = []
            for topic in self.topics:
                meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
                if meta is None or meta.error is not None or not meta.partitions:
                    raise TopicError(f"topic {topic} does not exist at {self._config.get('bootstrap.servers')}")
                for p in meta.partitions:
                    low, high = consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=timeout_s, cached=False
                    )
                    if high > low:
                        self._ends[(topic, p)] = high
                    assignment.append(TopicPartition(topic, p, low if self._from_start else high))
            consumer.assign(assignment)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        return self

    def poll(self, timeout_s: float = 0.0, max_messages: int = 100) -> list[Message]:
        """What arrived, waiting up to ``timeout_s`` for the first."""
        if self._consumer is None:
            raise RuntimeError("Tail.poll before Tail.open")
        out = []
        for msg in self._consumer.consume(max_messages, timeout=timeout_s):
            if msg.error():
                continue
            kind, ts_ms = msg.timestamp()
            out.append(
                Message(
                    msg.topic(),
                    msg.partition(),
                    msg.offset(),
                    msg.key(),
                    msg.value(),
                    None if kind == TIMESTAMP_NOT_AVAILABLE else ts_ms / 1000.0,
                )
            )
            self._next[(msg.topic(), msg.partition())] = msg.offset() + 1
        return out

    def records(
        self, types: type[R] | tuple[type, ...], *, where: Callable[[R], bool] | None = None, timeout_s: float = 0.0
    ) -> list[R]:
        """The records of ``types`` that arrived and that ``where`` accepts.  Records of other types are skipped;
        unreadable ones are counted (:attr:`bad_records`) and logged, never raised."""
        out: list[R] = []
        for msg in self.poll(timeout_s):
            try:
                rec: R = decode(msg.value, types)  # type: ignore[type-var,arg-type]  # R: the record types the caller names
            except RecordError as err:
                if err.reason != "wrong_record":
                    self.bad_records += 1
                    log.warning("ignoring a record on %s that cannot be read: %s", msg.topic, err)
                continue
            if where is None or where(rec):
                out.append(rec)
        return out

    def read_to_end(self, quiet_s: float = 0.3) -> list[Message]:
        """Everything up to the end: until every partition has passed its high watermark as seen when opened
        (a lower bound on the embedded broker) and nothing arrived for two rounds of ``quiet_s``."""
        out: list[Message] = []
        quiet = 0
        while quiet < 2:
            msgs = self.poll(quiet_s, max_messages=5000)
            out += msgs
            caught_up = all(self._next.get(k, 0) >= high for k, high in self._ends.items())
            quiet = quiet + 1 if (not msgs and caught_up) else 0
        return out

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def __enter__(self) -> Tail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_all(
    settings: Settings, topics: list[str], quiet_s: float = 0.3, *, clients: Clients = CONFLUENT
) -> dict[str, list[tuple[bytes | None, bytes | None]]]:
    """Every (key, value) in the topics, partition by partition in offset order (for the demo and tests)."""
    out: dict[str, list[tuple[bytes | None, bytes | None]]] = {t: [] for t in topics}
    with Tail(consumer_config(settings, None), topics, from_start=True, clients=clients).open() as tail:
        for msg in tail.read_to_end(quiet_s):
            out[msg.topic].append((msg.key, msg.value))
    return out


def ask(
    publisher: Publisher,
    topic: str,
    key: str,
    request: Any,
    answers: Tail,
    types: type[R] | tuple[type, ...],
    *,
    where: Callable[[R], bool],
    timeout_s: float,
    enough: Callable[[list[R]], bool] = bool,
) -> list[R]:
    """Send ``request`` and collect the answers (records of ``types`` on ``answers`` that ``where`` accepts) until
    ``enough`` of them came (default: one) or ``timeout_s`` passed.  ``answers`` is opened first if it is not open:
    an answer comes after its request."""
    if not answers.is_open:
        answers.open()
    publisher.send(topic, key, request)
    publisher.flush()
    got: list[R] = []
    deadline = time.monotonic() + timeout_s
    while not enough(got) and (left := deadline - time.monotonic()) > 0:
        got += answers.records(types, where=where, timeout_s=min(0.2, left))
    return got
