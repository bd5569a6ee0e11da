"""Bad input never stops a processor: it goes to the dead-letter topic with the reason."""

import time
import urllib.request

import pytest

from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.kafka import Publisher, ensure_topics, producer_config, read_all
from lockstep.schemas import functions as ft
from lockstep.schemas.records import DeadLetter, FeatureBatch, StepHeartbeat, StepReport, WorkerMeta, decode, encode
from lockstep.streams.app import changelog_topics

pytestmark = pytest.mark.integration


def test_garbage_goes_to_the_dead_letter_topic_and_processing_continues(settings, tmp_path):
    topics = ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    port, sink_port = free_port(), free_port()
    proc = Child(
        "processor",
        ["processor", *settings_flags(settings, "processor"), "--http-port", str(port)],
        tmp_path,
        f"http://127.0.0.1:{port}/healthz",
    )
    sink = Child(
        "sink",
        ["sink", *settings_flags(settings, "sink"), "--http-port", str(sink_port)],
        tmp_path,
        f"http://127.0.0.1:{sink_port}/healthz",
    )
    try:
        proc.wait_healthy(60)
        sink.wait_healthy(60)
        pub = Publisher(producer_config(settings))
        good_table = ft.pack(
            ft.make_table(
                {"function": ["f"], "kind": ["compute"], "calls": [1], "total_us": [1.0], "critical_us": [1.0]}
            )
        )
        batch = FeatureBatch(
            job="j",
            window="w1",
            step=1,
            window_start=1,
            window_steps=1,
            expected_workers=1,
            worker=WorkerMeta(rank=0, host="h"),
            step_time_us=10.0,
            functions=good_table,
        )
        truncated = encode(
            FeatureBatch(**{**{f: getattr(batch, f) for f in batch.__struct_fields__}, "functions": good_table[:20]})
        )
        pub.send_raw(topics.heartbeats, b"j", b"\x00garbage")
        pub.send_raw(topics.heartbeats, b"j", b'{"schema": "StepHeartbeat", "v": 7}')
        pub.send_raw(topics.features, b"j:1", truncated)
        pub.send_raw(topics.stepreports, b"j", b'{"schema": "Alien", "v": 1}')
        pub.send_raw(topics.findings, b"j", b'{"schema": "Finding", "v": 1, "id": 5}')
        pub.send(
            topics.heartbeats,
            "j",
            StepHeartbeat(job="j", worker=0, step=1, step_time_s=0.1, host="h", sent_at=time.time()),
        )
        pub.send(topics.features, "j:1", batch)  # a good step after the bad ones still closes
        pub.flush()

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            dls = [decode(v, DeadLetter) for _, v in read_all(settings, [topics.deadletter])[topics.deadletter]]
            reports = read_all(settings, [topics.stepreports])[topics.stepreports]
            if len(dls) >= 5 and len(reports) >= 2:
                break
            time.sleep(0.5)
        by_topic = {(d.topic, d.reason) for d in dls}
        assert by_topic == {
            (topics.heartbeats, "malformed"),
            (topics.heartbeats, "unsupported_version"),
            (topics.features, "bad_function_table"),
            (topics.stepreports, "unknown_schema"),
            (topics.findings, "invalid"),
        }, dls
        assert all(d.payload and d.detail for d in dls)
        assert proc.healthy() and sink.healthy()  # still running
        assert any(isinstance(decode(v), StepReport) and decode(v).job == "j" for _, v in reports if v[:1] != b"{")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            text = r.read().decode()
        assert 'lockstep_dead_letters_total{reason="bad_function_table",stage="steps"} 1' in text
    finally:
        proc.stop()
        sink.stop()
