"""Records compressed at the Kafka level: what the clients inflate before any Lockstep check sees a record.

librdkafka (confluent-kafka: the sink, the agents' control readers, the command-line tails) inflates a zstd batch into
a buffer capped by ``receive.message.max.bytes`` and refuses a batch that would exceed it (``_BAD_COMPRESSION``, the
batch skipped); it has no such cap for lz4, gzip or snappy, and aiokafka (faust: the processor) has none for any codec
(RELIABILITY.md, "Hostile input").  This holds the one bound there is: a zstd batch inflating past
``receive.message.max.bytes`` (34 MiB with Lockstep's consumer settings) is refused without being inflated.  It is a
guard against a client or library change (librdkafka 2.16's growth steps refuse 80 MB even at its 100 MB default),
not the test of a fix: no client setting bounds the other codecs.  The partition stalls behind it (librdkafka fetches the batch again and
reports ``_BAD_COMPRESSION`` each time): bounded memory, not progress."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from lockstep.kafka.clients import MAX_BATCH_BYTES

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
