"""Hung real jobs: a 4-rank torch DDP job on gloo, launched as a user would (``lockstep agent run -- torchrun``), next
to the real broker, processor and sink.  One rank stops (stuck in its data loading, spinning in a Python loop that
holds the GIL, or killed with SIGKILL); the detector sees no progress and triggers a hang window; the agents answer
from their own threads; the hang stage must name that rank, and where it is, in a finding the sink stored.

Every process of the job is killed at the end, whatever the outcome (torchrun would wait for the stuck rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lockstep.app.runtime import Pipeline
from lockstep.broker import free_port
from lockstep.kafka import ensure_topics
from lockstep.sinks.http import query, wait_for
from lockstep.streams.app import changelog_topics
from tests.integration.test_paging import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
WORLD = 4
HANG_AT = 40
#: a hang after 3 s without progress (the job's steps take ~30 ms); no slowdown or baseline windows before it
POLICY = """id: hangtest
detector:
  hang_factor: 10
  hang_min_s: 3
  slowdown_threshold: 5.0
  baseline_every_steps: 0
  window_steps: 4
  small_job_window_steps: 4
  control_latency_s: 0.2
"""


@dataclass
class HungJob:
    job: str
    proc: subprocess.Popen
    out: Path

    def kill(self) -> None:
        """Every process of the job: the launcher's group, then each rank (torchrun starts them in sessions of their own)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for f in self.out.glob("pid.*"):
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(f.read_text()), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def log(self) -> str:
        return (self.out / "job.log").read_text(errors="replace")[-4000:]


def start_job(settings, tmp_path: Path, job: str, rank: int, mode: str) -> HungJob:
    out = tmp_path / job
    out.mkdir()
    env = {
        **os.environ,
        "HANG_RANK": str(rank),
        "HANG_MODE": mode,
        "HANG_AT": str(HANG_AT),
        "STOP_FILE": str(out / "stop"),
        "OUT_DIR": str(out),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "LOCKSTEP_AGENT_REDACT": "paths=strip,stacks=keep",
    }
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "agent",
        "run",
        "--job",
        job,
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *(MONITOR_FLAGS if mode == "kill" else ()),
        str(HERE / "hang_job.py"),
    ]
    log = open(out / "job.log", "wb")  # noqa: SIM115 - the job writes into it until it ends
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return HungJob(job, proc, out)


#: torchrun stops every rank within its monitor interval (0.1 s) of one's death; a launcher that leaves the others
#: running (as NCCL jobs hang on a dead peer) is what the killed case is about
MONITOR_FLAGS = ("--monitor-interval", "3600")


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def pipeline(settings, tmp_path, receiver):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "retry: {max_attempts: 3, initial_backoff_s: 0.05, max_backoff_s: 0.2, timeout_s: 2}\n"
        f"routes:\n  - {{name: slack, type: slack, url: '{receiver.url}/slack', min_interval_s: 0}}\n"
    )
    s = dataclasses.replace(settings, policy=policy, routes=routes)
    ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    p = Pipeline(s, tmp_path)
    p.start("sink", 60)
    p.start("processor", 60)
    yield s
    p.stop()


def hang_findings(settings, job: str) -> list[tuple]:
    return query(
        settings.db,
        "SELECT workers, function, cause, confidence, summary, devices FROM findings WHERE job = ? "
        "AND cause IN ('hang', 'worker_died')",
        [job],
    )[1]


def run_case(settings, tmp_path, mode: str, rank: int) -> list[tuple]:
    job = start_job(settings, tmp_path, f"hang-{mode}", rank, mode)
    try:

        def named() -> list[tuple]:
            return [f for f in hang_findings(settings, job.job) if rank in f[0]]

        found = wait_for(named, 240, 1.0)
        assert found, f"no hang finding named rank {rank}: {hang_findings(settings, job.job)}\n{job.log()}"
        return named()
    finally:
        job.kill()


@pytest.mark.timeout(400)
def test_a_rank_stuck_in_its_data_loading_is_named_with_where_it_is_and_paged(settings, tmp_path, pipeline, receiver):
    found = run_case(pipeline, tmp_path, "dataload", 3)
    workers, function, cause, confidence, summary, _ = found[0]
    print(f"\nHANG dataload: {workers} {function} ({cause}, {confidence:.2f}): {summary}")
    assert workers == [3] and cause == "hang"
    assert "DataLoader" in function or "__getitem__" in function, function
    assert "__getitem__" in summary  # the frame it is stuck in
    assert "3 of 4 answering workers wait in" in summary, summary
    assert "_engine_run_backward" in summary  # where the others wait: DDP's gradient all-reduce, in backward

    def paged() -> bool:
        return any(b"hang" in r["body"] and b"3" in r["body"] for r in receiver.to("/slack"))

    assert wait_for(paged, 60, 0.5), receiver.requests


@pytest.mark.timeout(400)
def test_a_rank_spinning_in_python_is_named_in_its_region(settings, tmp_path, pipeline):
    found = run_case(pipeline, tmp_path, "spin", 2)
    workers, function, cause, confidence, summary, _ = found[0]
    print(f"\nHANG spin: {workers} {function} ({cause}, {confidence:.2f}): {summary}")
    assert workers == [2] and cause == "hang"
    assert function == "rank_specific_metrics", function
    assert "spin" in summary  # its innermost frame


@pytest.mark.timeout(400)
def test_a_killed_rank_is_named_as_exited(settings, tmp_path, pipeline):
    found = run_case(pipeline, tmp_path, "kill", 1)
    workers, function, cause, confidence, summary, _ = found[0]
    print(f"\nHANG kill: {workers} {function} ({cause}, {confidence:.2f}): {summary}")
    assert workers == [1] and cause == "worker_died", found
    assert "exited" in summary
