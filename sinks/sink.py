"""The DuckDB sink: consumes findings, window reports, profiling triggers and the detector's news with confluent-kafka.

Exactly-once into DuckDB on an at-least-once stream: the sink does not trust
Kafka's committed offsets; it stores the next offset of every partition in the
same DuckDB transaction as the rows and seeks there on every assignment.  After
each transaction the pager (when routes are configured) plans the pages of the
incident events that transaction appended.

Readers while the sink runs: DuckDB lets no second process open a file that a
writer holds, so the sink serves read-only SQL itself on a loopback HTTP port
and writes that address, with a bearer token, beside the database
(``<db>.sink.json``, readable by the file's owner only).  ``lockstep query`` and
``lockstep findings`` open the file read-only when it is free and ask the sink
otherwise (:func:`.http.query`).  With a tenant, both run the SQL in a sandbox that
holds that tenant's rows only (:func:`~.store.tenant_sandbox`).

Writes an operator asks for while the sink runs (``lockstep incident ack|resolve``,
``lockstep prune``: :mod:`.operator`) come through the same port, with the same
token, and run on the sink's own thread between two batches (:meth:`Sink.submit`):
the sink stays the file's only writer and its transactions never conflict with
them.  With ``retention_s`` the sink prunes the file itself every ``prune_every_s``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException, TopicPartition

from ..kafka import CONFLUENT, Clients, ConsumerClient, Publisher
from ..metrics import Metrics
from ..schemas.records import (
    CAUSES,
    DeviationMap,
    Finding,
    JobChange,
    ProfileTrigger,
    RecordError,
    StepSeries,
    WindowReport,
    dead_letter,
    decode,
    encode,
)
from .http import SinkStopping
from .paging.incidents import Event, Incident
from .store import Batch, FindingsStore
from .store.findings import Pruned

log = logging.getLogger("lockstep.sink")


#: how often a sink with a retention prunes its file
PRUNE_EVERY_S = 3600.0


class Sink:
    def __init__(
        self,
        store: FindingsStore,
        consumer_config: dict,
        topics: list[str],
        deadletter_topic: str,
        publisher: Publisher,
        metrics: Metrics | None = None,
        batch_size: int = 500,
        control_topic: str | None = None,
        pager=None,
        expire_every_s: float = 30.0,
        clients: Clients = CONFLUENT,
        retention_s: float | None = None,
        prune_every_s: float = PRUNE_EVERY_S,
        topic_ids: Callable[[set[str]], dict[str, str]] | None = None,
    ):
        self.store = store
        self.topics = topics
        self.deadletter_topic = deadletter_topic
        self.control_topic = control_topic  # carries other control records too: those are skipped, not dead letters
        self.publisher = publisher
        self.metrics = metrics or Metrics()
        self.batch_size = batch_size
        self.pager = pager
        self.expire_every_s = expire_every_s
        self.consumer = clients.consumer(consumer_config)
        self.retention_s = retention_s
        self.prune_every_s = prune_every_s
        self.topic_ids = topic_ids  # topic names -> their Kafka topic ids (lockstep.kafka.topic_ids)
        self._stop = threading.Event()
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.assigned = False

    def _on_assign(self, consumer: ConsumerClient, partitions) -> None:
        stored = self.store.stored_offsets()
        ids = self.topic_ids({p.topic for p in partitions}) if self.topic_ids else {}
        self.store.topic_ids = ids
        for p in partitions:
            p.offset = self._resume_at(consumer, p.topic, p.partition, stored.get((p.topic, p.partition)), ids)
        consumer.assign(partitions)
        self.assigned = True
        log.info("assigned %s", [(p.topic, p.partition, p.offset) for p in partitions])

    def _resume_at(
        self, consumer: ConsumerClient, topic: str, partition: int, stored: tuple[int, str | None] | None, ids
    ) -> int:
        """Where to read a partition from: the offset stored with the rows, unless it is of another log.

        A new broker (Kafka's data lost, or the embedded broker restarted: it keeps nothing) or a topic created again
        starts its offsets at 0.  Resuming there at the stored offset would skip the new log's records up to it (or,
        beyond its end, wait for records that may never come: Tansu answers such a fetch with nothing).  The topic's
        Kafka id, stored with the offset, says whether the log is the same; where either id is unknown, an offset
        beyond the log's end says it is not.  Either way the partition is read from its beginning: the writes are
        upserts, so records read twice change nothing."""
        if stored is None:
            return OFFSET_BEGINNING
        offset, stored_id = stored
        now_id = ids.get(topic)
        if stored_id and now_id:
            if stored_id == now_id:
                return offset
            log.warning(
                "%s[%d]: the stored offset %d is of another log (topic id %s, now %s: a new broker, or the topic "
                "was created again); reading the partition from its beginning",
                topic,
                partition,
                offset,
                stored_id,
                now_id,
            )
            return OFFSET_BEGINNING
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10.0)
        except KafkaException as exc:
            log.warning(
                "%s[%d]: could not read the log's end (%s); resuming at the stored offset %d",
                topic,
                partition,
                exc,
                offset,
            )
            return offset
        if high >= 0 and offset > high:
            log.warning(
                "%s[%d]: the stored offset %d is beyond the log's end %d (a new broker, or the topic was created "
                "again); reading the partition from its beginning",
                topic,
                partition,
                offset,
                high,
            )
            return OFFSET_BEGINNING
        return offset

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.consumer.subscribe(self.topics, on_assign=self._on_assign)
        next_tick = next_prune = 0.0
        try:
            while not self._stop.is_set():
                msgs = self.consumer.consume(self.batch_size, timeout=0.5)
                if msgs:
                    self.write(msgs)
                self._serve_requests()
                if time.monotonic() >= next_tick:  # also plans what a crash or a failed fan-out left
                    self._after(self.store.expire(), always=True)
                    next_tick = time.monotonic() + self.expire_every_s
                if self.retention_s and time.monotonic() >= next_prune:
                    self.prune(self.retention_s)
                    next_prune = time.monotonic() + self.prune_every_s
        finally:
            self._serve_requests(SinkStopping("the sink stopped before it ran the request; ask again when it runs"))
            self.consumer.close()

    # ------------------------------------------------------------------ an operator's writes

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the sink's thread between two batches (the file's one writer); its result in the future."""
        fut: Future = Future()
        self._requests.put((fn, fut))
        if self._stop.is_set():  # run() may have drained the queue already
            self._serve_requests(SinkStopping("the sink is stopping"))
        return fut

    def _serve_requests(self, refuse: Exception | None = None) -> None:
        while True:
            try:
                fn, fut = self._requests.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if refuse is not None:
                fut.set_exception(refuse)
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def acknowledge(self, incident_id: str, by: str, tenant: str | None = None) -> tuple[Incident, list[Event]]:
        """Someone acknowledged an incident (call on the sink's thread: :meth:`submit`); the routes that paged it
        are told."""
        inc, events = self.store.acknowledge(incident_id, by, tenant)
        self._after(events)
        return inc, events

    def resolve(self, incident_id: str, by: str, tenant: str | None = None) -> tuple[Incident, list[Event]]:
        """Someone resolved an incident (call on the sink's thread: :meth:`submit`); the routes that paged it are
        told."""
        inc, events = self.store.resolve(incident_id, by, tenant)
        self._after(events)
        return inc, events

    def prune(self, older_than_s: float) -> Pruned:
        """Delete what is older than ``older_than_s`` (:meth:`.store.FindingsStore.prune`; on the sink's thread)."""
        return self.store.prune(older_than_s)

    def _after(self, events, always: bool = False) -> None:
        for ev in events:
            self.metrics.inc("incident_events_total", action=ev.action)
        if self.pager and (events or always):
            try:
                self.pager.fan_out()
            except Exception:  # the events stay in DuckDB: the next tick plans them
                log.exception("planning pages failed; retrying within %.0fs", self.expire_every_s)

    def _dead(self, msg, err: RecordError) -> None:
        dl = dead_letter(
            topic=msg.topic(),
            partition=msg.partition(),
            offset=msg.offset(),
            error=err,
            stage="sink",
            payload=msg.value(),
        )
        self.publisher.send_raw(self.deadletter_topic, msg.key(), encode(dl))
        self.metrics.inc(
            "dead_letters_total",
            reason=err.reason,
            stage="sink",
        )
        self.metrics.inc("records_out_total", topic=self.deadletter_topic)

    def _isolate(self, accepted, offsets, exc: Exception) -> list:
        """The store refused a batch: write its records one by one (upserts: a crash in between replays them
        harmlessly), dead-letter those it refuses, then move the offsets."""
        log.warning(
            "the store refused a batch of %d record(s) (%s: %s); writing them one by one",
            len(accepted),
            type(exc).__name__,
            exc,
        )
        events = []
        for msg, rec in accepted:
            try:
                events += self.store.write(Batch.of([rec], {}))
            except Exception as err:
                log.exception(
                    "the store refused %s[%d]@%d; it goes to the dead-letter topic",
                    msg.topic(),
                    msg.partition(),
                    msg.offset(),
                )
                self._dead(
                    msg,
                    RecordError("processing_failed", f"the findings store refused it ({type(err).__name__}: {err})"),
                )
        self.publisher.flush()
        return events + self.store.write(Batch(findings=[], windows=[], offsets=offsets))

    def write(self, msgs) -> Batch:
        accepted = []  # (message, record)
        offsets: dict[tuple[str, int], int] = {}
        dead = 0
        m = self.metrics
        now = time.time()
        lag_s: dict[str, float] = {}
        for msg in msgs:
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", msg.error().str())
                continue
            m.inc("records_in_total", topic=msg.topic())
            offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            kind, ts_ms = msg.timestamp()
            if kind != TIMESTAMP_NOT_AVAILABLE:
                lag_s[msg.topic()] = max(0.0, now - ts_ms / 1000.0)
            try:
                rec = decode(msg.value(), (Finding, WindowReport, ProfileTrigger, StepSeries, DeviationMap, JobChange))
            except RecordError as err:
                if err.reason == "wrong_record" and msg.topic() == self.control_topic:
                    continue  # another control record (not a trigger): not the sink's business
                self._dead(msg, err)
                dead += 1
                continue
            accepted.append((msg, rec))
        if dead:
            self.publisher.flush()  # dead letters are durable before the offsets move past them
        batch = Batch.of([rec for _, rec in accepted], offsets)
        t0 = time.perf_counter()
        try:
            events = self.store.write(batch)
        except (
            Exception
        ) as exc:  # a record the store cannot keep must not stop the sink (it would stop again on restart)
            events = self._isolate(accepted, offsets, exc)
        m.observe("write_seconds", time.perf_counter() - t0)
        for topic, age in lag_s.items():
            m.set(
                "consumer_lag_seconds",
                age,
                topic=topic,
            )
        for (topic, partition), pos in offsets.items():
            try:
                _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
            except KafkaException:
                continue
            if high >= 0:
                m.set(
                    "consumer_lag_records",
                    max(0, high - pos),
                    topic=topic,
                    partition=str(partition),
                )
        for f in batch.findings:
            # a label per cause this build knows: a record's free text must not grow the metrics without bound
            m.inc("findings_written_total", cause=f.cause if f.cause in CAUSES else "other")
        m.inc("windows_written_total", len(batch.windows))
        m.inc("triggers_written_total", len(batch.triggers))
        m.inc("step_series_written_total", sum(len(s.steps) for s in batch.series))
        for ch in batch.changes:
            m.inc("job_changes_written_total", change=ch.change)
        self._after(events)
        return batch
