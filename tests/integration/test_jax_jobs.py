"""Real JAX jobs: several CPU processes (``jax.distributed``, Gloo collectives) training data-parallel, one of them
slowed in the host function ``preprocess``.  Offline, ``lockstep diagnose`` on the JAX profiler's traces must name
that process and function; live, the agent (``attach`` + ``agent.step()`` in the JAX loop) and the real pipeline
(embedded broker, processor, sink, default policy, no trigger by hand) must.  Skipped only where JAX cannot be
imported (it is the ``jax`` extra, and in ``test``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.broker import free_port
from lockstep.sinks.http import query, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_faults as rf

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself
JOB = Path(__file__).with_name("jax_job.py")
FAULT_AT = 60


@pytest.fixture(scope="module", autouse=True)
def jax_installed():
    """Imported in the tests, never at collection (DEVELOPING.md)."""
    pytest.importorskip("jax", reason="JAX is not installed (pip install -e '.[jax]')")


def start(out: Path, world: int, env: dict[str, str]) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{free_port()}"
    full = {**os.environ, "OUT_DIR": str(out), "OMP_NUM_THREADS": "1", **env}
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), str(i), str(world), coordinator],
            env=full,
            stdout=open(out / f"process{i}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(world)
    ]


def logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(out.glob("process*.log")))


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("jax")
    procs = start(out, 3, {"MODE": "trace", "SLOW_RANK": "2", "SLOW_MS": "25", "TRACE_FROM": "3", "TRACE_STEPS": "6"})
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0, 0], logs(out)
    files = sorted(out.glob("rank*/plugins/profile/*/perfetto_trace.json.gz"))
    assert len(files) == 3, list(out.rglob("*"))
    return files


def lockstep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=120)


def test_diagnose_names_the_slowed_jax_process_and_function(traces):
    p = lockstep("diagnose", *map(str, traces), "--json")
    assert p.returncode == 0, p.stderr
    findings = json.loads(p.stdout)
    assert findings, "no finding"
    top = findings[0]
    assert (top["scope"], top["workers"], top["function"]) == ("worker", [2], "preprocess"), top["summary"]
    assert top["impact"]["step_time_share"] > 0
    # the other processes waited for it in XLA's all-reduce: their waiting is never blamed with any confidence
    assert not rf.victims_paged(findings, 2), rf.victims_paged(findings, 2)


def test_diagnose_reads_the_jax_steps_and_ranks(traces):
    p = lockstep("diagnose", str(traces[0].parents[4]))  # the folder of the processes' log folders
    assert p.returncode == 0, p.stderr
    assert "preprocess" in p.stdout and "3 workers x 6 steps (3..8)" in p.stdout, p.stdout


@pytest.mark.timeout(600)
def test_a_live_jax_job_with_a_slow_process_is_named(settings, tmp_path, pipeline):
    world, slow = 2, 1
    env = {
        "MODE": "live",
        "JOB": "jax2",
        "SLOW_RANK": str(slow),
        "SLOW_MS": "30",
        "FAULT_AT": str(FAULT_AT),
        "MAX_STEPS": "4000",
        "LOCKSTEP_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "LOCKSTEP_TOPIC_PREFIX": settings.topic_prefix,
        "LOCKSTEP_AGENT_REDACT": "none",
    }
    procs = start(tmp_path, world, env)
    try:

        def named() -> list[tuple]:
            if any(p.poll() is not None for p in procs):
                pytest.fail(f"the job ended early:\n{logs(tmp_path)}")
            rows = query(
                settings.db,
                "SELECT window_id, workers, function, cause, confidence FROM findings WHERE job = ?",
                ["jax2"],
            )[1]
            return [f for f in rows if list(f[1]) == [slow] and f[2] == "preprocess"]

        assert wait_for(named, 300, 1.0), query(settings.db, "SELECT * FROM findings WHERE job = ?", ["jax2"])
        print(f"\nLIVE JAX: {named()[0]}")
    finally:
        (tmp_path / "stop").touch()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    windows = query(settings.db, "SELECT window_id, expected_workers FROM windows WHERE job = ?", ["jax2"])[1]
    assert windows and all(expected == world for _, expected in windows), windows
