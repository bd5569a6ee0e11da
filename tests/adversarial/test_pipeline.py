"""Hostile records against the running stream processor (real broker, real process): each becomes a dead letter
with its reason, the processor's peak memory stays bounded, and it stays healthy."""

from __future__ import annotations

import threading
import time
import uuid

import msgspec
import pytest
from confluent_kafka import Consumer, TopicPartition

from lockstep.app.runtime import Pipeline
from lockstep.config import Settings
from lockstep.kafka import Publisher, consumer_config, ensure_topics, producer_config
from lockstep.schemas import functions as ft
from lockstep.schemas.records import DeadLetter, FeatureBatch, StepReport, WorkerMeta, decode, encode
from lockstep.streams.app import changelog_topics

pytestmark = pytest.mark.integration

TABLE = ft.make_table({"function": ["a"], "kind": ["compute"], "calls": [1], "total_us": [5.0], "critical_us": [5.0]})
BATCH = FeatureBatch(
    job="j",
    window="w",
    step=3,
    window_start=3,
    window_steps=1,
    expected_workers=2,
    worker=WorkerMeta(rank=0, host="h"),
    step_time_us=100.0,
    functions=ft.pack(TABLE),
)
REPORT = StepReport(
    job="j",
    window="w",
    step=3,
    window_start=3,
    window_steps=2,
    expected_workers=1,
    workers_seen=1,
    bytes_in=1,
    step_time_us=100.0,
    step_time_median_us=100.0,
    work_max_us=90.0,
    healthy_work_max_us=90.0,
    outliers=b"",
    groups=b"",
)


def test_payloads_that_expand_without_bound_become_dead_letters_and_the_processor_stays_small(
    kafka_bootstrap, tmp_path, hostile
):
    tag = uuid.uuid4().hex[:8]
    s = Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"h{tag}",
        processor_id=f"proc-{tag}",
        sink_group=f"sink-{tag}",
        partitions=3,
        db=tmp_path / "findings.duckdb",
        step_timeout_s=5.0,
        window_timeout_s=10.0,
    )
    topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    bomb, ipc = hostile.zstd_bomb(hostile.GiB), hostile.zstd(hostile.ipc_compressed_bomb())
    cases = {  # key -> (topic, payload, what the dead letter's detail says)
        **{
            f"fb-{i}": (
                topics.features,
                encode(msgspec.structs.replace(BATCH, job=f"fb-{i}", functions=bomb)),
                "expands beyond",
            )
            for i in range(3)
        },
        **{
            f"ipc-{i}": (
                topics.features,
                encode(msgspec.structs.replace(BATCH, job=f"ipc-{i}", functions=ipc)),
                "compressed inside",
            )
            for i in range(3)
        },
        **{
            f"sr-{i}": (
                topics.stepreports,
                encode(msgspec.structs.replace(REPORT, job=f"sr-{i}", outliers=bomb)),
                "expands beyond",
            )
            for i in range(3)
        },
    }
    dead: dict[str, DeadLetter] = {}
    halt = threading.Event()

    def follow() -> None:
        c = Consumer(consumer_config(s, None))
        c.assign([TopicPartition(topics.deadletter, p, 0) for p in range(s.partitions)])
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
        pub = Publisher(producer_config(s))
        for key, (topic, payload, _) in cases.items():
            pub.send_raw(topic, key.encode(), payload)
        pub.flush()
        deadline = time.monotonic() + 120  # a bound on waiting, not a measurement
        while set(cases) - set(dead) and time.monotonic() < deadline:
            processor.healthy()  # raises if it died
            time.sleep(0.2)
        for key, (_, payload, detail) in cases.items():
            d = dead[key]
            assert d.reason == "bad_function_table" and detail in d.detail and d.payload == payload[:65536], (key, d)
        grew = hostile.peak_rss_mb(processor.proc.pid) - before
        print(
            f"\nRELIABILITY hostile: the processor's peak memory grew {grew:.0f} MiB over {len(cases)} expanding payloads"
        )
        assert grew < 400, f"the processor's peak memory grew by {grew:.0f} MiB"  # before: 1 GiB and more per record
        assert processor.healthy()  # /healthz: ok
    finally:
        halt.set()
        reader.join(5)
        pipeline.stop()
