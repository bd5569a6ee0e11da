"""Crash tests with real processes: the stream processor and the DuckDB sink killed with SIGKILL and
restarted, against the real broker, a real DuckDB file and a real webhook receiver.

What they prove (RELIABILITY.md quotes the figures they print): every finding of every window is in
DuckDB exactly once, its incident opened once, its page sent once; nothing lost.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka import Consumer, TopicPartition

from lockstep.app.evaluate import diagnose_one
from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, consumer_config, ensure_topics, features_key, producer_config, read_all
from lockstep.metrics import value
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import Evidence, Finding, Impact, WindowReport, decode, finding_id
from lockstep.sinks.http import query
from lockstep.streams.app import changelog_topics
from lockstep.streams.policy import load_policy

pytestmark = pytest.mark.integration

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()


class Receiver:
    """A real HTTP server that accepts every page (202) and keeps what it got."""

    def __init__(self):
        self.pages: list[tuple[str, dict]] = []  # (webhook-id, body)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                receiver.pages.append((self.headers["webhook-id"], body))
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def pipeline(settings, tmp_path, receiver, monkeypatch):
    """Topics, a routes file paging the receiver, and a Pipeline whose children are stopped at the end."""
    monkeypatch.setenv("RELIABILITY_HOOK_SECRET", SECRET)  # the sink child inherits it
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"version: 1\nroutes:\n  - {{name: hook, type: webhook, url: '{receiver.url}', secret_env: RELIABILITY_HOOK_SECRET}}\n"
    )
    settings.routes = routes
    settings.step_timeout_s = 60.0  # nothing may close by timeout while a process is down
    settings.window_timeout_s = 120.0
    ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    p = Pipeline(settings, tmp_path)
    yield p
    p.stop()


def until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def sql(settings, text: str, params=None) -> list[list]:
    return query(settings.db, text, params)[1]


def check_stored_once(settings, receiver, expected_ids: set[str], windows: int) -> dict:
    """Every expected finding in DuckDB once, one incident per problem, one page per incident."""
    rows = sql(settings, "SELECT id, incident_id FROM findings")
    assert Counter(r[0] for r in rows) == Counter(expected_ids), rows
    incidents = {r[1] for r in rows}
    events = sql(settings, "SELECT incident_id, action, finding_id FROM incident_events")
    assert Counter((e[0], e[1]) for e in events if e[1] == "trigger") == Counter((i, "trigger") for i in incidents)
    assert len({e[2] for e in events}) == len(events), "an incident event was appended twice for one finding"
    assert sql(settings, "SELECT count(*) FROM windows")[0][0] == windows
    until(lambda: len(receiver.pages) >= len(incidents), 30, "the pages")
    time.sleep(1.0)  # a duplicate page would arrive now
    # one page per incident; the only repeat allowed is a delivery re-sent after a crash between the receiver's
    # 2xx and the sink's record of it, with the same webhook-id (receivers deduplicate on it; ARCHITECTURE.md)
    ids_of = {}
    for pid, body in receiver.pages:
        assert body["type"] == "incident.triggered"
        ids_of.setdefault(body["data"]["incident"]["id"], set()).add(pid)
    assert sorted(ids_of) == sorted(incidents)
    assert all(len(pids) == 1 for pids in ids_of.values()), ids_of
    return {
        "findings": len(rows),
        "incidents": len(incidents),
        "pages": len(receiver.pages),
        "pages re-sent with the same webhook-id": len(receiver.pages) - len(ids_of),
    }


# ---------------------------------------------------------------------------------------- processor


def test_processor_killed_mid_window_and_after_publishing_loses_and_duplicates_nothing(settings, pipeline, receiver):
    """Two windows of one 16-worker job with two faults.  Window w60: SIGKILL while it is open and one of
    its steps is half consumed (after a commit).  Window w80: SIGKILL as soon as its findings are
    published (before the next commit, so the restart replays a window that is already closed)."""
    topics = ensure_topics(settings)
    scenario = Scenario(
        job="crash-job",
        topology=Topology(workers=16, gpus_per_host=8),
        faults=(
            Fault(type="gpu_throttle_thermal", workers=(5,), severity=0.3),
            Fault(type="dataloader", workers=(11,), severity=0.5),
        ),
    )
    fleet = FleetSimulator(scenario)
    windows = [Window(60, 8), Window(80, 8)]
    expected = {w.name: {f.id for f in diagnose_one(fleet, load_policy(None), w).findings} for w in windows}
    assert all(len(ids) == 2 for ids in expected.values())
    pub = Publisher(producer_config(settings))
    n = scenario.topology.workers

    def publish(window: Window, step: int, workers=slice(None)) -> None:
        batches = fleet.feature_batches(fleet.step(step), fleet.trigger(window))[workers]
        for b in batches:
            pub.send(topics.features, features_key(scenario.job, step), b)
        pub.flush()

    pipeline.start("sink")
    pipeline.start("processor")
    m = lambda name, **labels: value(pipeline.metrics("processor"), f"lockstep_{name}", **labels)  # noqa: E731

    # --- w60: three steps reported, the fourth half consumed, then a commit, then SIGKILL
    w = windows[0]
    for step in w.range[:3]:
        publish(w, step)
    publish(w, w.start_step + 3, slice(0, n // 2))
    until(
        lambda: (
            m("records_in_total", topic=topics.features) == 3 * n + n // 2
            and m("records_in_total", topic=topics.stepreports) == 3
        ),
        60,
        "the processor to consume 3.5 steps",
    )
    assert (m("open_steps"), m("open_windows")) == (1, 1)
    time.sleep(2.5)  # faust commits every second: the committed offset now sits on the open records
    committed = committed_offsets(settings, topics.features)
    pipeline.kill("processor")
    # in-order acks: the closed steps' partitions are committed to their end, the open step's is not
    open_partition = partition_of(settings, topics.features, features_key(scenario.job, w.start_step + 3))
    ends = {p: end_offset(settings, topics.features, p) for p in committed}
    assert committed[open_partition] < ends[open_partition]
    assert all(max(0, committed[p]) == ends[p] for p in committed if p != open_partition), (committed, ends)
    t0 = time.monotonic()
    pipeline.start("processor")
    figures = {"w60 restart to healthy s": round(time.monotonic() - t0, 1)}
    publish(w, w.start_step + 3, slice(n // 2, None))
    for step in w.range[4:]:
        publish(w, step)
    t1 = time.monotonic()
    until(
        lambda: sql(settings, "SELECT count(*) FROM windows WHERE window_id = 'w60'")[0][0], 120, "window w60 in DuckDB"
    )
    figures["w60 last record to window in DuckDB s"] = round(time.monotonic() - t1, 1)
    figures["w60 features replayed"] = m("records_in_total", topic=topics.features) - (n - n // 2) - 4 * n

    # --- w80: SIGKILL the moment its findings are out
    w = windows[1]
    before = m("findings_total", cause="dataloader")
    for step in w.range:
        publish(w, step)
    until(lambda: m("findings_total", cause="dataloader") > before, 120, "the findings of w80", interval_s=0.02)
    pipeline.kill("processor")
    t0 = time.monotonic()
    pipeline.start("processor")  # healthy once the group dropped the killed member (its session timeout) and rebalanced
    figures["w80 restart to healthy s"] = round(time.monotonic() - t0, 1)
    until(
        lambda: sql(settings, "SELECT count(*) FROM windows WHERE window_id = 'w80'")[0][0], 120, "window w80 in DuckDB"
    )
    time.sleep(3.0)  # let a replay that would re-publish do so
    figures["w80 replayed (features, step reports, step reports of closed windows dropped)"] = (
        m("records_in_total", topic=topics.features),
        m("records_in_total", topic=topics.stepreports),
        m("late_records_total", stage="windows"),
    )

    got = check_stored_once(settings, receiver, expected["w60"] | expected["w80"], windows=2)
    closed = sql(settings, "SELECT window_id, closed, coverage FROM windows ORDER BY window_id")
    assert closed == [["w60", "complete", 1.0], ["w80", "complete", 1.0]]
    published = Counter(decode(v, Finding).id for _, v in read_all(settings, [topics.findings])[topics.findings])
    print(
        f"\nRELIABILITY processor-kill: {got}; {figures}; finding records on the topic {sum(published.values())} "
        f"(replays absorbed by the sink: {sum(published.values()) - len(published)})"
    )


def committed_offsets(settings, topic: str) -> dict[int, int]:
    c = Consumer(consumer_config(settings, settings.processor_id))
    try:
        tps = c.committed([TopicPartition(topic, p) for p in range(settings.partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        c.close()


def end_offset(settings, topic: str, partition: int) -> int:
    """The real end of a partition (the records in it; Tansu's high watermark can be lower)."""
    c = Consumer(consumer_config(settings, None))
    try:
        c.assign([TopicPartition(topic, partition, 0)])
        last = -1
        while msgs := c.consume(1000, timeout=1.0):
            last = max([last] + [msg.offset() for msg in msgs if not msg.error()])
        return last + 1
    finally:
        c.close()


def partition_of(settings, topic: str, key: bytes) -> int:
    """Where murmur2 puts a key: read it back from the topic."""
    c = Consumer(consumer_config(settings, None))
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(settings.partitions)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for msg in c.consume(1000, timeout=0.5):
                if not msg.error() and msg.key() == key:
                    return msg.partition()
        raise AssertionError(f"no record keyed {key!r} in {topic}")
    finally:
        c.close()


# ---------------------------------------------------------------------------------------- sink

JOBS, PROBLEMS, WINDOWS = 20, 10, 15  # 200 problems (incidents), each seen in 15 windows: 3,000 findings


def sink_stream() -> list[tuple[str, str, object]]:
    """(topic kind, key, record): every window of every job, its findings then its report; every tenth
    finding sent twice (a processor replay).  Interleaved across jobs, in window order."""
    out = []
    for w in range(WINDOWS):
        for j in range(JOBS):
            job = f"job{j:02d}"
            window = f"w{100 + 10 * w}"
            for worker in range(PROBLEMS):
                fid = finding_id(job, window, "worker", [worker], "fwd.gemm", "gpu_slow", None)
                f = Finding(
                    id=fid,
                    job=job,
                    window=window,
                    steps=[100 + 10 * w + s for s in range(4)],
                    scope="worker",
                    workers=[worker],
                    hosts=["h1"],
                    devices=[f"h1/gpu{worker}"],
                    function="fwd.gemm",
                    function_kind="compute",
                    cause="gpu_slow",
                    confidence=0.9,
                    evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=9.0)],
                    impact=Impact(step_time_share=0.1, gpu_hours_per_day=20.0),
                    policy="p@h",
                    created_at=time.time(),
                    window_steps=4,
                )
                out += [("findings", job, f)] * (2 if worker == 0 else 1)
            out.append(
                (
                    "windows",
                    job,
                    WindowReport(
                        job=job,
                        window=window,
                        start_step=100 + 10 * w,
                        steps=4,
                        steps_seen=4,
                        expected_workers=16,
                        workers_seen=16,
                        coverage=1.0,
                        bytes_per_worker=100.0,
                        findings=PROBLEMS,
                        actionable=True,
                        reached_device=True,
                        closed="complete",
                        closed_at=time.time(),
                    ),
                )
            )
    return out


