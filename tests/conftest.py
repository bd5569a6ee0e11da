"""Shared fixtures.  The Kafka fixture uses, in order: an existing Kafka named by
LOCKSTEP_BOOTSTRAP_SERVERS; an Apache Kafka container through testcontainers when
a Docker engine answers; otherwise the embedded broker (Tansu) started here."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
from hypothesis import settings as hypothesis_settings

from lockstep.config import Settings
from tests.tiers import quick_tier


def pytest_configure(config):
    """The quick tier runs property tests with fewer examples (tests/tiers.py); ``--hypothesis-profile`` overrides it."""
    if not config.getoption("--hypothesis-profile", None):
        hypothesis_settings.load_profile("quick" if quick_tier(config.getoption("markexpr", "") or "") else "full")


def _docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap():
    existing = os.environ.get("LOCKSTEP_BOOTSTRAP_SERVERS")
    if existing:
        yield existing
        return
    if _docker_answers():
        try:
            from testcontainers.kafka import KafkaContainer
        except ImportError:
            pass
        else:
            with KafkaContainer().with_kraft() as kc:
                yield kc.get_bootstrap_server()
            return
    from lockstep.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap_servers


@pytest.fixture
def settings(kafka_bootstrap, tmp_path) -> Settings:
    """Settings isolated per test: own topic prefix, consumer groups and DuckDB file."""
    tag = uuid.uuid4().hex[:8]
    return Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"t{tag}",
        processor_id=f"proc-{tag}",
        sink_group=f"sink-{tag}",
        partitions=3,
        db=tmp_path / "findings.duckdb",
        step_timeout_s=5.0,
        window_timeout_s=10.0,
    )


def _voluntary_switches() -> int:
    """How often the calling thread has slept so far (waited for a lock, a socket, a timer): a count, which
    other processes' load does not change, unlike a duration (Linux: /proc/thread-self/status)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise RuntimeError("no voluntary_ctxt_switches in /proc/thread-self/status")


@pytest.fixture
def thread_waits():
    """``thread_waits()``: how often this thread has slept so far (see :func:`_voluntary_switches`)."""
    return _voluntary_switches
