"""`lockstep evaluate`: the figures as JSON and per scenario, and bad suite files as one-line errors."""

import json
import shutil
import subprocess
import sys

import pytest

from lockstep.app.evaluate import STANDARD_SUITE

pytestmark = pytest.mark.slow  # every test runs `lockstep evaluate` in a subprocess


def lockstep(*args):
    return subprocess.run([sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=120)


def test_evaluate_prints_the_figures_as_json(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("gpu_throttle_thermal-00-16w", "pcie-01-16w", "healthy-00-16w", "clock_skew-00-16w", "nic-00-16w"):
        shutil.copy(STANDARD_SUITE / f"{name}.yaml", suite)
    r = lockstep("evaluate", str(suite), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"overall", "by_fault"} <= set(out)
    o = out["overall"]
    assert {"accuracy", "precision", "recall", "healthy_false_findings", "scenarios"} <= set(o)
    assert o["scenarios"] == 5 and o["faults"] == 3
    assert set(out["by_fault"]) == {"gpu_throttle_thermal", "pcie", "healthy", "clock_skew", "nic"}
    thermal = out["by_fault"]["gpu_throttle_thermal"]
    assert thermal["accuracy"] == 1.0 and thermal["impact_true"] > 0.05 and thermal["impact_abs_error"] < 0.05
    assert out["by_fault"]["healthy"]["findings"] == 0 and o["healthy_false_findings"] == 0
    assert all(0.0 <= o[k] <= 1.0 for k in ("accuracy", "precision", "recall"))
    r = lockstep("evaluate", str(suite / "pcie-01-16w.yaml"), "--scenarios")
    assert r.returncode == 0, r.stderr
    assert "pcie" in r.stdout and "accuracy" in r.stdout and "pcie-01-16w" in r.stdout


@pytest.mark.parametrize(
    "bad,needle", [("faults: [{type: meteor}]", "unknown fault type"), ("topology: {workers: 20}", "whole hosts")]
)
def test_bad_suite_files_are_one_line_errors(tmp_path, bad, needle):
    (tmp_path / "s.yaml").write_text(bad)
    r = lockstep("evaluate", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