def test_sink_killed_three_times_mid_stream_loses_and_duplicates_nothing(settings, pipeline, receiver):
    topics = ensure_topics(settings)
    stream = sink_stream()
    expected = {r.id for kind, _, r in stream if kind == "findings"}
    assert len(expected) == JOBS * PROBLEMS * WINDOWS
    pipeline.start("sink")
    done = threading.Event()

    def publish(rate_per_s: float = 500.0) -> None:  # mid-stream: the sink is killed while records keep coming
        pub = Publisher(producer_config(settings))
        t0 = time.monotonic()
        for i, (kind, key, rec) in enumerate(stream):
            pub.send(getattr(topics, kind), key, rec)
            if i % 50 == 0:
                time.sleep(max(0.0, t0 + i / rate_per_s - time.monotonic()))
        pub.flush()
        done.set()

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    written = lambda: value(pipeline.metrics("sink"), "lockstep_findings_written_total", cause="gpu_slow")  # noqa: E731
    kills, restarts = [], []
    for share in (0.2, 0.45, 0.7):  # of the stream, counted by the running sink since it started
        until(
            lambda share=share: written() >= share * len(expected) / 3, 120, f"the sink to write {share:.0%} of a third"
        )
        stored = sql(settings, "SELECT count(*) FROM findings")[0][0]
        pipeline.kill("sink")
        kills.append(stored)
        t0 = time.monotonic()
        pipeline.start("sink")
        restarts.append(round(time.monotonic() - t0, 1))
    until(done.is_set, 120, "the publisher")
    t0 = time.monotonic()
    # findings and window reports are different topics, consumed side by side: the last window report may be
    # stored before the last findings, so wait for both (a lost finding still fails: the count never gets there;
    # a duplicate fails check_stored_once)
    until(
        lambda: (
            sql(settings, "SELECT count(*) FROM windows")[0][0] == JOBS * WINDOWS
            and sql(settings, "SELECT count(*) FROM findings")[0][0] >= len(expected)
        ),
        120,
        "every window report and every finding in DuckDB",
        interval_s=0.1,
    )
    caught_up = time.monotonic() - t0

    got = check_stored_once(settings, receiver, expected, windows=JOBS * WINDOWS)
    assert got["incidents"] == JOBS * PROBLEMS
    updates = sql(settings, "SELECT count(*) FROM incident_events WHERE action = 'update'")[0][0]
    assert updates == len(expected) - JOBS * PROBLEMS  # every later window's finding updates its incident once
    offsets = sql(
        settings,
        "SELECT topic, sum(next_offset) FROM sink_offsets WHERE topic IN (?, ?) GROUP BY topic ORDER BY topic",
        [topics.findings, topics.windows],
    )
    assert [o[1] for o in offsets] == [
        len(stream) - JOBS * WINDOWS,
        JOBS * WINDOWS,
    ]  # every record read once, to the end
    print(
        f"\nRELIABILITY sink-kill: {len(stream)} records ({len(stream) - JOBS * WINDOWS - len(expected)} duplicates), "
        f"SIGKILL at {kills} findings stored, restarts healthy after {restarts} s, caught up {caught_up:.1f} s after the last record; "
        f"{got}; incident updates {updates}"
    )


