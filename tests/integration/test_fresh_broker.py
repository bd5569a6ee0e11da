"""A sink that resumes its stored offsets on a fresh broker (Kafka's data lost, the embedded broker restarted: it keeps
nothing) does not skip the new log's records: with the real embedded broker, a real DuckDB file and the real sink.

Two ways a new log shows: offsets beyond its end (checked by the log's end where the topic id is not known; the
embedded broker answers a fetch there with nothing, so the sink would wait for ever) and offsets inside it (only the
topic id, stored with the offsets, tells: resuming there would skip the records before it)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading

import pytest

from lockstep.broker import EmbeddedBroker, free_port
from lockstep.kafka import Publisher, admin, consumer_config, ensure_topics, producer_config, topic_ids
from lockstep.sinks.http import wait_for
from lockstep.sinks.sink import Sink
from lockstep.sinks.store import FindingsStore
from tests.integration.test_paging import finding

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # brokers started and stopped, a sink per phase


def publish(s, topics, job: str, n: int) -> set[str]:
    publisher = Publisher(producer_config(s))
    ids = set()
    try:
        for i in range(n):
            f = finding(window=f"w{i}", job=job, steps=(100 * i, 100 * i + 1))
            publisher.send(topics.findings, f.job, f)
            publisher.flush()  # one record per batch: the offsets are the record counts
            ids.add(f.id)
    finally:
        publisher.close()
    return ids


def sink_until(s, topics, want: set[str], with_ids: bool) -> set[str]:
    """Run the sink until the file holds ``want`` (or 60 s); returns the finding ids stored."""
    store = FindingsStore(s.db)
    sink = Sink(
        store,
        consumer_config(s, s.sink_group),
        [topics.findings],
        topics.deadletter,
        Publisher(producer_config(s)),
        topic_ids=(lambda names: topic_ids(admin(s), names)) if with_ids else None,
    )
    t = threading.Thread(target=sink.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: want <= stored(store), 60)
        return stored(store)
    finally:
        sink.stop()
        t.join(30)
        sink.publisher.close()
        store.close()
        # the sink's producer keeps its connection until it is freed, and the sink is in a reference cycle (its
        # consumer holds its callbacks): collect it now, or the broker's stop waits 5 s for that connection to close
        del sink
        gc.collect()


def offsets(s) -> dict:
    store = FindingsStore(s.db)
    try:
        return store.stored_offsets()
    finally:
        store.close()


def stored(store: FindingsStore) -> set[str]:
    return {r[0] for r in store.con.cursor().execute("SELECT id FROM findings").fetchall()}


def test_a_sink_on_a_fresh_broker_reads_the_new_log_from_its_beginning(settings, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lockstep.sink")
    port = free_port()
    s = dataclasses.replace(settings, bootstrap_servers=f"127.0.0.1:{port}", partitions=1)

    # 1. five records read and their offsets stored (with the topic's id)
    with EmbeddedBroker(port=port) as _:
        topics = ensure_topics(s)
        first = publish(s, topics, "a", 5)
        assert sink_until(s, topics, first, with_ids=True) == first
    assert offsets(s)[(topics.findings, 0)][0] == 5

    # 2. a fresh broker, three records: the stored offset 5 is beyond the new log's end (topic ids not asked)
    with EmbeddedBroker(port=port) as _:
        topics = ensure_topics(s)
        second = publish(s, topics, "b", 3)
        assert sink_until(s, topics, first | second, with_ids=False) == first | second
    assert "beyond the log's end" in caplog.text
    assert offsets(s)[(topics.findings, 0)] == (3, None)  # ids not asked: none stored

    # 3. once more with the ids, to store this log's id ...
    caplog.clear()
    with EmbeddedBroker(port=port) as _:
        topics = ensure_topics(s)
        third = publish(s, topics, "c", 2)
        assert sink_until(s, topics, first | second | third, with_ids=True) == first | second | third
    # ... then a fresh broker with more records than the stored offset: inside the new log, only the id tells
    with EmbeddedBroker(port=port) as _:
        topics = ensure_topics(s)
        fourth = publish(s, topics, "d", 6)
        assert sink_until(s, topics, first | second | third | fourth, with_ids=True) == first | second | third | fourth
    assert "is of another log (topic id" in caplog.text
