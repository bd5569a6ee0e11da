"""The diagnosis on what real faulty jobs produced: the fixtures of tests/integration/real_faults.py.

Four gloo ranks on CPU, sampled by the agent's sampler, rank 2 carrying the fault (a veth limited by
``tc``, CPU contention from another process, a slow DataLoader, extra compute). The fixtures hold what
the diagnosis reads of each run (function tables with hardware mean, spread and peak); rerun the jobs
with ``python tests/integration/real_faults.py tests/data/real``.
"""

from __future__ import annotations

import sys

import msgspec
import pytest

from tests.paths import DATA, TESTS

REAL = DATA / "real"
sys.path.insert(0, str(TESTS / "integration"))
import real_faults as rf  # noqa: E402

from lockstep.app.offline import diagnose  # noqa: E402
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


def test_the_slow_links_mean_may_be_the_rings_highest(tmp_path):
    """On a loaded machine the culprit's mean rate was the ring's highest (23 against 15-19 MB/s): its link is busy
    all through its all-reduce, its ring-mates' spans include waiting for it.  It is still their ring-mate."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = REAL / "link.parquet"
    if not path.exists():
        pytest.skip(f"no fixture {path}: write them with python tests/integration/real_faults.py {REAL}")
    t = pq.read_table(path)
    scale = pc.if_else(
        pc.and_(pc.equal(t.column("worker"), rf.CULPRIT), pc.match_substring(t.column("function"), "all_reduce")),
        1.4,
        1.0,
    )
    for name in ("nic_gbps", "nic_gbps_sd", "nic_gbps_p95"):
        col = t.column(name)
        t = t.set_column(
            t.column_names.index(name), name, pc.cast(pc.multiply(pc.cast(col, pa.float64()), scale), col.type)
        )
    pq.write_table(t, tmp_path / "link.parquet")
    findings = [
        msgspec.to_builtins(f)
        for f in diagnose(rf.load_fixture(tmp_path / "link.parquet"), Policy(), "real", now=0.0).findings
    ]
    assert rf.named(findings, rf.EXPECT["link"]), rf.summary(findings)
