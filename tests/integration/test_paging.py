"""Paging against a real local HTTP server and a real DuckDB file: payloads, signatures, retries, dedup, resolve."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from lockstep.schemas.records import Evidence, Finding, Impact, WindowReport
from lockstep.sinks.paging import routes
from lockstep.sinks.paging.pager import Pager
from lockstep.sinks.store import Batch, FindingsStore

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


class Receiver:
    """A real HTTP server that records every request and answers from a per-path script."""

    def __init__(self):
        self.requests: list[dict] = []
        self.script: dict[str, list] = {}  # path -> answers: an int status, or ("sleep", seconds) then 202
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append(
                    {
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": body,
                        "at": time.time(),
                    }
                )
                answers = receiver.script.get(self.path) or []
                answer = answers.pop(0) if answers else 202
                if isinstance(answer, tuple):
                    time.sleep(answer[1])
                    answer = 202
                self.send_response(answer)
                if answer == 429:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def to(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["path"] == path]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def paging(receiver, *, retry=None, **route_overrides):
    spec = {
        "retry": retry or {"max_attempts": 4, "initial_backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 2.0},
        "routes": [
            {"name": "pd", "type": "pagerduty", "url": receiver.url + "/pd", "routing_key_env": "PD_KEY"},
            {"name": "chat", "type": "slack", "url_env": "SLACK_URL", "min_interval_s": 0, "redact_functions": True},
            {
                "name": "hook",
                "type": "webhook",
                "url": receiver.url + "/hook",
                "secret_env": "HOOK_SECRET",
                "match": {"min_confidence": 0.5, "causes": ["gpu_throttle_thermal", "gpu_slow"]},
            },
        ],
    }
    for r in spec["routes"]:
        r.update(route_overrides.get(r["name"], {}))
    env = {"PD_KEY": "pd-routing-key", "SLACK_URL": receiver.url + "/slack", "HOOK_SECRET": SECRET}
    return routes.parse(spec, env)


def finding(
    window="w1",
    steps=(100, 101, 102),
    conf=0.9,
    function="fwd.gemm",
    cause="gpu_throttle_thermal",
    workers=(3,),
    job="j",
    tenant="acme",
    created_at=None,
):
    from lockstep.schemas.records import finding_id

    return Finding(
        id=finding_id(job, window, "worker", list(workers), function, cause, None),
        job=job,
        window=window,
        steps=list(steps),
        scope="worker",
        workers=list(workers),
        hosts=["h1"],
        devices=[f"h1/gpu{w}" for w in workers],
        function=function,
        function_kind="compute",
        cause=cause,
        confidence=conf,
        evidence=[
            Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=9.0),
            Evidence(feature=f"work_us[{function}.backward]", value=4.0, peer_value=2.0, deviation=8.0),
        ],
        impact=Impact(step_time_share=0.12, gpu_hours_per_day=23.0),
        policy="p@h",
        created_at=created_at or 1_800_000_000.0 + steps[0],
        tenant=tenant,
        summary=f"worker {workers[0]} on h1/gpu{workers[0]}: {function} 30% slower than 7 peers; cause {cause}",
        window_steps=len(steps) + 1,
    )


def window(window, start, findings=0, coverage=1.0, job="j", tenant="acme"):
    return WindowReport(
        job=job,
        window=window,
        start_step=start,
        steps=4,
        steps_seen=4,
        expected_workers=8,
        workers_seen=8,
        coverage=coverage,
        bytes_per_worker=100.0,
        findings=findings,
        actionable=findings > 0,
        reached_device=findings > 0,
        closed="complete",
        closed_at=1_800_000_000.0 + start + 4,
        tenant=tenant,
    )


def verify_standard_webhook(secret: str, headers: dict, body: bytes, now: float, tolerance_s: int = 300) -> None:
    """What a receiver does (written here independently of lockstep's signer): constant-time, timestamp tolerance."""
    msg_id, ts = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(now - int(ts)) > tolerance_s:
        raise ValueError("timestamp outside the tolerance")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()).decode()
    for sig in headers["webhook-signature"].split(" "):
        version, _, value = sig.partition(",")
        if version == "v1" and hmac.compare_digest(expected, value):
            return
    raise ValueError("no valid signature")


