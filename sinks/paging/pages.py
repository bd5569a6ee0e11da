"""What a page says and when to send it again.  Pure: payloads, signatures, backoff, routing decisions.

A page holds what the Finding record holds and nothing more: fields the agent
redacted arrive redacted and stay so.  A route that leaves the tenant can also
hide function names (``redact_functions``): each becomes ``fn:<sha256 prefix>``,
stable, so that pages about the same function can still be matched up.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

from ...schemas.records import CAUSES
from .routes import Retry, Route


@dataclass(frozen=True)
class Page:
    action: str  # trigger | acknowledge | resolve
    incident_id: str  # the PagerDuty dedup_key
    occurrence: int
    finding: dict[str, Any]  # the Finding record (for a resolve: the incident's last finding)
    severity: str
    reason: str  # the window that showed or cleared it; "stale" when nothing saw it for long; "recovered"; "job_ended"
    occurred_at: float


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


_BRACKETED = re.compile(r"\[([^\]]+)\]")


def redact_functions(finding: dict[str, Any]) -> dict[str, Any]:
    """The finding with every function name (its own and those in the evidence) replaced by a hash."""
    names = {finding["function"]} | {m for e in finding["evidence"] for m in _BRACKETED.findall(e["feature"])}
    token = {n: "fn:" + hashlib.sha256(n.encode()).hexdigest()[:12] for n in names if n}

    def hide(text: str) -> str:
        for name in sorted(token, key=len, reverse=True):  # longest first: "fwd.gemm2" before "fwd.gemm"
            text = text.replace(name, token[name])
        return text

    return finding | {
        "function": token.get(finding["function"], finding["function"]),
        "summary": hide(finding.get("summary", "")),
        "evidence": [e | {"feature": hide(e["feature"])} for e in finding["evidence"]],
    }


def _where(f: dict[str, Any]) -> str:
    if f["devices"]:
        return ", ".join(f["devices"][:3]) + (f" (+{len(f['devices']) - 3})" if len(f["devices"]) > 3 else "")
    if f["hosts"]:
        return ", ".join(f["hosts"][:3]) + (f" (+{len(f['hosts']) - 3})" if len(f["hosts"]) > 3 else "")
    return "every worker" if f["scope"] == "job" else f"workers {f['workers'][:6]}"


def hours_unit(f: dict[str, Any]) -> str:
    """Whose hours a finding's cost counts: ``CPU-h`` for a job whose workers have no accelerator (the finding's
    ``device_kind``), ``GPU-h`` otherwise (and for findings from before it)."""
    return "CPU-h" if f.get("device_kind") == "cpu" else "GPU-h"


def _headline(p: Page) -> str:
    f = p.finding
    share = f["impact"]["step_time_share"] * 100
    return f"[{f['job']}] {f['cause']} on {_where(f)}: {f['function']}, {share:.1f}% of step time"


def _details(p: Page) -> dict[str, Any]:
    f = p.finding
    return {
        "incident": p.incident_id,
        "occurrence": p.occurrence,
        "finding": f["id"],
        "tenant": f.get("tenant", ""),
        "job": f["job"],
        "window": f["window"],
        "scope": f["scope"],
        "workers": f["workers"],
        "hosts": f["hosts"],
        "devices": f["devices"],
        "function": f["function"],
        "function_kind": f["function_kind"],
        "cause": f["cause"],
        "cause_description": CAUSES.get(f["cause"], ""),
        "confidence": f["confidence"],
        "step_time_share": f["impact"]["step_time_share"],
        "gpu_hours_per_day": f["impact"]["gpu_hours_per_day"],
        "hours_unit": hours_unit(f),  # what gpu_hours_per_day counts: GPU-h, or CPU-h for a job without accelerators
        "steps": f"{len(f['steps'])}/{f.get('window_steps') or len(f['steps'])}",
        "evidence": f["evidence"],
        "summary": f.get("summary", ""),
        "policy": f["policy"],
    }


#: a resolve's reason, for people (any other reason is the window that closed without the problem)
RESOLVED_WHY = {
    "stale": "nothing has seen it for a while",
    "recovered": "the job's step time is back at its level before the slowdown",
    "job_ended": "the job ended",
    "manual": "resolved by hand",
}


def pagerduty(p: Page) -> dict[str, Any]:
    """PagerDuty Events API v2, without ``routing_key`` (added when sent: it is a secret)."""
    if p.action in ("acknowledge", "resolve"):
        return {"event_action": p.action, "dedup_key": p.incident_id}
    f = p.finding
    return {
        "event_action": "trigger",
        "dedup_key": p.incident_id,
        "client": "Lockstep",
        "payload": {
            "summary": _headline(p)[:1024],
            "source": (f["devices"] or f["hosts"] or [f["job"]])[0],
            "severity": p.severity,
            "timestamp": _iso(f["created_at"]),
            "component": f["function"],
            "group": f["job"],
            "class": f["cause"],
            "custom_details": _details(p),
        },
    }


_EMOJI = {
    "critical": ":red_circle:",
    "error": ":large_orange_circle:",
    "warning": ":large_yellow_circle:",
    "info": ":large_blue_circle:",
}


def slack_escape(text: str) -> str:
    """Slack's control characters as entities: a function or job name cannot mention (``<!channel>``), link
    (``<https://evil|click>``) or format through them.  Our own templates use none of the three."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack(p: Page) -> dict[str, Any]:
    """Slack incoming webhook: ``text`` (notifications, fallback) and Block Kit ``blocks``; every text escaped."""
    f = p.finding
    if p.action == "resolve":
        why = RESOLVED_WHY.get(p.reason) or f"window {p.reason} closed without it"
        text = slack_escape(f":white_check_mark: Resolved {_headline(p)} ({why})")
        return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}
    if p.action == "acknowledge":
        text = slack_escape(f":eyes: Acknowledged {_headline(p)} (someone is on it; no more pages for it)")
        return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}
    text = slack_escape(f"{_EMOJI.get(p.severity, '')} {p.severity.upper()} {_headline(p)}")
    fields = [
        ("Job", f"{f['job']} (tenant {f.get('tenant') or '-'})"),
        ("Where", _where(f)),
        ("Function", f"{f['function']} ({f['function_kind']})"),
        ("Cause", f"{f['cause']}: {CAUSES.get(f['cause'], '')}"),
        ("Confidence", f"{f['confidence']:.2f}"),
        (
            "Cost",
            f"{f['impact']['step_time_share'] * 100:.1f}% of step, {f['impact']['gpu_hours_per_day']:.1f} {hours_unit(f)}/day",
        ),
        ("Steps", f"{len(f['steps'])}/{f.get('window_steps') or len(f['steps'])} of window {f['window']}"),
        ("Incident", p.incident_id),
    ]
    evidence = "; ".join(f"{e['feature']} {e['value']} vs {e['peer_value']}" for e in f["evidence"][:4])
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{text}*\n{slack_escape(f.get('summary', ''))}"}},
            {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{slack_escape(v)}"} for k, v in fields]},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"evidence: {slack_escape(evidence)}"}]},
        ],
    }


