"""Records compressed at the Kafka level: what the clients inflate before any Lockstep check sees a record.

librdkafka (confluent-kafka: the sink, the agents' control readers, the command-line tails) inflates a zstd batch into
a buffer capped by ``receive.message.max.bytes`` and refuses a batch that would exceed it (``_BAD_COMPRESSION``, the
batch skipped); it has no such cap for lz4, gzip or snappy, and aiokafka (faust: the processor) has none for any codec
(RELIABILITY.md, "Hostile input").  This holds the one bound there is: a zstd batch inflating past
``receive.message.max.bytes`` (34 MiB with Lockstep's consumer settings) is refused without being inflated.  It is a
guard against a client or library change (librdkafka 2.16's growth steps refuse 80 MB even at its 100 MB default),
not the test of a fix: no client setting bounds the other codecs.  The partition stalls behind it (librdkafka fetches the batch again and
reports ``_BAD_COMPRESSION`` each time): bounded memory, not progress.

The processor (aiokafka, through faust) is bounded by Lockstep itself (:mod:`lockstep.kafka.inflate`): a batch of any
codec inflating past ``MAX_BATCH_BYTES`` is skipped unread, counted, and the records after it are read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from lockstep.app.runtime import Pipeline
from lockstep.config import Settings
from lockstep.kafka import consumer_config, ensure_topics
from lockstep.kafka.clients import MAX_BATCH_BYTES
from lockstep.metrics import value
from lockstep.schemas.records import DeadLetter, decode
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real broker, an 80 MB record, a consumer of its own

RECORD = 80 << 20  # past our receive.message.max.bytes

CONSUME = textwrap.dedent(
    """
    import json, sys, time
    from confluent_kafka import Consumer
    from lockstep.config import Settings
    from lockstep.kafka.clients import consumer_config

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

    bootstrap, topic = sys.argv[1], sys.argv[2]
    cfg = consumer_config(Settings(bootstrap_servers=bootstrap), "bomb-" + topic)
    cfg.pop("logger")
    before = hwm()
    consumer = Consumer(cfg)
    consumer.subscribe([topic])
    got, errors, t0 = [], [], time.monotonic()
    while time.monotonic() - t0 < 60 and not got and len(errors) < 5:
        m = consumer.poll(0.5)
        if m is None:
            continue
        if m.error():
            errors.append(m.error().name())
        else:
            got.append(len(m.value()))
    consumer.close()
    print("RESULT " + json.dumps({"got": got, "errors": sorted(set(errors)), "grew_mb": hwm() - before}))
    """
)


def test_a_zstd_batch_inflating_past_receive_message_max_bytes_is_refused_uninflated(kafka_bootstrap):
    topic = "zstd-bomb"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "compression.type": "zstd",
            "message.max.bytes": 1_000_000_000,
            "linger.ms": 0,
        }
    )
    p.produce(topic, b"\0" * RECORD)  # ~10 KB on the wire
    p.flush(60)
    p.produce(topic, b"after")  # a batch of its own
    p.flush(60)
    done = subprocess.run(
        [sys.executable, "-c", CONSUME, kafka_bootstrap, topic], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert RECORD not in result["got"], result  # never delivered (the records after it are not either: librdkafka
    assert "_BAD_COMPRESSION" in result["errors"], result  # fetches the batch again and again, the partition stalls)
    assert result["grew_mb"] < (MAX_BATCH_BYTES >> 20) + 64, result  # never the 80 MB inflated


BOMB = 200 << 20  # each codec's batch: 200 MiB of zeros (zstd ~7 KB on the wire ... snappy ~9.6 MB)


def test_the_processor_skips_batches_inflating_past_its_bound_and_reads_the_records_after_them(
    kafka_bootstrap, tmp_path, hostile
):
    """A batch of each codec, holding a 200 MiB record, then a record the heartbeat stage refuses (``malformed``: a dead
    letter we can see).  Before: aiokafka inflated each batch whole (the processor +610 MiB), and with a codec that
    raised but no skip, faust's worker crashed (exit 1) and would fetch the same batch again after every restart."""
    tag = uuid.uuid4().hex[:8]
    s = Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"z{tag}",
        processor_id=f"proc-{tag}",
        sink_group=f"sink-{tag}",
        partitions=1,
        db=tmp_path / "findings.duckdb",
    )
    topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    codecs = ("zstd", "lz4", "gzip", "snappy")
    dead: dict[str, DeadLetter] = {}
    halt = threading.Event()

    def follow() -> None:
        c = Consumer(consumer_config(s, None))
        c.assign([TopicPartition(topics.deadletter, 0, 0)])
        try:
            while not halt.is_set():
                for msg in c.consume(100, timeout=0.2):
                    if not msg.error():
                        dead[msg.key().decode()] = decode(msg.value(), DeadLetter)
        finally:
            c.close()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    pipeline = Pipeline(s, tmp_path)
    try:
        processor = pipeline.start("processor")
        before = hostile.peak_rss_mb(processor.proc.pid)
        zeros = b"\0" * BOMB
        for codec in codecs:
            p = Producer(
                {
                    "bootstrap.servers": kafka_bootstrap,
                    "compression.type": codec,
                    "message.max.bytes": 1_000_000_000,
                    "linger.ms": 0,
                }
            )
            p.produce(topics.heartbeats, zeros, key=f"bomb-{codec}".encode(), partition=0)
            p.flush(60)
            p.produce(topics.heartbeats, b"not a record", key=f"after-{codec}".encode(), partition=0)  # its own batch
            p.flush(60)
        del zeros
        want = {f"after-{codec}" for codec in codecs}
        deadline = time.monotonic() + 120  # a bound on waiting, not a measurement
        while want - set(dead) and time.monotonic() < deadline:
            processor.healthy()  # raises if it died
            time.sleep(0.2)
        grew = hostile.peak_rss_mb(processor.proc.pid) - before
        skipped = value(pipeline.metrics("processor"), "lockstep_kafka_batches_skipped_total", topic=topics.heartbeats)
        print(f"\nRELIABILITY kafka bombs: the processor's peak memory grew {grew:.0f} MiB over {len(codecs)} batches")
        assert grew < 150, f"the processor's peak memory grew by {grew:.0f} MiB"  # before: 610 MiB (2x BOMB)
        assert want <= set(dead), (sorted(dead), processor.tail(30))  # the records after each bomb were read
        assert all(dead[k].reason == "malformed" for k in want), {k: dead[k].reason for k in want}
        assert not [k for k in dead if k.startswith("bomb-")]  # never delivered (before: inflated, then refused)
        assert skipped == len(codecs), skipped
        assert processor.healthy()
        log = processor.log_path.read_text()
        assert all(f"offsets {n}..{n}" in log for n in (0, 2, 4, 6)), processor.tail(30)  # each bomb named
    finally:
        halt.set()
        reader.join(5)
        pipeline.stop()
