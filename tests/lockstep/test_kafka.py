"""The Kafka package's logic in memory (MemoryKafka): tails from the end and the start, decoding and filtering,
a request and its answers, delivery accounting.  The same code against the embedded broker: the integration
tests (tests/integration, tests/producers/agent/test_outbox.py)."""

from __future__ import annotations

import threading

import pytest

from lockstep.kafka import Clients, DeliveryError, MemoryKafka, Publisher, Tail, TopicError, ask
from lockstep.schemas.records import ProfileTrigger, TriggerRefused, TriggerRequest, decode, encode

TOPICS = {"t.control": 3, "t.heartbeats": 3}


def trigger(job: str = "j", window: str = "w1") -> ProfileTrigger:
    return ProfileTrigger(job=job, window=window, start_step=10, steps=4, expected_workers=8)


def test_a_tail_sees_what_arrives_after_it_opened_and_from_the_start_everything():
    kafka = MemoryKafka(TOPICS)
    pub = Publisher({}, clients=kafka.clients())
    pub.send("t.control", "j", trigger(window="before"))
    pub.flush()
    with (
        Tail({}, "t.control", clients=kafka.clients()).open() as tail,
        Tail({}, "t.control", from_start=True, clients=kafka.clients()).open() as whole,
    ):
        assert tail.records(ProfileTrigger) == []
        pub.send("t.control", "j", trigger(window="after"))
        pub.flush()
        assert [t.window for t in tail.records(ProfileTrigger)] == ["after"]
        assert sorted(decode(m.value).window for m in whole.read_to_end(quiet_s=0.01)) == ["after", "before"]


def test_a_tail_keeps_the_records_asked_for_skips_other_types_and_counts_unreadable_ones():
    kafka = MemoryKafka(TOPICS)
    with Tail({}, "t.control", clients=kafka.clients()).open() as tail:
        pub = Publisher({}, clients=kafka.clients())
        pub.send("t.control", "j", trigger(job="j"))
        pub.send("t.control", "k", trigger(job="k", window="w2"))  # another job
        pub.send(
            "t.control", "j", TriggerRefused(job="j", request="r", code="cooldown", reason="later")
        )  # another type
        pub.send_raw("t.control", b"j", b"{not a record")
        pub.flush()
        got = tail.records(ProfileTrigger, where=lambda t: t.job == "j")
    assert [(t.job, t.window) for t in got] == [("j", "w1")]
    assert tail.bad_records == 1


def test_a_tail_of_a_missing_topic_says_so_and_holds_no_consumer():
    opened = []
    kafka = MemoryKafka(TOPICS)

    def consumer(config):
        opened.append(kafka.clients().consumer(config))
        return opened[-1]

    tail = Tail({"bootstrap.servers": "k:9092"}, ["t.control", "t.nope"], clients=Clients(consumer=consumer))
    with pytest.raises(TopicError, match=r"topic t\.nope does not exist at k:9092"):
        tail.open()
    assert not tail.is_open and opened[0].closed


def test_ask_returns_the_answer_to_its_request_only():
    kafka = MemoryKafka(TOPICS)
    clients = kafka.clients()
    ready = threading.Event()

    def detector() -> None:  # answers the first request on the heartbeats topic, after someone else's answer
        with Tail({}, "t.heartbeats", clients=clients).open() as requests:
            ready.set()
            (req,) = requests.records(TriggerRequest, timeout_s=10)
            out = Publisher({}, clients=clients)
            out.send(
                "t.control", req.job, TriggerRefused(job=req.job, request="someone-else", code="cooldown", reason="no")
            )
            out.send(
                "t.control",
                req.job,
                TriggerRefused(job=req.job, request=req.request, code="cooldown", reason="in cool-down"),
            )
            out.flush()

    thread = threading.Thread(target=detector, daemon=True)
    thread.start()
    assert ready.wait(10)
    req = TriggerRequest(job="j", request="r1")
    with Tail({}, "t.control", clients=clients) as answers:
        got = ask(
            Publisher({}, clients=clients),
            "t.heartbeats",
            "j",
            req,
            answers,
            (ProfileTrigger, TriggerRefused),
            where=lambda rec: rec.request == req.request,
            timeout_s=10,
        )
    thread.join(10)
    assert [(a.request, a.reason) for a in got] == [("r1", "in cool-down")]


def test_ask_gives_up_with_no_answer():
    kafka = MemoryKafka(TOPICS)
    with Tail({}, "t.control", clients=kafka.clients()) as answers:
        got = ask(
            Publisher({}, clients=kafka.clients()),
            "t.heartbeats",
            "j",
            TriggerRequest(job="j", request="r"),
            answers,
            TriggerRefused,
            where=lambda rec: True,
            timeout_s=0.1,
        )
    assert got == []
    assert [decode(m.value()).request for m in kafka.messages("t.heartbeats")] == ["r"]  # it was sent


def test_the_publisher_counts_deliveries_and_flush_raises_when_a_record_was_not_delivered():
    kafka = MemoryKafka(TOPICS)
    pub = Publisher({}, clients=kafka.clients())
    size = pub.send("t.control", "j", trigger())
    pub.flush()
    assert (pub.stats.records["t.control"], pub.stats.bytes["t.control"]) == (1, size) == (1, len(encode(trigger())))
    pub.send("t.missing", "j", trigger())
    with pytest.raises(DeliveryError, match=r"1 record\(s\) were not delivered: t\.missing: "):
        pub.flush()
    assert pub.stats.failed["t.missing"] == 1


def test_every_client_and_topic_bounds_the_batches_it_sends_fetches_and_accepts(tmp_path):
    """Explicit message and fetch limits (librdkafka's defaults: 1 MB sent, 50 MB fetched, 100 MB a response; the
    embedded broker enforces none), all at the largest record a stage reads plus the batch's framing."""
    from lockstep.config import Settings
    from lockstep.kafka.clients import MAX_BATCH_BYTES, agent_producer_config, consumer_config, producer_config
    from lockstep.schemas.records import MAX_RECORD_BYTES

    settings = Settings(bootstrap_servers="127.0.0.1:1", db=tmp_path / "f.duckdb")
    assert MAX_RECORD_BYTES < MAX_BATCH_BYTES <= MAX_RECORD_BYTES + (4 << 20)
    for cfg in (producer_config(settings), agent_producer_config(settings, 5.0)):
        assert cfg["message.max.bytes"] == MAX_BATCH_BYTES
    cfg = consumer_config(settings, "g")
    assert cfg["fetch.max.bytes"] == cfg["max.partition.fetch.bytes"] == MAX_BATCH_BYTES
    assert cfg["receive.message.max.bytes"] > MAX_BATCH_BYTES


def test_check_reachable_names_each_address_and_what_failed_and_passes_when_one_listens():
    import socket

    from lockstep.config import ConfigError
    from lockstep.kafka import EXIT_UNAVAILABLE, KafkaUnavailable, check_reachable

    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(KafkaUnavailable) as err:
            check_reachable(f"{refused},no-such-host.invalid:9092", 2.0)
        assert str(err.value).startswith(f"cannot reach Kafka at {refused}: connection refused; no-such-host.invalid")
        assert err.value.exit_code == EXIT_UNAVAILABLE == 69
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen(1)
            check_reachable(f"{refused},PLAINTEXT://127.0.0.1:{listening.getsockname()[1]}", 2.0)  # the second one
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        check_reachable("kafka-without-port", 1.0)
