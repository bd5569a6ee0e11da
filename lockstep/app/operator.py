"""What an operator asks the running pipeline, through Kafka: a profiling window, slices of raw traces.

* :func:`request_window` (``lockstep trigger``): the detector that owns the job's state (the processor
  holding the job's partition of the heartbeats topic) decides, with the same policy checks as for its
  own windows.  So a ``TriggerRequest`` goes into that partition, and the answer comes on the control
  topic: the ``ProfileTrigger`` it published, or a ``TriggerRefused`` with the reason.
* :func:`request_raw` (``lockstep raw``): a ``RawRequest`` on the control topic; each named worker's
  agent answers on the raw topic with a ``RawTrace``.  Anything that can write to the raw topic (every
  training process) can answer, so an answer counts only when it carries the request's id, job, window
  and one of its workers, and only a worker's first answer counts.
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
import uuid

from confluent_kafka import KafkaException

from ..config import Settings
from ..kafka import (
    CONFLUENT,
    Clients,
    KafkaUnavailable,
    Publisher,
    Tail,
    TopicError,
    Topics,
    ask,
    consumer_config,
    producer_config,
)
from ..schemas.errors import LockstepError
from ..schemas.records import ProfileTrigger, RawRequest, RawTrace, TriggerRefused, TriggerRequest

log = logging.getLogger("lockstep.raw")


class TriggerError(LockstepError, RuntimeError):
    """The detector refused the window, or no processor answered."""


class RawError(LockstepError, RuntimeError):
    """No worker answered a raw request in time."""


def unanswered(settings: Settings, exc: KafkaException) -> KafkaUnavailable:
    """Kafka took the connection but did not answer in time (not Kafka, a security protocol it does not speak, a
    broker that is down behind a proxy): one line naming the address, the bound and librdkafka's reason."""
    reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
    return KafkaUnavailable(
        f"Kafka at {settings.bootstrap_servers} did not answer within {settings.connect_timeout_s:g} s "
        f"(--connect-timeout-s): {reason}"
    )


def request_window(
    settings: Settings, job: str, *, steps: int | None, reason: str, timeout_s: float, clients: Clients = CONFLUENT
) -> ProfileTrigger | TriggerRefused:
    """Send a TriggerRequest and return the detector's answer (ProfileTrigger or TriggerRefused)."""
    topics = Topics.named(settings.topic_prefix)
    req = TriggerRequest(
        job=job,
        request=uuid.uuid4().hex,
        steps=steps,
        reason=reason,
        requested_by=f"{getpass.getuser()}@{socket.gethostname()}",
        requested_at=time.time(),
    )
    try:
        answers = Tail(consumer_config(settings, None), topics.control, clients=clients).open(
            settings.connect_timeout_s
        )
    except TopicError as exc:
        raise TriggerError(f"{exc} (wrong --topic-prefix, or no processor ever ran?)") from None
    except KafkaException as exc:
        raise unanswered(settings, exc) from None
    with answers:
        got: list[ProfileTrigger | TriggerRefused] = ask(
            Publisher(producer_config(settings), clients=clients),
            topics.heartbeats,
            job,
            req,
            answers,
            (ProfileTrigger, TriggerRefused),
            where=lambda rec: rec.request == req.request,
            timeout_s=timeout_s,
        )
    if not got:
        raise TriggerError(
            f"no stream processor answered within {timeout_s:g}s (is `lockstep processor` running against "
            f"{settings.bootstrap_servers} with topic prefix {settings.topic_prefix!r}?)"
        )
    return got[0]


def answers_request(req: RawRequest, rec: RawTrace) -> bool:
    """Whether a RawTrace answers this RawRequest: its id, job, window (when one was named) and a worker it named."""
    return (
        rec.request == req.request
        and rec.job == req.job
        and rec.worker in req.workers
        and (not req.window or rec.window == req.window)
    )


def request_raw(
    settings: Settings, req: RawRequest, timeout_s: float, clients: Clients = CONFLUENT
) -> dict[int, RawTrace]:
    """Send ``req`` and collect the named workers' RawTrace answers (worker -> its first answer) until all came or time is up."""
    topics = Topics.named(settings.topic_prefix)

    def for_this_request(rec: RawTrace) -> bool:
        if answers_request(req, rec):
            return True
        log.warning(
            "ignored a raw-trace answer that is not for request %s (request %.64r, job %.64r, window %.64r, worker %d)",
            req.request,
            rec.request,
            rec.job,
            rec.window,
            rec.worker,
        )
        return False

    try:
        tail = Tail(consumer_config(settings, None), topics.raw, clients=clients).open(settings.connect_timeout_s)
    except TopicError as exc:
        raise RawError(f"{exc} (run `lockstep topics`, or check --topic-prefix)") from None
    except KafkaException as exc:
        raise unanswered(settings, exc) from None
    with tail:
        got = ask(
            Publisher(producer_config(settings), clients=clients),
            topics.control,
            req.job,
            req,
            tail,
            RawTrace,
            where=for_this_request,
            timeout_s=timeout_s,
            enough=lambda got: {a.worker for a in got} >= set(req.workers),
        )
    answers: dict[int, RawTrace] = {}
    for a in got:
        answers.setdefault(a.worker, a)  # the first answer of a worker counts
    return answers
