"""`lockstep simulate`: a scenario's records and its ground truth, written to a folder."""

import json
import subprocess
import sys

import pytest

from lockstep.app.evaluate import STANDARD_SUITE

pytestmark = pytest.mark.slow  # `lockstep simulate` runs in subprocesses


def lockstep(*args):
    return subprocess.run([sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=120)


def test_simulate_writes_records_and_truth(tmp_path):
    r = lockstep("simulate", str(STANDARD_SUITE / "storage-00-32w.yaml"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    truth = json.loads((tmp_path / "out" / "truth.json").read_text())
    (fault,) = truth["faults"]
    assert fault["cause"] == "storage" and fault["workers"] == list(
        range(8 * fault_host(truth), 8 * fault_host(truth) + 8)
    )
    assert 0 < fault["impact"] < 1
    import duckdb

    con = duckdb.connect()
    n, workers, windows = con.execute(
        f"SELECT count(*), count(DISTINCT worker), count(DISTINCT window_id) FROM '{tmp_path}/out/features.parquet'"
    ).fetchone()
    assert (workers, windows) == (32, 2) and n > 32 * 16 * 10
    (pp,) = con.execute(f"SELECT DISTINCT labels['pp'] FROM '{tmp_path}/out/features.parquet'").fetchone()
    assert pp == "0"
    r = lockstep("simulate", str(STANDARD_SUITE / "storage-00-32w.yaml"))
    assert r.returncode == 2 and "--out DIR or --publish" in r.stderr


def fault_host(truth) -> int:
    return truth["scenario"]["faults"][0]["hosts"][0]
