"""The DuckDB store on a real file: upserts, offsets in the same transaction, read-only access."""

import json
import urllib.request

import duckdb
import pytest

from lockstep.schemas.records import Evidence, Finding, Impact, WindowReport
from lockstep.sinks.sink import query, sidecar
from lockstep.sinks.store import Batch, FindingsStore, StoreError, open_read_only


def finding(fid="f1", conf=0.9, steps=(1, 2, 3), cause="gpu_slow", job="j"):
    return Finding(id=fid, job=job, window="w1", steps=list(steps), scope="worker", workers=[3], hosts=["h"], devices=["h/gpu3"],
                   function="fwd", function_kind="compute", cause=cause, confidence=conf,
                   evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
                   impact=Impact(step_time_share=0.1, gpu_hours_per_day=2.4), policy="p@h", created_at=1_800_000_000.0, group={"pp": "1"})  # fmt: skip


def window(job="j"):
    return WindowReport(job=job, window="w1", start_step=1, steps=8, steps_seen=8, expected_workers=4, workers_seen=4, coverage=1.0,
                        bytes_per_worker=10.0, findings=1, actionable=True, reached_device=True, closed="complete", closed_at=1_800_000_000.0)  # fmt: skip


def test_replayed_findings_upsert_instead_of_duplicating(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([finding(conf=0.5)], [window()], {("t.findings", 0): 1}), now=100.0)
    store.write(Batch([finding(conf=0.8), finding(conf=0.9)], [window(), window()], {("t.findings", 0): 3}), now=200.0)
    rows = store.con.execute("SELECT id, confidence, epoch(first_seen), epoch(updated_at), peer_group['pp'] FROM findings").fetchall()
    assert rows == [("f1", 0.9, 100.0, 200.0, "1")]
    assert store.con.execute("SELECT count(*) FROM windows").fetchone()[0] == 1
    assert store.offsets() == {("t.findings", 0): 3}
    record = json.loads(store.con.execute("SELECT record FROM findings").fetchone()[0])
    assert record["schema"] == "Finding" and record["window"] == "w1" and record["group"] == {"pp": "1"}


def test_rows_and_offsets_commit_together(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([finding()], [], {("t.findings", 0): 1}))
    bad = finding(fid="f2")
    bad.steps = "not a list"  # makes the Arrow conversion fail mid-transaction
    with pytest.raises(Exception):
        store.write(Batch([bad], [], {("t.findings", 0): 2}))
    assert store.offsets() == {("t.findings", 0): 1}
    assert store.con.execute("SELECT count(*) FROM findings").fetchone()[0] == 1


def test_migrations_are_versioned_and_idempotent(tmp_path):
    path = tmp_path / "f.duckdb"
    FindingsStore(path).close()
    store = FindingsStore(path)
    assert store.con.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall() == [(1,), (2,)]


def test_query_refuses_writes(tmp_path):
    path = tmp_path / "f.duckdb"
    FindingsStore(path).close()
    for sql in ("DELETE FROM findings", "INSERT INTO findings (id) VALUES ('x')", "DROP TABLE findings", "COPY findings TO 'x.csv'", "SELECT 1; DELETE FROM findings"):
        with pytest.raises(StoreError, match="read-only"):
            query(path, sql)
    with pytest.raises(StoreError, match="does not parse"):
        query(path, "SELEC nonsense")


WRITER = """
import importlib.util, signal, sys, time, threading
spec = importlib.util.spec_from_file_location("store_test", {this!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
finding, window = mod.finding, mod.window
from lockstep.metrics import Metrics
from lockstep.sinks.sink import QueryServer
from lockstep.sinks.store import Batch, FindingsStore

store = FindingsStore({path!r})
store.write(Batch([finding()], [window()], {{}}))

class Holder:  # what the query server needs of a sink
    def __init__(self):
        self.store, self.metrics, self.assigned = store, Metrics(), True

server = QueryServer(Holder(), {path!r}).start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
print("ready", flush=True)
i = 0
while not stop.is_set():  # keep writing while readers read
    store.write(Batch([finding(fid=f"g{{i}}")], [], {{}}))
    i += 1
    time.sleep(0.02)
server.stop()
store.close()
"""


def test_query_works_while_another_process_holds_the_file(tmp_path):
    import pathlib
    import signal
    import subprocess
    import sys

    path = tmp_path / "f.duckdb"
    script = WRITER.format(this=str(pathlib.Path(__file__).resolve()), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path), read_only=True)  # what a second process meets without the sink's help
        cols, rows = query(path, "SELECT id, cause FROM findings WHERE id = 'f1'")
        assert cols == ["id", "cause"] and rows == [["f1", "gpu_slow"]]
        with pytest.raises(StoreError, match="read-only"):
            query(path, "DELETE FROM findings")
        url = json.loads(sidecar(path).read_text())["url"]
        with urllib.request.urlopen(url + "/healthz") as r:
            assert json.loads(r.read())["status"] == "ok"
        counts = [query(path, "SELECT count(*) FROM findings")[1][0][0] for _ in range(5)]
        assert counts == sorted(counts) and counts[0] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert not sidecar(path).exists()
    final = query(path, "SELECT count(*) FROM findings")[1][0][0]  # directly, once the sink is gone
    assert final >= counts[-1]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_read_only(tmp_path / "nope.duckdb")
