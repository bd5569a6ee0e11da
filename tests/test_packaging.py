"""A non-editable install (what the Dockerfile does) carries every file the package reads."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.paths import INSTALLED

pytestmark = pytest.mark.slow  # builds and installs the wheel

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject's package-dir), as a path in the wheel
STAGES = {folder: package.replace(".", "/") for folder, package in INSTALLED.items()}


def installed_as(rel: str) -> str | None:
    """Where a tracked file lies in the wheel, or None when it is not installed."""
    for folder, package in STAGES.items():
        if rel.startswith(folder + "/"):
            return f"{package}/{rel.removeprefix(folder + '/')}"
    return None


def run(*cmd, cwd=None):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=240)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    return r


def test_the_wheel_holds_every_tracked_file_and_passes_the_schema_check(tmp_path):
    # build from the tracked files only (a clean clone), not from this checkout's leftovers
    src = tmp_path / "src"
    tracked = run("git", "ls-files", cwd=ROOT).stdout.split()
    for rel in tracked:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("lockstep-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {where for rel in tracked if (where := installed_as(rel))}
    assert not wanted - names, f"tracked files missing from the wheel: {sorted(wanted - names)}"

    # a fresh environment: the wheel installed for real, the dependencies borrowed from this one
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "deps.pth").write_text(
        "\n".join({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}) + "\n"
    )
    run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", wheel)
    where = run(py, "-c", "import lockstep.schemas, sys; print(lockstep.schemas.__file__)", cwd=tmp_path).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not this checkout
    r = run(venv / "bin" / "lockstep", "schemas", "--check", cwd=tmp_path)
    assert "up to date" in r.stdout

    # the evaluations read their data from the installed package, not from a checkout
    r = run(
        venv / "bin" / "lockstep", "evaluate", "--detector", "--series", "recorded-testjob", "--runs", "2", cwd=tmp_path
    )
    assert "recorded-testjob" in r.stdout and "unknown series" not in r.stdout + r.stderr, r.stdout
    r = run(venv / "bin" / "lockstep", "evaluate", "--real", "--json", cwd=tmp_path)
    assert '"cases"' in r.stdout or '"overall"' in r.stdout, r.stdout[:2000]
