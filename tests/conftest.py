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


#: the folders whose tests start real processes (brokers, processors, PyTorch ranks) or measure them: under
#: ``pytest -n 2`` (the README's test command) they run one at a time, in order, in one xdist worker, as in one
#: process, while the other worker runs the rest of the suite (in-process tests: the whole suite in one process kept
#: 41% of 2 cores busy, the real processes mostly waiting on real time)
SERIAL_FOLDERS = ("integration", "adversarial")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler for ``-n``: LoadScopeScheduling with one scope for the tests of SERIAL_FOLDERS and one per
    test for the rest (``--dist loadgroup`` would do it with marks, but it renames the tests' node ids, which pytest 9
    no longer lets it do: its groups are silently ignored)."""
    from xdist.scheduler import LoadScopeScheduling

    class Split(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "processes" if nodeid.startswith(tuple(f"tests/{f}/" for f in SERIAL_FOLDERS)) else nodeid

    return Split(config, log)


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