def deliveries(store, route=None):
    sql = (
        "SELECT route, action, status, attempts, last_status FROM webhook_deliveries"
        + (" WHERE route = ?" if route else "")
        + " ORDER BY event_seq, route"
    )
    return store.con.execute(sql, [route] if route else []).fetchall()


def test_each_receiver_gets_its_format_and_the_webhook_is_signed(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    pager = Pager(store, paging(receiver))
    f = finding()
    store.write(Batch([f], [], {}))
    assert pager.fan_out() == 3
    assert pager.drain(10)

    (pd,) = receiver.to("/pd")
    body = json.loads(pd["body"])
    assert body["routing_key"] == "pd-routing-key" and body["event_action"] == "trigger"
    assert body["dedup_key"].endswith("-1")
    p = body["payload"]
    assert p["severity"] == "error" and p["class"] == "gpu_throttle_thermal" and p["component"] == "fwd.gemm"
    assert p["source"] == "h1/gpu3" and p["group"] == "j" and p["timestamp"].endswith("Z")
    assert p["custom_details"]["finding"] == f.id and p["custom_details"]["tenant"] == "acme"
    assert p["custom_details"]["evidence"][0] == {
        "feature": "work_us",
        "value": 2.0,
        "peer_value": 1.0,
        "deviation": 9.0,
    }

    (chat,) = receiver.to("/slack")
    msg = json.loads(chat["body"])
    assert msg["text"] and msg["blocks"][0]["type"] == "section"
    # the chat route leaves the tenant: no function name anywhere in it, the hash instead
    assert "fwd.gemm" not in chat["body"].decode()
    assert "fn:" + hashlib.sha256(b"fwd.gemm").hexdigest()[:12] in chat["body"].decode()

    (hook,) = receiver.to("/hook")
    verify_standard_webhook(SECRET, hook["headers"], hook["body"], now=time.time())
    with pytest.raises(ValueError, match="no valid signature"):
        verify_standard_webhook(SECRET, hook["headers"], hook["body"].replace(b"acme", b"evil"), now=time.time())
    with pytest.raises(ValueError, match="tolerance"):
        verify_standard_webhook(SECRET, hook["headers"], hook["body"], now=time.time() + 3600)
    event = json.loads(hook["body"])
    assert event["type"] == "incident.triggered"
    # the page carries the Finding record as it is: nothing added, and what the agent redacted stays redacted
    assert event["data"]["finding"] == msgspec.to_builtins(f)
    assert event["data"]["incident"]["severity"] == "error"
    assert [d[2] for d in deliveries(store)] == ["delivered"] * 3


def test_retries_on_500_and_timeouts_but_never_on_other_4xx(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    receiver.script = {"/pd": [500, 503, 202], "/hook": [("sleep", 1.0), 202], "/slack": [400, 202]}
    pager = Pager(
        store,
        paging(receiver, retry={"max_attempts": 4, "initial_backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 0.3}),
    )
    store.write(Batch([finding()], [], {}))
    pager.fan_out()
    assert pager.drain(15)
    assert len(receiver.to("/pd")) == 3
    assert len(receiver.to("/hook")) == 2  # the first timed out, the second went through
    assert len(receiver.to("/slack")) == 1  # a 400 is final
    rows = {r[0]: r for r in deliveries(store)}
    assert rows["pd"][2:] == ("delivered", 3, 202)
    assert rows["hook"][2:] == ("delivered", 2, 202)
    assert rows["chat"][2:] == ("failed", 1, 400)
    ids = {r["headers"]["webhook-id"] for r in receiver.to("/hook")}
    assert len(ids) == 1  # the same webhook-id on every attempt: receivers deduplicate by it
    pd_times = [r["at"] for r in receiver.to("/pd")]
    assert (
        pd_times[1] - pd_times[0] >= 0.025 and pd_times[2] - pd_times[1] >= 0.05
    )  # backoff grows (jitter: half to all of it)
    assert pager.metrics.get("webhook_deliveries_total", route="pd", receiver="pagerduty", result="retry") == 2


def test_gives_up_after_max_attempts(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    receiver.script = {"/pd": [500] * 10}
    pager = Pager(
        store,
        paging(receiver, retry={"max_attempts": 3, "initial_backoff_s": 0.02, "max_backoff_s": 0.05, "timeout_s": 1}),
    )
    store.write(Batch([finding()], [], {}))
    pager.fan_out()
    assert pager.drain(10)
    assert len(receiver.to("/pd")) == 3
    assert deliveries(store, "pd")[0][2:] == ("failed", 3, 500)


def test_one_page_per_problem_no_duplicate_on_replay_and_resolve_when_it_clears(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    pager = Pager(store, paging(receiver))
    w1 = finding("w1", steps=(100, 101, 102))
    store.write(Batch([w1], [window("w1", 100, findings=1)], {}))
    pager.fan_out()
    store.write(Batch([w1], [window("w1", 100, findings=1)], {}))  # the processor replays the window
    # the same problem in the next window, with a different costliest kernel: still the same incident
    w2 = finding("w2", steps=(200, 201, 202), function="bwd.gemm")
    store.write(Batch([w2], [window("w2", 200, findings=1)], {}))
    pager.fan_out()
    assert pager.drain(10)
    assert len(receiver.to("/pd")) == 1 and len(receiver.to("/hook")) == 1 and len(receiver.to("/slack")) == 1
    dedup = json.loads(receiver.to("/pd")[0]["body"])["dedup_key"]

    # a window with too little coverage cannot clear it
    store.write(Batch([], [window("w3", 300, coverage=0.5)], {}))
    assert pager.fan_out() == 0
    # a window that saw every worker and not the problem resolves it, on every route that paged it
    store.write(Batch([], [window("w4", 400)], {}))
    assert pager.fan_out() == 3
    assert pager.drain(10)
    resolve = json.loads(receiver.to("/pd")[1]["body"])
    assert resolve == {"routing_key": "pd-routing-key", "event_action": "resolve", "dedup_key": dedup}
    assert json.loads(receiver.to("/hook")[1]["body"])["type"] == "incident.resolved"
    verify_standard_webhook(
        SECRET, receiver.to("/hook")[1]["headers"], receiver.to("/hook")[1]["body"], now=time.time()
    )
    assert "Resolved" in json.loads(receiver.to("/slack")[1]["body"])["text"]
    assert store.con.execute("SELECT status, resolved_by, windows FROM incidents").fetchall() == [("resolved", "w4", 2)]

    # replaying everything again pages nothing
    store.write(Batch([w1, w2], [window("w1", 100, findings=1), window("w2", 200, findings=1), window("w4", 400)], {}))
    assert pager.fan_out() == 0
    # it comes back later: a new incident (occurrence 2), a new page
    store.write(Batch([finding("w5", steps=(500, 501))], [], {}))
    assert pager.fan_out() == 3
    assert pager.drain(10)
    again = json.loads(receiver.to("/pd")[2]["body"])
    assert again["event_action"] == "trigger" and again["dedup_key"] == dedup[: -len("-1")] + "-2"


def test_routes_filter_by_job_tenant_cause_and_confidence(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    cfg = paging(receiver, pd={"match": {"jobs": ["llm-*"], "tenants": ["acme"]}})
    pager = Pager(store, cfg)
    store.write(
        Batch(
            [
                finding(job="other", conf=0.9),  # pd: wrong job; hook: yes
                finding(job="llm-7", conf=0.3, workers=(5,)),  # pd: yes; hook: too unsure
                finding(job="llm-8", tenant="globex", workers=(6,)),  # pd: wrong tenant; hook: yes
                finding(job="llm-9", cause="dataloader", workers=(7,)),
            ],
            [],
            {},
        )
    )  # pd: yes; hook: cause not routed
    pager.fan_out()
    assert pager.drain(10)
    pd_jobs = sorted(json.loads(r["body"])["payload"]["group"] for r in receiver.to("/pd"))
    hook_jobs = sorted(json.loads(r["body"])["data"]["finding"]["job"] for r in receiver.to("/hook"))
    assert pd_jobs == ["llm-7", "llm-9"]
    assert hook_jobs == ["llm-8", "other"]
    assert len(receiver.to("/slack")) == 4

    # a later, more confident finding of an incident the hook route skipped pages it then, once
    store.write(Batch([finding("w2", steps=(200, 201), job="llm-7", conf=0.95, workers=(5,))], [], {}))
    pager.fan_out()
    assert pager.drain(10)
    assert sorted(json.loads(r["body"])["data"]["finding"]["job"] for r in receiver.to("/hook")) == [
        "llm-7",
        "llm-8",
        "other",
    ]
    assert len(receiver.to("/pd")) == 2 and len(receiver.to("/slack")) == 4


def test_nothing_lost_or_repeated_across_a_restart(tmp_path, receiver):
    path = tmp_path / "f.duckdb"
    store = FindingsStore(path)
    Pager(store, paging(receiver))  # paging enabled on this file
    store.write(Batch([finding()], [], {}))
    store.close()  # "crash": the events are committed, no page planned yet

    store = FindingsStore(path)
    pager = Pager(store, paging(receiver))
    assert pager.fan_out() == 3
    store.close()  # "crash": planned, nothing sent

    store = FindingsStore(path)
    pager = Pager(store, paging(receiver))
    assert pager.fan_out() == 0
    assert pager.drain(10)
    store.close()

    store = FindingsStore(path)
    pager = Pager(store, paging(receiver))
    assert pager.fan_out() == 0 and pager.drain(5)
    assert len(receiver.requests) == 3  # each route paged exactly once


def test_a_resolve_never_overtakes_its_trigger(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    receiver.script = {"/pd": [503, 503, 202]}
    pager = Pager(
        store,
        paging(receiver, retry={"max_attempts": 5, "initial_backoff_s": 0.1, "max_backoff_s": 0.2, "timeout_s": 1}),
    )
    store.write(Batch([finding()], [window("w1", 100, findings=1)], {}))
    store.write(Batch([], [window("w2", 200)], {}))
    pager.fan_out()
    assert pager.drain(10)
    assert [json.loads(r["body"])["event_action"] for r in receiver.to("/pd")] == [
        "trigger",
        "trigger",
        "trigger",
        "resolve",
    ]


def test_paging_enabled_later_does_not_page_history(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([finding()], [], {}))
    pager = Pager(store, paging(receiver))
    assert pager.fan_out() == 0
    store.write(Batch([finding(workers=(4,))], [], {}))
    assert pager.fan_out() == 3


def test_background_threads_deliver(tmp_path, receiver):
    store = FindingsStore(tmp_path / "f.duckdb")
    pager = Pager(store, paging(receiver), poll_s=0.1).start()
    try:
        store.write(Batch([finding()], [], {}))
        pager.fan_out()
        deadline = time.monotonic() + 10
        while len(receiver.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pager.stop()
    assert len(receiver.requests) == 3


@pytest.mark.integration
def test_the_sink_pages_once_through_a_crash_and_a_replay(settings, tmp_path, receiver, monkeypatch):
    """The real ``lockstep sink`` process on Kafka: trigger, SIGKILL, replayed findings, restart, resolve."""
    import dataclasses
    import subprocess
    import sys

    from lockstep.app.runtime import Child, settings_flags
    from lockstep.broker import free_port
    from lockstep.kafka import Publisher, ensure_topics, producer_config
    from lockstep.schemas.records import ProfileTrigger
    from lockstep.sinks.http import query, wait_for

    monkeypatch.setenv("LOCKSTEP_TEST_PD_KEY", "pd-routing-key")
    monkeypatch.setenv("LOCKSTEP_TEST_HOOK_SECRET", SECRET)
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(
        f"retry: {{max_attempts: 5, initial_backoff_s: 0.05, max_backoff_s: 0.5, timeout_s: 2}}\n"
        f"routes:\n"
        f"  - {{name: pd, type: pagerduty, url: '{receiver.url}/pd', routing_key_env: LOCKSTEP_TEST_PD_KEY}}\n"
        f"  - {{name: hook, type: webhook, url: '{receiver.url}/hook', secret_env: LOCKSTEP_TEST_HOOK_SECRET, match: {{tenants: [acme]}}}}\n"
    )
    settings = dataclasses.replace(
        settings, session_timeout_ms=3000
    )  # the restart waits for the killed member to time out
    topics = ensure_topics(settings)
    flags = [*settings_flags(settings, "sink"), "--routes", str(routes_file)]

    def start_sink(name):
        port = free_port()
        sink = Child(name, ["sink", *flags, "--http-port", str(port)], tmp_path, f"http://127.0.0.1:{port}/healthz")
        sink.wait_healthy(60)
        return sink

    pub = Publisher(producer_config(settings))
    w1 = finding("w1", steps=(100, 101, 102))
    sink = start_sink("sink1")
    try:
        receiver.script = {"/pd": [503]}  # the first attempt fails: the page must still arrive, once
        pub.send(
            topics.control,
            "j",
            ProfileTrigger(job="j", window="w1", start_step=100, steps=4, expected_workers=8, tenant="acme"),
        )
        pub.send(topics.findings, "j", w1)
        pub.send(topics.windows, "j", window("w1", 100, findings=1))
        pub.flush()
        assert wait_for(lambda: len(receiver.to("/pd")) >= 2 and len(receiver.to("/hook")) >= 1, 30), receiver.requests
        # readers while the sink holds the file: the trigger is stored, and a tenant sees only its own rows
        assert query(settings.db, "SELECT window_id, tenant FROM triggers")[1] == [["w1", "acme"]]
        out = subprocess.run(
            [sys.executable, "-m", "lockstep", "findings", "--db", str(settings.db), "--tenant", "globex", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
        sink.kill()  # SIGKILL
    finally:
        sink.kill()

    # while it is down the processor replays w1 and the problem persists into w2
    pub.send(topics.findings, "j", w1)
    pub.send(topics.windows, "j", window("w1", 100, findings=1))
    pub.send(topics.findings, "j", finding("w2", steps=(200, 201), function="bwd.gemm"))
    pub.send(topics.windows, "j", window("w2", 200, findings=1))
    pub.flush()
    sink = start_sink("sink2")
    try:
        pub.send(topics.windows, "j", window("w3", 300))  # a clean window: the problem cleared
        pub.flush()
        assert wait_for(lambda: len(receiver.to("/pd")) >= 3 and len(receiver.to("/hook")) >= 2, 30), receiver.requests
        time.sleep(1.0)  # anything extra would arrive now
    finally:
        sink.stop()
        pub.close()
    actions = [json.loads(r["body"])["event_action"] for r in receiver.to("/pd")]
    assert actions == ["trigger", "trigger", "resolve"]  # a 503, its retry, the resolve
    assert [json.loads(r["body"])["type"] for r in receiver.to("/hook")] == ["incident.triggered", "incident.resolved"]
    for r in receiver.to("/hook"):
        verify_standard_webhook(SECRET, r["headers"], r["body"], now=time.time())
    _, rows = query(
        settings.db, "SELECT route, action, status, attempts FROM webhook_deliveries ORDER BY event_seq, route"
    )
    assert rows == [
        ["hook", "trigger", "delivered", 1],
        ["pd", "trigger", "delivered", 2],
        ["hook", "resolve", "delivered", 1],
        ["pd", "resolve", "delivered", 1],
    ]


@pytest.mark.slow  # `lockstep test-page` in a subprocess
def test_test_page_reaches_every_route_signed_and_resolves_what_it_opened(tmp_path, receiver):
    import os
    import subprocess
    import sys

    from lockstep.broker import free_port

    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(
        "routes:\n"
        f"  - {{name: pd, type: pagerduty, url: '{receiver.url}/pd', routing_key_env: PD_KEY}}\n"
        f"  - {{name: hook, type: webhook, url: '{receiver.url}/hook', secret_env: HOOK_SECRET, match: {{causes: [nic]}}}}\n"
        f"  - {{name: gone, type: slack, url: 'http://127.0.0.1:{free_port()}/nobody'}}\n"
    )
    env = {**os.environ, "PD_KEY": "pd-routing-key", "HOOK_SECRET": SECRET}

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "lockstep", "test-page", "--routes", str(routes_file), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    r = cli("--route", "pd", "--route", "hook", "--json")
    assert r.returncode == 0, r.stderr
    assert [(x["route"], x["action"], x["status"]) for x in json.loads(r.stdout)] == [
        ("pd", "trigger", 202),
        ("pd", "resolve", 202),
        ("hook", "trigger", 202),
        ("hook", "resolve", 202),
    ]
    trigger, resolve = (json.loads(x["body"]) for x in receiver.to("/pd"))
    assert (trigger["event_action"], resolve["event_action"]) == ("trigger", "resolve")
    assert (
        trigger["dedup_key"] == resolve["dedup_key"] and trigger["routing_key"] == "pd-routing-key"
    )  # the test incident is closed again
    assert "Nothing is wrong" in json.dumps(trigger)
    for req in receiver.to(
        "/hook"
    ):  # sent although the route's filter (causes: [nic]) would not match: it tests the route
        verify_standard_webhook(SECRET, req["headers"], req["body"], time.time())

    r = cli("--no-resolve")  # a receiver that does not answer fails the command and says why
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("gone"))
    assert "URLError" in line and "refused" in line.lower()
    r = cli("--route", "nope")
    assert r.returncode == 2 and "no route named nope" in r.stderr


def test_an_incident_that_ends_with_its_job_or_recovers_resolves_with_the_same_dedup_key(tmp_path, receiver):
    from lockstep.schemas.records import JobChange

    store = FindingsStore(tmp_path / "f.duckdb")
    pager = Pager(store, paging(receiver))
    store.write(Batch([finding(), finding(window="w9", job="k")], [], {}))
    pager.fan_out()
    assert pager.drain(10)
    now = time.time()
    store.write(
        Batch.of(
            [
                JobChange(job="j", tenant="acme", change="ended", step=500, end="final", at=now),
                JobChange(job="k", tenant="acme", change="recovered", step=500, onset_step=0, at=now),
            ],
            {},
        )
    )
    pager.fan_out()
    assert pager.drain(10)
    triggers = {json.loads(r["body"])["dedup_key"] for r in receiver.to("/pd")[:2]}
    resolves = [json.loads(r["body"]) for r in receiver.to("/pd")[2:]]
    assert {r["event_action"] for r in resolves} == {"resolve"} and {r["dedup_key"] for r in resolves} == triggers
    said = sorted(json.loads(r["body"])["text"] for r in receiver.to("/slack")[2:])
    assert any("(the job ended)" in s for s in said)
    assert any("back at its level before the slowdown" in s for s in said)
    reasons = sorted(json.loads(r["body"])["data"]["incident"]["reason"] for r in receiver.to("/hook")[2:])
    assert reasons == ["job_ended", "recovered"]
