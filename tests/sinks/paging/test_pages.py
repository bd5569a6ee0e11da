"""The pure parts of paging: signatures, redaction, backoff, routing, severity, Slack escaping."""

import base64

import pytest

from lockstep.sinks.paging import routes
from lockstep.sinks.paging.pages import backoff_s, plan, redact_functions, retryable, sign
from tests.sinks.paging.test_incidents import f

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def test_signature_matches_the_standard_webhooks_test_vector():
    key = routes.webhook_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "test")
    assert (
        sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
        == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    retry = routes.Retry(initial_backoff_s=1.0, max_backoff_s=30.0)
    assert [backoff_s(n, retry, 0.0) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert [backoff_s(n, retry, 0.999) for n in (1, 2, 3)] == pytest.approx([1.0, 2.0, 4.0], rel=1e-3)
    assert backoff_s(20, retry, 0.999) <= 30.0
    assert backoff_s(1, retry, 0.0, retry_after_s=7.0) == 7.0  # Retry-After wins
    assert backoff_s(1, retry, 0.0, retry_after_s=3600.0) == 30.0  # up to the cap
    assert [retryable(s) for s in (None, 429, 500, 503, 400, 401, 404, 410, 302)] == [True] * 4 + [False] * 5


def test_redaction_hides_every_function_name_and_keeps_the_rest():
    import msgspec

    rec = msgspec.to_builtins(f(function="model.secret_fn"))
    red = redact_functions(rec)
    text = str(red)
    assert "secret_fn" not in text
    assert red["function"].startswith("fn:") and red["evidence"][0]["feature"] == f"work_us[{red['function']}]"
    assert red["devices"] == rec["devices"] and red["cause"] == rec["cause"] and red["id"] == rec["id"]
    assert redact_functions(rec)["function"] == red["function"]  # stable: pages about one function can be matched up


def test_severity_rules_and_routing_plan():
    import msgspec

    paging = routes.parse(
        {
            "severity": [
                {"severity": "critical", "min_step_time_share": 0.2, "min_confidence": 0.8},
                {"severity": "warning", "causes": ["pcie"]},
            ],
            "routes": [
                {"name": "a", "type": "slack", "url": "https://h/a"},
                {
                    "name": "b",
                    "type": "slack",
                    "url": "https://h/b",
                    "match": {"min_confidence": 0.8},
                    "severity": [{"severity": "error"}],
                },
            ],
        },
        {},
    )
    a, b = paging.routes
    rec = lambda **kw: msgspec.to_builtins(f(**kw))  # noqa: E731
    assert a.severity_of(rec(share=0.3)) == "critical"
    assert a.severity_of(rec(share=0.3, conf=0.5)) == "info"  # no rule matched
    assert a.severity_of(rec(cause="pcie")) == "warning"
    assert b.severity_of(rec()) == "error"
    low = rec(conf=0.5)
    assert [(r.name, act) for r, act in plan("trigger", low, paging.routes, {})] == [("a", "trigger")]
    assert [(r.name, act) for r, act in plan("update", rec(), paging.routes, {"a": "delivered"})] == [("b", "trigger")]
    assert plan("update", rec(), paging.routes, {"a": "delivered", "b": "pending"}) == []
    assert [(r.name, act) for r, act in plan("resolve", low, paging.routes, {"a": "delivered", "b": "failed"})] == [
        ("a", "resolve")
    ]
    # acknowledged: the routes it paged are told, and a finding that would page another route pages none
    assert [(r.name, act) for r, act in plan("acknowledge", low, paging.routes, {"a": "delivered"})] == [
        ("a", "acknowledge")
    ]
    assert plan("update", rec(), paging.routes, {"a": "delivered"}, acked=True) == []
    assert plan("trigger", rec(), paging.routes, {}, acked=True) == []


def test_acknowledge_and_resolve_by_hand_payloads():
    import msgspec

    from lockstep.sinks.paging.pages import Page, pagerduty, slack, webhook

    rec = msgspec.to_builtins(f())
    ack = Page("acknowledge", "k-1", 1, rec, "error", "manual", 1_800_000_000.0)
    assert pagerduty(ack) == {"event_action": "acknowledge", "dedup_key": "k-1"}
    assert slack(ack)["text"].startswith(":eyes: Acknowledged")
    assert webhook(ack)["type"] == "incident.acknowledged"
    done = Page("resolve", "k-1", 1, rec, "error", "manual", 1_800_000_000.0)
    assert pagerduty(done) == {"event_action": "resolve", "dedup_key": "k-1"}
    assert "resolved by hand" in slack(done)["text"]
    assert webhook(done)["type"] == "incident.resolved"


def test_slack_pages_escape_what_a_function_or_job_name_could_do_there():
    import msgspec

    from lockstep.sinks.paging.pages import Page, slack

    hostile = f(function="<!channel> <https://evil.example|click> & co", job="<@U0ADMIN>")
    hostile.summary = "worker 3: <!here> slower"
    for action in ("trigger", "resolve"):
        body = slack(Page(action, "inc", 1, msgspec.to_builtins(hostile), "critical", "w2", 0.0))
        texts = []

        def walk(v, texts=texts):
            if isinstance(v, str):
                texts.append(v)
            elif isinstance(v, dict):
                [walk(x, texts) for x in v.values()]
            elif isinstance(v, list):
                [walk(x, texts) for x in v]

        walk(body)
        assert texts and not any("<" in t or ">" in t for t in texts), (
            texts
        )  # no mention, no link, nothing Slack parses
        joined = " ".join(texts)
        assert "&lt;!channel&gt;" in joined and "&amp; co" in joined and "&lt;@U0ADMIN&gt;" in joined


def test_pages_count_cpu_hours_for_a_job_without_accelerators():
    """A real CPU-only job's finding names its host; its workers' kind (``device_kind``) says whose hours the cost
    counts.  A finding from before the field keeps GPU-h."""
    import msgspec

    from lockstep.sinks.paging.pages import Page, pagerduty, slack

    cpu = f(function="preprocess")
    cpu.devices, cpu.device_kind = ["vm"], "cpu"
    old = msgspec.to_builtins(f(function="preprocess"))
    old.pop("device_kind", None)  # a record written before the field
    for rec, unit in ((msgspec.to_builtins(cpu), "CPU-h"), (old, "GPU-h")):
        page = Page("trigger", "inc", 1, rec, "critical", "w2", 0.0)
        assert f"{unit}/day" in str(slack(page)) and ("CPU-h" in str(slack(page))) == (unit == "CPU-h")
        assert pagerduty(page)["payload"]["custom_details"]["hours_unit"] == unit
