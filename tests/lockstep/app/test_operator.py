"""An operator's requests in memory (MemoryKafka): which answers count.  Against the real processor and agents:
tests/integration/test_detector.py (``lockstep trigger``) and tests/adversarial/test_raw.py (``lockstep raw``)."""

from __future__ import annotations

import threading

import pytest

from lockstep.app.operator import RawError, TriggerError, request_raw, request_window
from lockstep.config import Settings
from lockstep.kafka import MemoryKafka, Publisher, Tail, Topics
from lockstep.schemas.records import RawRequest, RawTrace, TriggerRefused, TriggerRequest

SETTINGS = Settings(bootstrap_servers="memory:9092", topic_prefix="t")
TOPICS = Topics.named("t")


def answering(kafka: MemoryKafka, topic: str, kind: type, answers) -> threading.Thread:
    """A thread that waits for one request of ``kind`` on ``topic`` and publishes ``answers(request)``."""
    ready = threading.Event()

    def run() -> None:
        with Tail({}, topic, clients=kafka.clients()).open() as requests:
            ready.set()
            (req,) = requests.records(kind, timeout_s=10)
            pub = Publisher({}, clients=kafka.clients())
            for topic_, rec in answers(req):
                pub.send(topic_, req.job, rec)
            pub.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    return thread


def test_a_window_request_returns_the_detectors_answer_to_it():
    kafka = MemoryKafka(dict.fromkeys(TOPICS.all(), 2))

    def refused(req, request):
        return TriggerRefused(job=req.job, request=request, code="cooldown", reason=f"for {request}")

    detector = answering(
        kafka,
        TOPICS.heartbeats,
        TriggerRequest,
        lambda req: [(TOPICS.control, refused(req, "other")), (TOPICS.control, refused(req, req.request))],
    )
    answer = request_window(SETTINGS, "j", steps=8, reason="test", timeout_s=10, clients=kafka.clients())
    detector.join(10)
    assert isinstance(answer, TriggerRefused) and answer.reason == f"for {answer.request}" and answer.request != "other"


def test_a_request_to_a_pipeline_without_topics_says_what_is_missing():
    kafka = MemoryKafka()
    with pytest.raises(TriggerError, match=r"topic t.control does not exist at memory:9092 \(wrong --topic-prefix"):
        request_window(SETTINGS, "j", steps=None, reason="", timeout_s=1, clients=kafka.clients())
    with pytest.raises(RawError, match=r"topic t.raw does not exist at memory:9092 \(run `lockstep topics`"):
        request_raw(SETTINGS, RawRequest(job="j", request="r", workers=[1]), timeout_s=1, clients=kafka.clients())


def test_raw_answers_count_when_they_answer_the_request_and_only_a_workers_first():
    kafka = MemoryKafka(dict.fromkeys(TOPICS.all(), 2))
    req = RawRequest(job="j", request="r1", workers=[2, 5], window="w")

    def answers(got: RawRequest):
        base = dict(job="j", request=got.request, window="w", steps=[1])
        return [
            (TOPICS.raw, rec)
            for rec in [
                RawTrace(**{**base, "request": "someone-elses"}, worker=2, trace=b"x"),
                RawTrace(**{**base, "window": "other"}, worker=2, trace=b"x"),
                RawTrace(**base, worker=9, trace=b"x"),  # not asked
                RawTrace(**base, worker=2, trace=b"first"),
                RawTrace(**base, worker=2, trace=b"second"),
                RawTrace(**base, worker=5, error="no trace kept"),
            ]
        ]

    agents = answering(kafka, TOPICS.control, RawRequest, answers)
    got = request_raw(SETTINGS, req, timeout_s=10, clients=kafka.clients())
    agents.join(10)
    assert {w: (a.trace, a.error) for w, a in got.items()} == {2: (b"first", ""), 5: (b"", "no trace kept")}
