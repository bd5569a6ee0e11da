"""Files and processes an attacker can prepare: the sink's token file, and a parent killed without warning."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from lockstep.broker import EmbeddedBroker, free_port
from lockstep.metrics import Metrics
from lockstep.sinks.http import QueryServer, sidecar
from lockstep.sinks.store import FindingsStore


class _Sink:  # what the query server needs of a sink
    def __init__(self, store: FindingsStore):
        self.store, self.metrics, self.assigned = store, Metrics(), True


@pytest.mark.parametrize("planted", ["stale file, world-readable", "link to another file"])
def test_the_token_file_is_created_fresh_never_through_what_was_there(planted, tmp_path):
    db = tmp_path / "f.duckdb"
    side, victim = sidecar(db), tmp_path / "victim.txt"
    victim.write_text("keep me")
    if planted.startswith("stale"):
        side.write_text('{"url": "http://127.0.0.1:1", "token": "old"}')
        side.chmod(0o644)
    else:
        side.symlink_to(victim)
    store = FindingsStore(db)
    server = QueryServer(_Sink(store), db).start()
    try:
        assert (
            not side.is_symlink() and stat.S_IMODE(side.stat().st_mode) == 0o600
        )  # before: 0644 kept, or the link followed
        assert json.loads(side.read_text())["token"] != "old"
        assert victim.read_text() == "keep me"
    finally:
        server.stop()
        store.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


PARENT = """
import sys, time
from pathlib import Path
from lockstep.app.runtime import Child
from lockstep.broker import EmbeddedBroker, free_port
broker = EmbeddedBroker().start()
child = Child("broker", ["broker", "--port", str(free_port())], Path(sys.argv[1]))  # a lockstep child that runs until stopped
print(broker.pid, child.proc.pid, flush=True)
time.sleep(600)
"""


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` ended within ``timeout_s`` (a bound on waiting, not a measurement: the kernel signals at once)."""
    deadline = time.monotonic() + timeout_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


def test_a_parent_killed_with_sigkill_leaves_no_broker_and_no_child_behind(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        broker_pid, child_pid = map(int, parent.stdout.readline().split())
        deadline = time.monotonic() + 60
        while not (grandchildren := [p.pid for p in psutil.Process(child_pid).children(recursive=True)]):
            assert time.monotonic() < deadline, "the child did not start its broker"
            time.sleep(0.1)
        assert not _gone(broker_pid) and not _gone(child_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert _wait_gone(broker_pid), (
            f"the embedded broker (pid {broker_pid}) outlived its parent"
        )  # before: an orphan for good
        assert _wait_gone(child_pid), f"the child process (pid {child_pid}) outlived its parent"
        assert all(_wait_gone(p) for p in grandchildren), "the child's own broker outlived it"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow  # a real processor, and its broker taken away
def test_a_processor_told_to_stop_ends_even_when_its_broker_is_gone(tmp_path):
    """Before: a processor whose broker had gone (the demo SIGKILLed: broker and sink exit with it) never finished
    stopping, on SIGTERM or its parent's death, and logged 7.4 KB/s of errors for as long as it was left."""
    from lockstep.app.runtime import Child, settings_flags
    from lockstep.config import Settings
    from lockstep.kafka import ensure_topics

    broker = EmbeddedBroker().start()
    settings = Settings(
        bootstrap_servers=broker.bootstrap_servers,
        topic_prefix="stop",
        processor_id="proc-stop",
        sink_group="sink-stop",
        partitions=2,
        db=tmp_path / "f.duckdb",
    )
    ensure_topics(settings)
    port = free_port()
    proc = Child(
        "processor",
        ["processor", *settings_flags(settings, "processor"), "--http-port", str(port)],
        tmp_path,
        f"http://127.0.0.1:{port}/healthz",
    )
    try:
        proc.wait_healthy(90)
        broker.stop()
        time.sleep(2)  # its client now retries a broker that is not there
        proc.proc.send_signal(signal.SIGTERM)
        assert _wait_gone(proc.proc.pid, 60), f"the processor did not end after SIGTERM:\n{proc.tail()}"
    finally:
        proc.kill()
        broker.stop()