# ---------------------------------------------------------------------------------------- scale-out


def test_a_second_processor_joining_while_a_window_is_open_takes_over_without_loss(settings, pipeline, receiver):
    """Scaling out mid-window: the group rebalances while records of an open window are held unacknowledged;
    the window still closes once, wherever its partitions went."""
    topics = ensure_topics(settings)
    scenario = Scenario(
        job="scale-job",
        topology=Topology(workers=16, gpus_per_host=8),
        faults=(Fault(type="gpu_throttle_thermal", workers=(5,), severity=0.3),),
    )
    fleet = FleetSimulator(scenario)
    w = Window(60, 8)
    expected = {f.id for f in diagnose_one(fleet, load_policy(None), w).findings}
    pub = Publisher(producer_config(settings))

    def publish(step: int) -> None:
        for b in fleet.feature_batches(fleet.step(step), fleet.trigger(w)):
            pub.send(topics.features, features_key(scenario.job, step), b)
        pub.flush()

    pipeline.start("sink")
    pipeline.start("processor")
    for step in w.range[:4]:
        publish(step)
    m = lambda: pipeline.metrics("processor")  # noqa: E731
    until(lambda: value(m(), "lockstep_records_in_total", topic=topics.stepreports) == 4, 60, "four step reports")
    t0 = time.monotonic()
    pipeline.start(
        "processor-2", timeout_s=90, command="processor"
    )  # healthy = it got partitions: the rebalance finished
    rebalance_s = time.monotonic() - t0
    for step in w.range[4:]:
        publish(step)
    until(lambda: sql(settings, "SELECT count(*) FROM windows")[0][0], 90, "the window in DuckDB")
    time.sleep(2.0)
    got = check_stored_once(settings, receiver, expected, windows=1)
    print(f"\nRELIABILITY scale-out: second processor ready {rebalance_s:.1f}s after it started; {got}")
