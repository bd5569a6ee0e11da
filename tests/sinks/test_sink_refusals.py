"""The sink never stops on a record its store refuses: it writes the batch one record at a time, sends the
refused one to the dead-letter topic and moves its offsets past it (else it would stop again on restart).
And it reads on from the offsets it stored with its rows.  Kafka in memory (MemoryKafka); the sink against
the real broker: tests/integration/test_reliability.py."""

from __future__ import annotations

import threading

import duckdb
import msgspec

from lockstep.kafka import MemoryKafka, Publisher
from lockstep.schemas.records import DeadLetter, Evidence, Finding, Impact, decode, encode, finding_id
from lockstep.sinks.http import wait_for
from lockstep.sinks.sink import Sink
from lockstep.sinks.store import FindingsStore


class Refusing(FindingsStore):
    """A real store that refuses one finding id, as DuckDB refuses a value it cannot convert."""

    refuse = ""

    def write(self, batch, now=None):
        if any(f.id == self.refuse for f in batch.findings):
            raise duckdb.ConversionException("Conversion Error: value out of range")
        return super().write(batch, now)


class Message:
    def __init__(self, offset: int, value: bytes):
        self._offset, self._value = offset, value

    def error(self):
        return None

    def topic(self):
        return "t.findings"

    def partition(self):
        return 0

    def offset(self):
        return self._offset

    def key(self):
        return b"j"

    def value(self):
        return self._value

    def timestamp(self):
        return (1, 1_800_000_000_000)


def memory_sink(store: FindingsStore) -> tuple[Sink, MemoryKafka]:
    """A sink whose Kafka clients are in memory: ``write`` is given the messages, dead letters land in the memory topic."""
    kafka = MemoryKafka({"t.findings": 1, "t.deadletter": 1})
    return Sink(
        store, {}, ["t.findings"], "t.deadletter", Publisher({}, clients=kafka.clients()), clients=kafka.clients()
    ), kafka


def finding(worker: int) -> Finding:
    return Finding(
        id=finding_id("j", "w1", "worker", [worker], "fwd.gemm", "gpu_slow", None),
        job="j",
        window="w1",
        steps=[1],
        scope="worker",
        workers=[worker],
        hosts=["h"],
        devices=[f"h/gpu{worker}"],
        function="fwd.gemm",
        function_kind="compute",
        cause="gpu_slow",
        confidence=0.9,
        evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=9.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=2.0),
        policy="p@h",
        created_at=1.8e9,
        window_steps=1,
    )


def test_a_refused_record_becomes_a_dead_letter_and_the_rest_is_stored(tmp_path):
    store = Refusing(tmp_path / "f.duckdb")
    fs = [finding(w) for w in range(4)]
    store.refuse = fs[2].id
    sink, kafka = memory_sink(store)
    sink.write([Message(10 + i, encode(f)) for i, f in enumerate(fs)])
    stored = {r[0] for r in store.con.execute("SELECT id FROM findings").fetchall()}
    assert stored == {f.id for f in fs} - {fs[2].id}
    assert store.offsets() == {("t.findings", 0): 14}
    (msg,) = kafka.messages("t.deadletter")
    dl = decode(msg.value(), DeadLetter)
    assert (msg.key(), dl.reason, dl.offset, dl.stage) == (b"j", "processing_failed", 12, "sink")
    assert "findings store refused it" in dl.detail and msgspec.json.decode(dl.payload)["id"] == fs[2].id
    assert sink.metrics.get("dead_letters_total", reason="processing_failed", stage="sink") == 1
    store.close()


def test_record_text_cannot_grow_or_break_the_metrics(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    sink, _ = memory_sink(store)
    odd = [
        msgspec.structs.replace(finding(w), id=f"odd{w}", cause=f'made-up-{w}"}}\nlockstep_fake 1') for w in range(50)
    ]
    sink.write([Message(i, encode(f)) for i, f in enumerate([finding(1), *odd])])
    assert sink.metrics.get("findings_written_total", cause="gpu_slow") == 1
    assert sink.metrics.get("findings_written_total", cause="other") == 50  # one label, not one per cause string
    sink.metrics.inc("agent_dropped_records", job='evil"}\nlockstep_fake 1')  # a job name is a record's text too
    rendered = sink.metrics.render()
    assert "lockstep_fake" not in [line.split("{")[0].split(" ")[0] for line in rendered.splitlines()]
    assert 'job="evil\\"}\\nlockstep_fake 1"' in rendered
    store.close()


def test_a_restarted_sink_reads_on_from_the_offsets_stored_with_the_rows(tmp_path):
    """Kafka's committed offsets are not trusted: on assignment the sink seeks to the offsets in DuckDB."""
    store = FindingsStore(tmp_path / "f.duckdb")
    kafka = MemoryKafka({"t.findings": 1, "t.deadletter": 1})
    pub = Publisher({}, clients=kafka.clients())

    def run_sink_until(written: int) -> Sink:
        sink = Sink(store, {}, ["t.findings"], "t.deadletter", pub, clients=kafka.clients())
        thread = threading.Thread(target=sink.run, daemon=True)
        thread.start()
        assert wait_for(lambda: sink.metrics.get("findings_written_total", cause="gpu_slow") == written, 10)
        sink.stop()
        thread.join(10)
        return sink

    for w in range(3):
        pub.send("t.findings", "j", finding(w))
    pub.flush()
    first = run_sink_until(3)
    pub.send("t.findings", "j", finding(3))
    pub.flush()
    again = run_sink_until(1)
    assert first.metrics.get("records_in_total", topic="t.findings") == 3
    assert again.metrics.get("records_in_total", topic="t.findings") == 1  # not the three it had stored
    assert store.offsets() == {("t.findings", 0): 4}
    assert store.con.execute("SELECT count(*) FROM findings").fetchone() == (4,)
    store.close()
