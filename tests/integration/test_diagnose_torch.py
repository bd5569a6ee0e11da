"""`lockstep diagnose` on traces written by a real multi-process PyTorch job (CPU, gloo, 4 ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_faults as rf

pytestmark = pytest.mark.integration
JOB = Path(__file__).with_name("torch_job.py")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("traces")
    subprocess.run(
        [sys.executable, str(JOB), str(out), "--ranks", "4", "--slow-rank", "2", "--slow-ms", "25", "--steps", "6"],
        check=True,
        timeout=240,
        capture_output=True,
    )
    files = sorted(out.glob("rank*.json"))
    assert len(files) == 4
    return files


def lockstep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=120)


def test_diagnose_names_the_slowed_rank_and_function(traces):
    p = lockstep("diagnose", *map(str, traces), "--json")
    assert p.returncode == 0, p.stderr
    findings = json.loads(p.stdout)
    assert findings, "no finding"
    top = findings[0]
    assert (top["scope"], top["workers"], top["function"]) == ("worker", [2], "slow_function"), top["summary"]
    assert top["cause"] == "rank_specific_code" and top["schema"] == "Finding"
    assert top["impact"]["step_time_share"] > 0  # 25 ms of a ~50 ms step here; the share depends on the machine's load
    # the healthy ranks waited for it in the all-reduce: their waiting is never blamed with any confidence (a healthy
    # rank descheduled on 2 shared CPUs in most of these 6 short steps may page on its own work: 3 of 10 runs under a
    # bursty load, and once in CI)
    assert not rf.victims_paged(findings, 2), rf.victims_paged(findings, 2)


def test_diagnose_prints_a_table(traces):
    p = lockstep("diagnose", *map(str, traces))
    assert p.returncode == 0, p.stderr
    assert "slow_function" in p.stdout and "4 workers x 6 steps" in p.stdout
