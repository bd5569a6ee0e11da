"""The diagnosis on what real faulty jobs produced: the fixtures of tests/integration/real_faults.py.

Four gloo ranks on CPU, sampled by the agent's sampler, rank 2 carrying the fault (a veth limited by
``tc``, CPU contention from another process, a slow DataLoader, extra compute). The fixtures hold what
the diagnosis reads of each run (function tables with hardware mean, spread and peak); rerun the jobs
with ``python tests/integration/real_faults.py tests/data/real``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

HERE = Path(__file__).resolve().parent
REAL = HERE.parent / "data" / "real"
sys.path.insert(0, str(HERE.parent / "integration"))
import real_faults as rf  # noqa: E402

from lockstep.commands.diagnose import diagnose  # noqa: E402
from lockstep.streams.policy import Policy  # noqa: E402


@pytest.mark.parametrize("case", rf.CASES)
def test_a_real_fault_is_named_from_its_samples(case):
    path = REAL / f"{case}.parquet"
    if not path.exists():
        pytest.skip(f"no fixture {path}: write them with python tests/integration/real_faults.py {REAL}")
    findings = [msgspec.to_builtins(f) for f in diagnose(rf.load_fixture(path), Policy(), "real", now=0.0).findings]
    expect = rf.EXPECT[case]
    assert rf.named(findings, expect), rf.summary(findings)
    # nobody else is blamed with any confidence
    assert all(f["workers"] in ([], [expect.worker]) or f["confidence"] < 0.5 for f in findings), rf.summary(findings)
