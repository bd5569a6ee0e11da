"""The command line: one-line errors, never a traceback."""

import subprocess
import sys

import pytest


def lockstep(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["findings", "--db", "/nonexistent/x.duckdb"], "does not exist"),
        (["query", "DELETE FROM findings", "--db", "/nonexistent/x.duckdb"], "does not exist"),
        (["processor", "--partitions", "zero"], "partitions"),
        (["demo", "--fault", "meteor"], "--fault"),
        (["findings", "--since", "yesterday-ish", "--db", "{db}"], "--since"),
    ],
)
def test_errors_are_one_line(tmp_path, args, needle):
    from lockstep.sinks.store import FindingsStore

    db = tmp_path / "f.duckdb"
    FindingsStore(db).close()
    r = lockstep(*[a.replace("{db}", str(db)) for a in args])
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_bad_scenario_file_is_one_line(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("topology: {workers: 10, pp: 3}\n")
    r = lockstep("simulate", str(bad), "--publish", "--bootstrap-servers", "127.0.0.1:1")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "multiple of pp*tp" in r.stderr


def test_query_on_an_empty_store_prints_a_table(tmp_path):
    from lockstep.sinks.store import FindingsStore

    db = tmp_path / "f.duckdb"
    FindingsStore(db).close()
    r = lockstep("query", "SELECT count(*) AS n FROM findings", "--db", str(db))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["n", "-", "0"]
    r = lockstep("findings", "--db", str(db), "--json")
    assert r.returncode == 0 and r.stdout.strip() == "[]"
