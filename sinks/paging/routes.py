"""The paging routes file: where pages go, for which findings, at which severity.  Validated at start-up.

```yaml
version: 1
severity:                 # first rule that matches; default below
  - {min_step_time_share: 0.20, severity: critical}
  - {min_step_time_share: 0.05, severity: error}
  - {severity: warning}
retry: {max_attempts: 8, initial_backoff_s: 1, max_backoff_s: 300, timeout_s: 10}
routes:
  - name: oncall
    type: pagerduty                       # pagerduty | slack | webhook
    routing_key_env: PD_ROUTING_KEY       # secrets only from the environment
    match: {jobs: ["llm-*"], tenants: [research], causes: [gpu_throttle_thermal], min_confidence: 0.8}
  - name: team-channel
    type: slack
    url_env: SLACK_WEBHOOK_URL
    redact_functions: true                # the channel is outside the tenant
  - name: tickets
    type: webhook
    url: https://hooks.example.com/lockstep
    secret_env: TICKETS_WEBHOOK_SECRET    # whsec_<base64>, Standard Webhooks
```
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from ...schemas.errors import LockstepError
from ...schemas.records import CAUSES

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
SEVERITIES = ("critical", "error", "warning", "info")  # PagerDuty's, most severe first


class RoutesError(LockstepError, ValueError):
    """The routes file is missing, malformed, or names a secret that is not set."""


class Match(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    jobs: list[str] = []  # shell patterns (fnmatch); empty: every job
    tenants: list[str] = []  # empty: every tenant
    causes: list[str] = []  # empty: every cause
    min_confidence: float = 0.0


class SeverityRule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    severity: Literal["critical", "error", "warning", "info"]
    min_step_time_share: float = 0.0
    min_confidence: float = 0.0
    causes: list[str] = []


class Retry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_attempts: int = 8
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 300.0
    timeout_s: float = 10.0


DEFAULT_SEVERITY = (
    SeverityRule(severity="critical", min_step_time_share=0.20),
    SeverityRule(severity="error", min_step_time_share=0.05),
    SeverityRule(severity="warning"),
)


class RouteSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    type: Literal["pagerduty", "slack", "webhook"]
    url: str | None = None
    url_env: str | None = None
    routing_key_env: str | None = None
    secret_env: str | None = None
    match: Match = Match()
    severity: list[SeverityRule] | None = None  # overrides the file's rules for this route
    redact_functions: bool = False
    min_interval_s: float | None = None  # between two sends; Slack takes about one message a second


class RoutesFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    routes: list[RouteSpec]
    version: int = 1
    severity: list[SeverityRule] = msgspec.field(default_factory=lambda: list(DEFAULT_SEVERITY))
    retry: Retry = Retry()


@dataclass(frozen=True)
class Route:
    """A validated route with its secrets resolved."""

    name: str
    receiver: str  # pagerduty | slack | webhook
    url: str
    match: Match
    severity: tuple[SeverityRule, ...]
    redact_functions: bool
    min_interval_s: float
    routing_key: str | None = None  # PagerDuty
    secret: bytes | None = None  # generic webhook signing key

    def matches(self, finding: dict[str, Any]) -> bool:
        m = self.match
        return (
            (not m.jobs or any(fnmatch.fnmatchcase(finding["job"], p) for p in m.jobs))
            and (not m.tenants or finding.get("tenant", "") in m.tenants)
            and (not m.causes or finding["cause"] in m.causes)
            and finding["confidence"] >= m.min_confidence
        )

    def severity_of(self, finding: dict[str, Any]) -> str:
        for rule in self.severity:
            if (
                finding["impact"]["step_time_share"] >= rule.min_step_time_share
                and finding["confidence"] >= rule.min_confidence
                and (not rule.causes or finding["cause"] in rule.causes)
            ):
                return rule.severity
        return "info"


@dataclass(frozen=True)
class Paging:
    routes: tuple[Route, ...]
    retry: Retry


def webhook_secret(value: str, where: str) -> bytes:
    """A Standard Webhooks secret: ``whsec_`` + base64 of 24 to 64 random bytes (the prefix is optional)."""
    raw = value.removeprefix("whsec_")
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise RoutesError(f"{where}: the webhook secret must be whsec_<base64> (Standard Webhooks)") from None
    if not 24 <= len(key) <= 64:
        raise RoutesError(f"{where}: the webhook secret must hold 24 to 64 bytes, it holds {len(key)}")
    return key


def _check_rules(rules: list[SeverityRule], where: str) -> None:
    if not rules:
        raise RoutesError(f"{where}: severity needs at least one rule")
    for r in rules:
        bad = sorted(set(r.causes) - set(CAUSES))
        if bad:
            raise RoutesError(f"{where}: unknown cause(s) {bad} in a severity rule")


def parse(data: object, env: dict[str, str] | None = None, source: str = "routes") -> Paging:
    env = dict(os.environ if env is None else env)
    try:
        spec = msgspec.convert(data, RoutesFile)
    except msgspec.ValidationError as exc:
        raise RoutesError(f"{source}: {exc}") from None
    if spec.version != 1:
        raise RoutesError(f"{source}: version {spec.version} is not supported (this build reads 1)")
    r = spec.retry
    if r.max_attempts < 1 or r.initial_backoff_s <= 0 or r.max_backoff_s < r.initial_backoff_s or r.timeout_s <= 0:
        raise RoutesError(
            f"{source}: retry needs max_attempts >= 1, 0 < initial_backoff_s <= max_backoff_s, timeout_s > 0"
        )
    _check_rules(spec.severity, source)

    def secret(route: RouteSpec, field: str) -> str:
        name = getattr(route, field)
        if not name:
            raise RoutesError(f"{source}: route {route.name!r} ({route.type}) needs {field}")
        value = env.get(name, "")
        if not value:
            raise RoutesError(f"{source}: route {route.name!r}: environment variable {name} ({field}) is not set")
        return value

    routes: list[Route] = []
    for rs in spec.routes:
        where = f"{source}: route {rs.name!r}"
        if rs.name in {x.name for x in routes}:
            raise RoutesError(f"{where}: route names must be unique")
        bad = sorted(set(rs.match.causes) - set(CAUSES))
        if bad:
            raise RoutesError(f"{where}: unknown cause(s) {bad}; known: {', '.join(CAUSES)}")
        if rs.url and rs.url_env:
            raise RoutesError(f"{where}: give url or url_env, not both")
        url = (
            secret(rs, "url_env")
            if rs.url_env
            else (rs.url or (PAGERDUTY_EVENTS_URL if rs.type == "pagerduty" else ""))
        )
        if not url.startswith(("http://", "https://")):
            raise RoutesError(f"{where}: needs an http(s) url (url, or url_env naming an environment variable)")
        if rs.severity is not None:
            _check_rules(rs.severity, where)
        routes.append(
            Route(
                name=rs.name,
                receiver=rs.type,
                url=url,
                match=rs.match,
                severity=tuple(rs.severity if rs.severity is not None else spec.severity),
                redact_functions=rs.redact_functions,
                min_interval_s=rs.min_interval_s
                if rs.min_interval_s is not None
                else (1.0 if rs.type == "slack" else 0.0),
                routing_key=secret(rs, "routing_key_env") if rs.type == "pagerduty" else None,
                secret=webhook_secret(secret(rs, "secret_env"), where) if rs.type == "webhook" else None,
            )
        )
    return Paging(routes=tuple(routes), retry=spec.retry)


def load(path: Path | str, env: dict[str, str] | None = None) -> Paging:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RoutesError(f"routes file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise RoutesError(f"routes file {path}: not a text file") from None
    except yaml.YAMLError as exc:
        raise RoutesError(f"routes file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse(data, env, f"routes file {path}")
