"""Following the control topic: profiling triggers and raw-trace requests for this job.

Like the simulated fleet's follower, the agent reads the control topic from its
end as of the moment it connects (an agent acts on what is asked while it runs,
not on history).  Unlike it, it starts lazily and survives an unreachable broker:
the consumer is created on the publishing thread, retried every few seconds,
and never stands in the training thread's way.  Who sent a record does not
matter; only the job does.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ...schemas.records import ProfileTrigger, RawRequest, RecordError, decode

log = logging.getLogger("lockstep.agent")

ControlRecord = ProfileTrigger | RawRequest


class ControlFollower:
    def __init__(self, consumer_config: dict, topic: str, job: str, retry_s: float = 2.0):
        self.job = job
        self.topic = topic
        self._config = consumer_config
        self._retry_s = retry_s
        self._consumer: Consumer | None = None
        self._next_try = 0.0
        self.bad_records = 0

    @property
    def connected(self) -> bool:
        return self._consumer is not None

    def _connect(self) -> None:
        consumer = Consumer(self._config)
        try:
            meta = consumer.list_topics(self.topic, timeout=2.0).topics[self.topic]
            if meta.error is not None:
                raise KafkaException(meta.error)
            tps = []
            for p in meta.partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=2.0)
                tps.append(TopicPartition(self.topic, p, high))
            consumer.assign(tps)
        except Exception:
            consumer.close()
            raise
        self._consumer = consumer
        log.info("following %s for job %s", self.topic, self.job)

    def poll(self, timeout_s: float = 0.0) -> list[ControlRecord] | None:
        """Records for this job, waiting up to ``timeout_s`` for the first; None (at once) while not connected."""
        if self._consumer is None:
            if time.monotonic() < self._next_try:
                return None
            try:
                self._connect()
            except KafkaException as exc:
                self._next_try = time.monotonic() + self._retry_s
                log.debug("control topic not reachable yet: %s", exc)
                return None
        out: list[ControlRecord] = []
        for msg in self._consumer.consume(100, timeout=timeout_s):  # type: ignore[union-attr]
            if msg.error():
                continue
            try:
                rec = decode(msg.value())
            except RecordError as err:
                self.bad_records += 1
                log.warning("ignoring a control record the agent cannot read: %s", err)
                continue
            if isinstance(rec, (ProfileTrigger, RawRequest)) and rec.job == self.job:  # refusals are for operators
                out.append(rec)
        return out

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
