"""Publishing without ever blocking: queue bound, spool while Kafka is away, resend when it returns."""

import time
from itertools import pairwise

import pytest
from confluent_kafka import KafkaError

from lockstep.broker import EmbeddedBroker, free_port
from lockstep.config import Settings
from lockstep.kafka import Clients, MemoryKafka, admin, ensure_topics, producer_config, read_all
from lockstep.kafka.memory import MemoryProducer
from lockstep.producers.agent.outbox import Outbox
from lockstep.producers.agent.spool import Spool

pytestmark = pytest.mark.integration


def outbox(bootstrap: str, spool_dir, **kw) -> Outbox:
    settings = Settings(bootstrap_servers=bootstrap)
    cfg = producer_config(
        settings,
        **{"enable.idempotence": False, "message.timeout.ms": 1500, "linger.ms": 5, "reconnect.backoff.max.ms": 500},
    )
    return Outbox(cfg, Spool(spool_dir, kw.pop("spool_max_bytes", 1 << 20)), flush_interval_s=0.05, retry_s=0.5, **kw)


def wait_for(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_records_are_published_in_batches(settings, tmp_path):
    topics = ensure_topics(settings)
    ob = outbox(settings.bootstrap_servers, tmp_path / "spool").start()
    for i in range(500):
        ob.put(topics.heartbeats, b"j", b"v%d" % i)
    ob.close()
    assert not ob.connected  # its producer went with close(): its connections do not hold a broker's stop 5 s
    values = [v for _, v in read_all(settings, [topics.heartbeats])[topics.heartbeats]]
    assert sorted(values) == sorted(b"v%d" % i for i in range(500))
    assert ob.counters.sent == 500 and ob.dropped == 0 and len(ob.spool) == 0


def test_a_full_queue_drops_the_oldest_and_counts_it(tmp_path):
    ob = Outbox(
        {}, Spool(tmp_path / "spool", 1 << 20), queue_max=10, clients=MemoryKafka().clients()
    )  # not started: nothing drains the queue
    for i in range(25):
        ob.put("t", None, b"%d" % i)
    assert ob.counters.dropped_queue == 15 and ob.dropped == 15
    assert [r for _, _, r in ob._queue] == [b"%d" % i for i in range(15, 25)]


def test_while_kafka_is_away_records_wait_in_the_spool_and_go_out_when_it_returns(tmp_path, thread_waits):
    port = free_port()
    ob = outbox(f"127.0.0.1:{port}", tmp_path / "spool").start()
    slept = thread_waits()
    for i in range(200):
        ob.put("t.heartbeats", b"j", b"hb%d" % i)
    slept = thread_waits() - slept
    assert slept < 20, slept  # put never waits for Kafka: the caller hardly ever sleeps in it (a count, not a duration)
    assert wait_for(lambda: len(ob.spool) == 200 and ob.down, 20)
    with EmbeddedBroker(port=port) as broker:  # Kafka comes back (memory storage: topics recreated)
        settings = Settings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="t", partitions=1)
        ensure_topics(settings)
        ob.put("t.heartbeats", b"j", b"after")
        assert wait_for(lambda: ob.counters.sent >= 201 and len(ob.spool) == 0, 40), (ob.counters, len(ob.spool))
        ob.close()
        values = [v for _, v in read_all(settings, ["t.heartbeats"])["t.heartbeats"]]
    assert set(values) == {b"hb%d" % i for i in range(200)} | {b"after"}
    assert ob.dropped == 0


def test_a_bounded_spool_says_what_it_dropped_and_the_next_run_sends_the_rest(tmp_path):
    port = free_port()
    ob = outbox(f"127.0.0.1:{port}", tmp_path / "spool", spool_max_bytes=256 << 10).start()
    for i in range(600):
        ob.put("t.features", b"j:1", b"%06d" % i + b"x" * 1000)
    assert wait_for(lambda: ob.counters.spooled_total == 600, 20)
    ob.close(timeout_s=1)
    assert ob.spool.dropped > 0 and ob.dropped == ob.spool.dropped
    left = len(ob.spool)
    assert left + ob.spool.dropped == 600
    with EmbeddedBroker(port=port) as broker:
        settings = Settings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="t", partitions=1)
        ensure_topics(settings)
        again = outbox(broker.bootstrap_servers, tmp_path / "spool").start()  # a restarted agent, same spool
        assert wait_for(lambda: len(again.spool) == 0, 40)
        again.close()
        values = [v for _, v in read_all(settings, ["t.features"])["t.features"]]
    assert len(values) == left
    assert sorted(int(v[:6]) for v in values) == list(range(600 - left, 600))  # the oldest were dropped


