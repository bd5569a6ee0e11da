"""docker-compose.yml and the Dockerfile, read the way Docker reads them (for the tests)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def entrypoint() -> list[str]:
    m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile has an exec-form ENTRYPOINT"
    return json.loads(m.group(1))


def container_argv(svc: dict) -> list[str]:
    """What Docker executes: the service's entrypoint (else the image's) followed by its command."""
    ep = svc.get("entrypoint", entrypoint())
    return (shlex.split(ep) if isinstance(ep, str) else list(ep)) + list(svc.get("command") or [])


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """compose's ``${VAR}`` / ``${VAR:-default}``."""
    env = dict(os.environ) if env is None else env
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def documented_commands() -> list[list[str]]:
    """The ``docker compose ...`` lines of the compose file's header, without ``docker compose``."""
    out = []
    for line in (ROOT / "docker-compose.yml").read_text().splitlines():
        m = re.match(r"#\s+(?:\S+=\S+\s+)?docker compose (.+?)(?:\s+#.*)?$", line)
        if m:
            out.append(shlex.split(m.group(1)))
    return out