def webhook(p: Page) -> dict[str, Any]:
    """Generic JSON (the Standard Webhooks envelope): ``type``, ``timestamp``, ``data``."""
    return {
        "type": f"incident.{ {'trigger': 'triggered', 'acknowledge': 'acknowledged'}.get(p.action, 'resolved') }",
        "timestamp": _iso(p.occurred_at),
        "data": {
            "incident": {
                "id": p.incident_id,
                "occurrence": p.occurrence,
                "action": p.action,
                "severity": p.severity,
                "reason": p.reason,
            },
            "finding": p.finding,
        },
    }


BUILDERS = {"pagerduty": pagerduty, "slack": slack, "webhook": webhook}


def payload(route: Route, p: Page) -> dict[str, Any]:
    """What the route sends for this page, as stored in the delivery log (no secrets in it)."""
    if route.redact_functions:
        p = Page(**{**p.__dict__, "finding": redact_functions(p.finding)})
    return BUILDERS[route.receiver](p)


def wire_body(route: Route, stored: dict[str, Any]) -> bytes:
    """The request body: the stored payload, plus the PagerDuty routing key."""
    if route.receiver == "pagerduty":
        stored = {"routing_key": route.routing_key, **stored}
    return json.dumps(stored, separators=(",", ":")).encode()


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def plan(
    action: str, finding: dict[str, Any], routes: tuple[Route, ...], triggered: dict[str, str], acked: bool = False
) -> list[tuple[Route, str]]:
    """Deliveries for one incident event.  ``triggered``: route -> status of its trigger for this incident;
    ``acked``: someone acknowledged the incident.

    A route pages an incident once: on the first finding of it that matches the route (a later, more
    confident finding can still page a route the first one did not match, until someone acknowledges it).
    It acknowledges and resolves only what it paged.
    """
    if action in ("trigger", "update"):
        if acked:
            return []
        return [(r, "trigger") for r in routes if r.name not in triggered and r.matches(finding)]
    if action in ("acknowledge", "resolve"):
        return [(r, action) for r in routes if triggered.get(r.name) not in (None, "failed")]
    raise ValueError(f"unknown incident action {action!r}")


def retryable(status: int | None) -> bool:
    """Timeouts and connection errors (None), 429 and 5xx are retried; any other answer is final."""
    return status is None or status == 429 or status >= 500


def backoff_s(failures: int, retry: Retry, u: float, retry_after_s: float | None = None) -> float:
    """Exponential backoff with jitter: half of min(max, initial * 2^(failures-1)) plus up to as much again.

    ``u`` is uniform in [0, 1).  A receiver's Retry-After is honoured up to ``max_backoff_s``."""
    cap = min(retry.max_backoff_s, retry.initial_backoff_s * 2 ** (failures - 1))
    delay = cap / 2 + u * cap / 2
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, retry.max_backoff_s))
    return float(delay)
