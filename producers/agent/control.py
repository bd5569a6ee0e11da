"""Following the control topic: profiling triggers and raw-trace requests for this job.

The agent reads the control topic from its end as of the moment it connects (an
agent acts on what is asked while it runs, not on history), through a
:class:`~lockstep.kafka.Tail`.  It connects lazily and survives an unreachable
broker: the tail is opened on the publishing thread, retried every few seconds,
and never stands in the training thread's way.  Who sent a record does not
matter; only the job does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaException

from ...kafka import CONFLUENT, Clients, Tail, TopicError
from ...schemas.records import ProfileTrigger, RawRequest

log = logging.getLogger("lockstep.agent")

ControlRecord = ProfileTrigger | RawRequest


class ControlFollower:
    def __init__(
        self, consumer_config: dict[str, Any], topic: str, job: str, retry_s: float = 2.0, clients: Clients = CONFLUENT
    ):
        self.job = job
        self.topic = topic
        self._tail = Tail(consumer_config, topic, clients=clients)
        self._retry_s = retry_s
        self._next_try = 0.0

    @property
    def connected(self) -> bool:
        return self._tail.is_open

    @property
    def bad_records(self) -> int:
        return self._tail.bad_records

    def poll(self, timeout_s: float = 0.0) -> list[ControlRecord] | None:
        """Records for this job, waiting up to ``timeout_s`` for the first; None (at once) while not connected."""
        if not self._tail.is_open:
            if time.monotonic() < self._next_try:
                return None
            try:
                self._tail.open(timeout_s=2.0)
            except (KafkaException, TopicError) as exc:
                self._next_try = time.monotonic() + self._retry_s
                log.debug("control topic not reachable yet: %s", exc)
                return None
            log.debug("following %s for job %s", self.topic, self.job)
        # refusals (TriggerRefused) are for operators, and are skipped like any other record type
        return self._tail.records(
            (ProfileTrigger, RawRequest), where=lambda rec: rec.job == self.job, timeout_s=timeout_s
        )

    def close(self) -> None:
        self._tail.close()
