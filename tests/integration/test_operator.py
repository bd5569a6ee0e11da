"""An operator's writes while a real sink process holds the findings file (DuckDB: one writer): `lockstep incident
ack|resolve`, `lockstep prune` and `lockstep jobs` as subprocesses go through the sink's HTTP port with the token beside
the file; the pages they cause reach a real HTTP receiver; the sink goes on writing what Kafka brings."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, ensure_topics, producer_config
from lockstep.sinks.http import query, sidecar, wait_for
from lockstep.sinks.store import Batch, FindingsStore
from tests.integration.test_paging import Receiver, finding
from tests.sinks.test_store import fnd

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a broker and a sink process; commands in subprocesses

DAY = 86400.0


def lockstep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=120, check=False
    )


def post(url: str, path: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def rows(db, sql: str, params=None) -> list[dict]:
    cols, found = query(db, sql, params)
    return [dict(zip(cols, r)) for r in found]


def test_ack_resolve_jobs_and_prune_go_through_the_running_sink(settings, tmp_path):
    receiver = Receiver()
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        json.dumps(
            {
                "routes": [
                    {"name": "chat", "type": "slack", "url": receiver.url + "/chat", "min_interval_s": 0},
                    # pages only very confident findings: the first finding does not match it, the second would
                    {
                        "name": "late",
                        "type": "slack",
                        "url": receiver.url + "/late",
                        "min_interval_s": 0,
                        "match": {"min_confidence": 0.95},
                    },
                ]
            }
        )
    )
    s = dataclasses.replace(settings, routes=routes)
    topics = ensure_topics(s)
    # a problem of 40 days ago, resolved then, in the file before the sink starts: what prune removes
    old = time.time() - 40 * DAY
    store = FindingsStore(s.db)
    store.write(Batch([fnd("old1", job="oldjob", created_at=old)], [], {}), now=old)
    store.resolve(store.con.execute("SELECT id FROM incidents").fetchone()[0], "ops", now=old + 60)
    store.close()

    pipeline = Pipeline(s, tmp_path)
    publisher = Publisher(producer_config(s))
    try:
        pipeline.start("sink", 60)
        first = finding(window="w1", conf=0.9)
        publisher.send(topics.findings, first.job, first)
        publisher.flush()
        assert wait_for(lambda: len(receiver.to("/chat")) == 1, 60), receiver.requests
        (inc,) = rows(s.db, "SELECT id, status FROM incidents WHERE job = 'j'")

        # the sink holds the file: the command cannot open it, so it asks the sink
        done = lockstep("incident", "ack", inc["id"], "--db", str(s.db), "--by", "alice", "--json")
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["changed"] and out["incident"]["acked_by"] == "alice" and out["incident"]["status"] == "open"
        assert wait_for(lambda: len(receiver.to("/chat")) == 2, 30), receiver.requests
        assert "Acknowledged" in json.loads(receiver.to("/chat")[1]["body"])["text"]

        # a later, more confident finding of the same problem: the incident takes it; acknowledged, it pages no one
        second = finding(window="w2", steps=(200, 201, 202), conf=0.97)
        publisher.send(topics.findings, second.job, second)
        publisher.flush()
        assert wait_for(lambda: rows(s.db, "SELECT windows FROM incidents WHERE job = 'j'")[0]["windows"] == 2, 30)
        assert rows(s.db, "SELECT count(*) AS n FROM webhook_deliveries WHERE route = 'late'") == [{"n": 0}]

        jobs = lockstep("jobs", "--db", str(s.db), "--json")
        assert jobs.returncode == 0, jobs.stderr
        by_job = {j["job"]: j for j in json.loads(jobs.stdout)}
        j = by_job["j"]
        assert (j["open_incidents"], j["findings"], j["windows"], j["ended"]) == (1, 2, 0, False)
        assert j["gpu_hours_per_day"] == second.impact.gpu_hours_per_day > 0  # the open incident's, as of its last
        assert by_job["oldjob"]["open_incidents"] == 0
        assert next(iter(by_job)) == "j"  # costliest first

        # the HTTP API's refusals: no token, an unknown incident
        announced = json.loads(sidecar(s.db).read_text())
        url, token = announced["url"], announced["token"]
        assert post(url, "/incidents/resolve", {"id": inc["id"], "by": "x"}, None)[0] == 401
        assert post(url, "/prune", {"older_than_s": DAY}, None)[0] == 401
        assert post(url, "/incidents/ack", {"id": "nosuch-1", "by": "x"}, token)[0] == 404
        assert post(url, "/prune", {"older_than_s": -1}, token)[0] == 400

        done = lockstep("incident", "resolve", inc["id"], "--db", str(s.db), "--by", "bob")
        assert done.returncode == 0 and "resolved" in done.stdout, done.stderr
        assert wait_for(lambda: len(receiver.to("/chat")) == 3, 30), receiver.requests
        assert "Resolved" in json.loads(receiver.to("/chat")[2]["body"])["text"]
        (after,) = rows(s.db, "SELECT status, resolved_reason, resolved_by, acked_by FROM incidents WHERE job = 'j'")
        assert after == {"status": "resolved", "resolved_reason": "manual", "resolved_by": "bob", "acked_by": "alice"}
        code, body = post(url, "/incidents/ack", {"id": inc["id"], "by": "x"}, token)
        assert code == 409 and "resolved" in body["error"]

        done = lockstep("prune", "--older-than", "30d", "--db", str(s.db), "--json")
        assert done.returncode == 0, done.stderr
        pruned = json.loads(done.stdout)
        assert (pruned["findings"], pruned["incidents"]) == (1, 1)
        assert [r["id"] for r in rows(s.db, "SELECT id FROM findings ORDER BY id")] == sorted([first.id, second.id])

        # the sink writes on: a new problem of another job is stored and paged
        third = finding(window="x1", job="k", cause="gpu_slow")
        publisher.send(topics.findings, third.job, third)
        publisher.flush()
        assert wait_for(lambda: len(receiver.to("/chat")) == 4, 30), receiver.requests
        assert pipeline.children["sink"].alive()
    finally:
        publisher.close()
        pipeline.stop()
        receiver.close()


def test_a_sink_with_a_retention_prunes_its_file_itself(settings, tmp_path):
    s = dataclasses.replace(settings, retention=30 * DAY)
    ensure_topics(s)
    now = time.time()
    store = FindingsStore(s.db)
    for fid, job, age in (("old1", "oldjob", 40 * DAY), ("new1", "newjob", DAY)):
        store.write(Batch([fnd(fid, job=job, created_at=now - age)], [], {}), now=now - age)
        store.resolve(
            store.con.execute("SELECT id FROM incidents WHERE job = ?", [job]).fetchone()[0], "ops", now=now - age
        )
    store.close()
    pipeline = Pipeline(s, tmp_path)
    try:
        pipeline.start("sink", 60)  # prunes at start, then hourly
        assert wait_for(lambda: [r["id"] for r in rows(s.db, "SELECT id FROM findings")] == ["new1"], 30)
        assert [r["job"] for r in rows(s.db, "SELECT job FROM incidents")] == ["newjob"]
    finally:
        pipeline.stop()
    assert "pruned" in (tmp_path / "sink.log").read_text()