def test_records_kafka_held_when_it_went_away_reach_the_spool_before_later_ones(tmp_path):
    """When the broker goes away mid-stream, the records librdkafka still held are spooled at once and in order,
    before the records put after: the spool holds them in the order they were put, so its bound drops the oldest.
    (Before, each waited out its delivery timeout and reached the spool in runs of about ten, interleaved with the
    records spooled meanwhile: 200..208, 404..413, 209..218, ...)"""
    broker = EmbeddedBroker(port=free_port()).start()
    try:
        settings = Settings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="t", partitions=1)
        ensure_topics(settings)
        ob = outbox(broker.bootstrap_servers, tmp_path / "spool").start()
        for i in range(800):
            if i == 200:
                broker.stop()
            ob.put("t.heartbeats", b"j", b"%06d" % i)
            time.sleep(0.005)
        assert wait_for(lambda: ob.counters.sent + ob.counters.spooled_total >= 800, 30), ob.counters
        spooled = [int(v) for seg in ob.spool.segments() for _, _, v in ob.spool.read(seg)]
        ob.close(timeout_s=0)
    finally:
        broker.stop()
    assert len(spooled) >= 600
    assert spooled == sorted(spooled), [(a, b) for a, b in pairwise(spooled) if b < a][:5]


def test_an_agent_that_starts_before_the_pipeline_creates_no_topic_and_waits_for_it(tmp_path):
    """A producer must not auto-create a topic with the broker's partition count (Tansu: 4).

    CI once saw the spool's retry create ``t.heartbeats`` with 4 partitions a moment before the
    pipeline's ``ensure_topics`` (1 partition), which then refused to start.
    """
    with EmbeddedBroker() as broker:
        settings = Settings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="t", partitions=1)
        ob = outbox(broker.bootstrap_servers, tmp_path / "spool").start()
        ob.put("t.heartbeats", b"j", b"early")
        assert wait_for(lambda: ob.counters.spooled_total >= 1, 20)  # no topic: the delivery timed out
        assert "t.heartbeats" not in admin(settings).list_topics(timeout=5).topics
        ensure_topics(settings)  # the pipeline starts: its partition count, not the broker's
        assert wait_for(lambda: ob.counters.sent == 1 and len(ob.spool) == 0, 40), (ob.counters, len(ob.spool))
        ob.close()
        assert read_all(settings, ["t.heartbeats"])["t.heartbeats"] == [(b"j", b"early")]


def test_a_lazy_outbox_holds_a_producer_only_while_it_has_records_to_send(tmp_path):
    kafka = MemoryKafka({"t": 1})
    made = []
    clients = kafka.clients()
    counting = type(clients)(
        producer=lambda config: made.append(clients.producer(config)) or made[-1], consumer=clients.consumer
    )
    ob = Outbox(
        {}, Spool(tmp_path / "spool", 1 << 20), flush_interval_s=0.02, clients=counting, lazy=True, idle_close_s=0.1
    ).start()
    try:
        time.sleep(0.1)
        assert not ob.connected and made == []  # nothing to send: no Kafka client
        ob.put("t", b"k", b"one")
        assert wait_for(lambda: ob.counters.sent == 1, 5)
        assert wait_for(lambda: not ob.connected, 5) and len(made) == 1  # idle: closed again
        ob.put("t", b"k", b"two")
        assert wait_for(lambda: ob.counters.sent == 2, 5) and len(made) == 2
    finally:
        ob.close()
    assert [m.value() for m in kafka.messages("t")] == [b"one", b"two"]


class _InFlight(MemoryProducer):
    """A producer whose delivery reports wait until the test releases them (records in flight), with the error it
    chooses."""

    def poll(self, timeout: float = 0.0) -> int:
        return 0

    def release(self, n: int, err: KafkaError | None = None) -> None:
        reports, self._reports = self._reports[:n], self._reports[n:]
        for callback, own, msg in reports:
            callback(err if err is not None else own, msg)


def test_a_replay_kafka_drops_midway_leaves_its_segment_where_it_is(tmp_path):
    """Kafka answers a probe, the oldest segment is replayed, and Kafka goes away again with half of it in flight.
    The records spooled meanwhile come after the segment's, not before the rest of it: the spool stays in the order
    the records were put, so that its bound drops the oldest (a CI run once lost a run of newer steps of an outage
    while older ones, spooled again at the tail, survived).  The segment is replayed again later, whole: what was
    delivered of it may arrive twice (at-least-once)."""
    kafka = MemoryKafka({"t": 1})
    producers: list[_InFlight] = []

    def producer(config):
        producers.append(_InFlight(kafka))
        return producers[-1]

    clients = Clients(producer=producer, consumer=kafka.clients().consumer)
    ob = Outbox({}, Spool(tmp_path / "spool", 1 << 20), flush_interval_s=0.05, retry_s=100.0, clients=clients)
    ob._mark_down("the test")
    for i in range(10):
        ob.put("t", None, b"%02d" % i)
    ob._next_probe = 0.0  # the next round probes: Kafka answers, and the spool's oldest segment is replayed
    ob.pump()
    assert not ob.down and len(producers[0]) == 10  # 00..09 in flight
    producers[0].release(5)  # 00..04 delivered
    producers[0].release(1, KafkaError(KafkaError._MSG_TIMED_OUT))  # 05 timed out: Kafka is away again
    assert ob.down
    for i in range(10, 15):
        ob.put("t", None, b"%02d" % i)
    ob.pump()  # 10..14 to the spool at once
    producers[0].release(4, KafkaError(KafkaError._MSG_TIMED_OUT))  # 06..09 time out too
    spooled = [int(v) for seg in ob.spool.segments() for _, _, v in ob.spool.read(seg)]
    assert spooled == sorted(spooled), spooled
    assert set(spooled) >= set(range(5, 15))
