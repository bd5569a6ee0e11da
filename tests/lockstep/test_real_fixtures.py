"""The diagnosis on what real faulty jobs produced (tests/data/real: function tables with their hardware fingerprint).

The fixtures are written by ``tests/integration/real_faults.py`` from real 4-rank PyTorch jobs (CPU, gloo) with
a fault on rank 2 (see there); this runs the diagnosis on them in a moment, without PyTorch, and checks the naming
the integration tests check.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from lockstep.commands.diagnose import diagnose
from lockstep.schemas.records import to_builtins
from lockstep.streams.policy import load_policy

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "integration"))
import real_faults as rf  # noqa: E402


@pytest.mark.parametrize("case", rf.CASES)
def test_a_real_fault_is_named_from_its_fixture(case):
    inputs = rf.load_fixture(TESTS / "data" / "real" / f"{case}.parquet")
    assert sorted(inputs.workers) == list(range(rf.WORLD)) and all(h == "host" for h in inputs.hardware.values())
    d = diagnose(inputs, load_policy(None), "fixture", now=time.time())
    rf.check_named(case, [to_builtins(f) for f in d.findings])
