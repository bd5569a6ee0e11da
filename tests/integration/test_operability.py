"""What a new user and an on-call engineer meet first: the demo in a production environment, progress on a
terminal only, the processor's start-up in the logs (JSON on request)."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.kafka import admin
from lockstep.sinks.store import FindingsStore

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def run_with_tty_stderr(args, env=None, cwd=None, timeout=240):
    """Run ``lockstep ARGS`` with stderr on a terminal (a pty) and stdout on a pipe; (rc, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", *args], stdout=subprocess.PIPE, stderr=slave, env=env, cwd=cwd
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        shown += chunk
    out = proc.stdout.read().decode()
    proc.wait(timeout=timeout)
    os.close(master)
    return proc.returncode, out, shown.decode(errors="replace")


def test_progress_shows_on_a_terminal_only_and_never_with_json(tmp_path):
    suite = str(ROOT / "suites/standard/gpu_slow-00-16w.yaml")
    rc, out, shown = run_with_tty_stderr(["evaluate", suite], cwd=tmp_path)
    assert rc == 0 and "gpu_slow" in out
    assert "/1 [" in shown and "scenario" in shown  # the bar, on the terminal
    rc, out, shown = run_with_tty_stderr(["evaluate", suite, "--json"], cwd=tmp_path)
    assert rc == 0 and json.loads(out)["overall"]["scenarios"] == 1 and "/1 [" not in shown
    r = subprocess.run(
        [sys.executable, "-m", "lockstep", "evaluate", suite], capture_output=True, text=True, cwd=tmp_path, timeout=240
    )
    assert r.returncode == 0 and "/1 [" not in r.stderr and "\r" not in r.stderr  # not a terminal: no bar


def test_the_processor_logs_its_start_partitions_and_policy_as_json_on_request(settings, tmp_path):
    port = free_port()
    proc = Child(
        "processor",
        ["processor", *settings_flags(settings, "processor"), "--log-format", "json", "--http-port", str(port)],
        tmp_path,
        f"http://127.0.0.1:{port}/healthz",
    )
    try:
        proc.wait_healthy(90)
        deadline = time.monotonic() + 30
        while "partitions assigned" not in proc.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.stop()
    records = [
        json.loads(line) for line in proc.log_path.read_text().splitlines() if line.strip()
    ]  # every line is a JSON object
    start = next(r for r in records if "starting" in r["message"])
    assert start["logger"] == "lockstep.processor" and start["level"] == "INFO" and {"ts", "pid"} <= set(start)
    assert (
        settings.processor_id in start["message"]
        and "default@" in start["message"]
        and f"{settings.partitions} partitions" in start["message"]
    )
    assigned = next(r for r in records if "partitions assigned" in r["message"])
    assert f"{settings.topic_prefix}.heartbeats 0,1,2" in assigned["message"]


def test_the_demo_in_a_production_environment_touches_nothing_of_it(kafka_bootstrap, tmp_path):
    prod_db = tmp_path / "prod.duckdb"
    FindingsStore(prod_db).close()
    before = prod_db.read_bytes()
    config = tmp_path / "prod.yaml"
    config.write_text(
        f"bootstrap_servers: {kafka_bootstrap}\nprocessor_id: prod-processor\nsink_group: prod-sink\ntopic_prefix: prodx\ndb: {prod_db}\n"
    )
    env = dict(
        os.environ, LOCKSTEP_CONFIG=str(config), LOCKSTEP_DB=str(prod_db), LOCKSTEP_BOOTSTRAP_SERVERS=kafka_bootstrap
    )
    topics_before = set(admin_topics(kafka_bootstrap))
    r = subprocess.run(
        [sys.executable, "-m", "lockstep", "demo", "--json", "--workers", "32"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (finding,) = json.loads(r.stdout)
    assert finding["workers"] == [13] and finding["cause"] == "gpu_throttle_thermal"
    assert prod_db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["prod.duckdb", "prod.yaml"]
    assert set(admin_topics(kafka_bootstrap)) == topics_before  # its own broker: nothing created on the configured one
    assert "\r" not in r.stderr  # no progress bar into a pipe


def admin_topics(bootstrap):
    from lockstep.config import Settings

    return admin(Settings(bootstrap_servers=bootstrap)).list_topics(timeout=10).topics
