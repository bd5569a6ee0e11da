"""Publishing from a background thread, with a bounded queue in front and a spool behind.

The training thread only ever calls :meth:`Outbox.put`: an append to a bounded
in-memory queue under an uncontended lock, never a network call, never a wait.
When the queue is full the oldest record is dropped and counted.

The publishing thread (``lockstep-agent-io``) wakes every ``flush_interval_s``
(or when ``tick``, which may block up to that long, returns), encodes what
accumulated and hands it to librdkafka, which batches it (so heartbeats travel
in batches).  A record Kafka does not acknowledge within the
delivery timeout, or that librdkafka has no room for, goes to the on-disk
:class:`~lockstep.producers.agent.spool.Spool`, and so does everything after it
while Kafka stays unreachable; what librdkafka still holds unsent then goes there at
once, in the order it was put, so the spool keeps the records in order and its bound
drops the oldest.  Every ``retry_s`` the thread asks the cluster for
metadata; once it answers, spooled segments are sent again, oldest first, and a
segment is deleted when each of its records was delivered; if Kafka goes away
again meanwhile the segment stays where it is and is sent again whole later
(at-least-once: a record whose delivery timed out, or that was delivered from a
segment sent again, may arrive twice, which every consumer of agent records tolerates).

With ``lazy`` (an agent that hands its heartbeats to a host relay) the Kafka producer is
created only when a record has to go to Kafka, and closed again after ``idle_close_s``
with nothing in flight or spooled: librdkafka's idle connections and timers are not free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException

from ...kafka import CONFLUENT, Clients, ProducerClient
from ...schemas.records import encode
from .spool import Spool

log = logging.getLogger("lockstep.agent")

#: delivery errors after which a record is worth keeping for later (anything else is rejected for good)
TRANSIENT = frozenset(
    getattr(KafkaError, name)
    for name in (
        "_MSG_TIMED_OUT",
        "_TIMED_OUT",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_PURGE_QUEUE",
        "_PURGE_INFLIGHT",
        "_QUEUE_FULL",
        "_RESOLVE",
        "_DESTROY",
        "REQUEST_TIMED_OUT",
        "NETWORK_EXCEPTION",
        "LEADER_NOT_AVAILABLE",
        "NOT_LEADER_FOR_PARTITION",
        "NOT_ENOUGH_REPLICAS",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        "UNKNOWN_TOPIC_OR_PART",
        "BROKER_NOT_AVAILABLE",
        "_UNKNOWN_TOPIC",
        "_UNKNOWN_PARTITION",
    )
    if hasattr(KafkaError, name)
)
REPLAY_INFLIGHT_MAX = 5000  # librdkafka messages in flight before the next spool segment is replayed


@dataclass
class OutboxCounters:
    queued: int = 0  # records put
    sent: int = 0  # acknowledged by Kafka
    dropped_queue: int = 0  # queue full: oldest dropped
    rejected: int = 0  # permanent delivery errors (too large, not authorised, ...)
    spooled_total: int = 0  # records that went to the spool (some of them sent later)


class Outbox:
    def __init__(
        self,
        producer_config: dict,
        spool: Spool,
        *,
        queue_max: int = 10_000,
        flush_interval_s: float = 0.2,
        retry_s: float = 2.0,
        tick: Callable[[float], bool] | None = None,
        coalesce: Callable[[list], list] | None = None,
        on_sent: Callable[[str, bytes | None, int], None] | None = None,
        name: str = "lockstep-agent-io",
        clients: Clients = CONFLUENT,
        lazy: bool = False,
        idle_close_s: float | None = None,
    ):
        self._producer_config = producer_config
        self._clients = clients
        self._producer: ProducerClient | None = None if lazy else clients.producer(producer_config)
        self._idle_close_s = idle_close_s
        self._last_produce = 0.0
        self.spool = spool
        self.counters = OutboxCounters()
        self._queue: deque = deque()
        self._queue_max = queue_max
        self._lock = threading.Lock()
        self._flush_interval_s = flush_interval_s
        self._retry_s = retry_s
        self._tick = tick
        self._coalesce = coalesce  # what accumulated -> what is sent (the agent: heartbeats as one batch)
        self._on_sent = on_sent  # (topic, key, bytes) of each record Kafka acknowledged (the agent logs windows)
        self._down = False
        self._next_probe = 0.0
        self._replaying: dict[Path, int] = {}  # segment -> records not yet reported back
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._warned_full = 0.0

    # ------------------------------------------------------------------ the training thread's side

    def put(self, topic: str, key: bytes | None, record) -> None:
        """Queue a record (or already encoded bytes) for publishing.  Never blocks."""
        with self._lock:
            if len(self._queue) >= self._queue_max:
                self._queue.popleft()
                self.counters.dropped_queue += 1
                now = time.monotonic()
                if now - self._warned_full > 10:
                    self._warned_full = now
                    log.warning(
                        "agent queue full (%d records): dropping the oldest; %d dropped so far",
                        self._queue_max,
                        self.counters.dropped_queue,
                    )
            self._queue.append((topic, key, record))
            self.counters.queued += 1

    def wake(self) -> None:
        """Publish what is queued now instead of at the next interval."""
        self._wake.set()

    @property
    def dropped(self) -> int:
        return self.counters.dropped_queue + self.spool.dropped

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    @property
    def down(self) -> bool:
        return self._down

    @property
    def connected(self) -> bool:
        """Whether a Kafka producer exists now (always, unless ``lazy``)."""
        return self._producer is not None

    def _client(self) -> ProducerClient:
        if self._producer is None:
            self._producer = self._clients.producer(self._producer_config)
            log.debug("agent Kafka producer created")
        self._last_produce = time.monotonic()
        return self._producer

    # ------------------------------------------------------------------ the publishing thread

    def start(self) -> Outbox:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # ``tick`` (the control follower) may wait for records up to the interval itself: one
                # wake-up per interval serves both directions (on this VM each wake-up costs ~0.1 ms)
                if self._tick is None or not self._tick(self._flush_interval_s):
                    self._wake.wait(self._flush_interval_s)
                self._wake.clear()
                self.pump()
            except Exception:
                log.exception("agent publishing loop failed; continuing")
                time.sleep(self._flush_interval_s)

    def pump(self) -> None:
        """One round: send what is queued, serve callbacks, probe / replay the spool."""
        with self._lock:
            batch, self._queue = self._queue, deque()
        # the coalescer runs every round, queue empty or not (a relay has its host's hand-overs to send)
        items = self._coalesce(list(batch)) if self._coalesce is not None else batch
        for topic, key, record in items:
            value = record if isinstance(record, bytes) else encode(record)
            self._send(topic, key, value)
        if self._producer is not None:
            self._producer.poll(0)
            self._hand_back()
        if self._down and time.monotonic() >= self._next_probe:
            self._probe()
        if (
            not self._down
            and len(self.spool)
            and not self._replaying
            and (self._producer is None or len(self._producer) < REPLAY_INFLIGHT_MAX)
        ):
            self._replay_segment()
        if self._idle_close_s is not None and self._producer is not None:
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        assert self._producer is not None
        if (
            self._down
            or self._replaying
            or len(self.spool)
            or len(self._producer)
            or time.monotonic() - self._last_produce < self._idle_close_s  # type: ignore[operator]
        ):
            return
        self._producer.flush(0)
        self._producer = None  # librdkafka's threads and connections end with it
        log.debug("agent Kafka producer closed: idle")

    def _send(self, topic: str, key: bytes | None, value: bytes, on_delivery=None) -> None:
        if self._down:
            self._to_spool(topic, key, value)
            return
        try:
            self._client().produce(topic, value=value, key=key, on_delivery=on_delivery or self._delivered)
        except BufferError:
            self._mark_down("librdkafka's queue is full")
            self._hand_back()
            self._to_spool(topic, key, value)
        except KafkaException as exc:
            self.counters.rejected += 1
            log.warning("record for %s rejected: %s", topic, exc)

    def _to_spool(self, topic: str, key: bytes | None, value: bytes) -> None:
        self.spool.append(topic, key, value)
        self.counters.spooled_total += 1

    def _mark_down(self, why: str) -> None:
        if not self._down:
            log.warning("Kafka unreachable (%s): spooling records to %s until it answers", why, self.spool.dir)
        self._down = True
        self._next_probe = time.monotonic() + self._retry_s

    def _hand_back(self) -> None:
        """Once Kafka is down, what librdkafka still holds unsent goes to the spool at once, in the order it was
        produced (its purge callbacks, served here), before any later record is spooled: otherwise each would wait out
        its delivery timeout and reach the spool interleaved with the records spooled meanwhile, and the spool's
        bound would drop a mix of old and new steps instead of the oldest.  Not called from a delivery callback
        (librdkafka's poll is not re-entrant); records already sent keep their own timeouts (purging them could send
        twice what the broker did write)."""
        producer = self._producer
        if self._down and producer is not None and len(producer):
            producer.purge(in_queue=True, in_flight=False)
            producer.poll(0)

    def _probe(self) -> None:
        try:
            self._client().list_topics(timeout=1.0)
        except KafkaException:
            self._next_probe = time.monotonic() + self._retry_s
            return
        self._down = False
        log.info("Kafka answers again; sending %d spooled record(s)", len(self.spool))

    def _delivered(self, err: KafkaError | None, msg) -> None:
        if err is None:
            self.counters.sent += 1
            if self._on_sent is not None:
                self._on_sent(msg.topic(), msg.key(), len(msg.value() or b""))
        elif err.code() in TRANSIENT or err.retriable():
            self._mark_down(err.str())
            self._to_spool(msg.topic(), msg.key(), msg.value())
        else:
            self.counters.rejected += 1
            log.warning("record for %s rejected by Kafka: %s", msg.topic(), err.str())

    def _replay_segment(self) -> None:
        """Send the oldest segment again.  It is deleted once each of its records was delivered (or rejected for
        good); if Kafka goes away again meanwhile it stays where it is, oldest, and is replayed whole later (what was
        delivered of it may arrive twice: at-least-once).  Spooling its records anew would put them after the
        records spooled meanwhile, and the spool's bound would then drop newer records before them."""
        producer = self._client()
        segment = self.spool.segments()[0]
        records = list(self.spool.read(segment))
        self._replaying[segment] = len(records)
        kept = False  # Kafka went away during the replay: the segment stays

        def finished(n: int = 1) -> None:
            self._replaying[segment] -= n
            if self._replaying[segment] <= 0:
                del self._replaying[segment]
                if not kept:
                    self.spool.remove(segment)

        def done(err: KafkaError | None, msg) -> None:
            nonlocal kept
            if err is not None and (err.code() in TRANSIENT or err.retriable()):
                self._mark_down(err.str())
                kept = True
            else:
                self._delivered(err, msg)
            finished()

        if not records:
            self._replaying[segment] = 1
            finished()
        for i, (topic, key, value) in enumerate(records):
            if not self._down:
                try:
                    producer.produce(topic, value=value, key=key, on_delivery=done)
                    continue
                except BufferError:
                    self._mark_down("librdkafka's queue is full")
            kept = True  # Kafka went away again: the rest stays in the segment, and the segment with it
            finished(len(records) - i)
            break
        producer.poll(0)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued; whatever Kafka has not acknowledged within ``timeout_s`` stays in the spool."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s + 5)
        self._idle_close_s = None  # what is sent now is flushed below, not closed on the way
        self.pump()
        producer = self._producer
        left = producer.flush(0 if self._down else timeout_s) if producer is not None else 0
        if left and producer is not None:
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(1.0)  # serves the purge callbacks: the records go to the spool
        self._producer = None  # librdkafka's threads and connections end with it, not when the outbox is freed
        self.spool.close()
        if len(self.spool):
            log.warning(
                "%d record(s) left in the spool %s; the next agent run with this spool sends them",
                len(self.spool),
                self.spool.dir,
            )
