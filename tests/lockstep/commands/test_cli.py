"""The command line: one-line errors, never a traceback."""

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test runs `lockstep` in a subprocess


def lockstep(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["findings", "--db", "/nonexistent/x.duckdb"], "does not exist"),
        (["query", "DELETE FROM findings", "--db", "/nonexistent/x.duckdb"], "does not exist"),
        (["processor", "--partitions", "zero"], "partitions"),
        (["demo", "--fault", "meteor"], "--fault"),
        (["findings", "--since", "yesterday-ish", "--db", "{db}"], "--since"),
        (["report", "--db", "/nonexistent/x.duckdb"], "does not exist"),
        (["report", "--db", "{db}", "--out", "/nonexistent/dir/r.html"], "--out"),
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


def test_tenant_flag_limits_query_and_findings(tmp_path):
    import json

    from lockstep.schemas.records import Evidence, Finding, Impact
    from lockstep.sinks.store import Batch, FindingsStore

    def f(fid, tenant):
        return Finding(
            id=fid,
            job=f"job-{tenant}",
            window="w1",
            steps=[1, 2],
            scope="worker",
            workers=[1],
            hosts=["h"],
            devices=["h/gpu1"],
            function="fn",
            function_kind="compute",
            cause="gpu_slow",
            confidence=0.9,
            evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
            impact=Impact(step_time_share=0.1, gpu_hours_per_day=1.0),
            policy="p",
            created_at=1_800_000_000.0,
            tenant=tenant,
        )

    db = tmp_path / "f.duckdb"
    store = FindingsStore(db)
    store.write(Batch([f("a", "acme"), f("b", "globex")], [], {}))
    store.close()
    r = lockstep("query", "SELECT id FROM findings ORDER BY id", "--db", str(db), "--tenant", "acme", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"id": "a"}]
    r = lockstep("findings", "--db", str(db), "--tenant", "globex", "--open", "--json")
    assert r.returncode == 0, r.stderr
    assert [x["id"] for x in json.loads(r.stdout)] == ["b"]
    page = tmp_path / "acme.html"
    r = lockstep("report", "--db", str(db), "--tenant", "acme", "--out", str(page), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"out": str(page), "findings": 1, "windows": 0}
    assert "job-acme" in page.read_text() and "job-globex" not in page.read_text()
    r = lockstep("report", "--db", str(db), "--job", "job-globex", "--out", str(page), "--json")
    assert r.returncode == 0, r.stderr
    assert (
        json.loads(r.stdout)["findings"] == 1
        and "job-globex" in page.read_text()
        and "job-acme" not in page.read_text()
    )
    assert "1 of 1 incident open" in page.read_text()  # the cost by cause counts the selected job's incidents only


def test_a_bad_routes_file_stops_the_sink_with_one_line(tmp_path):
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes: [{name: pd, type: pagerduty, routing_key_env: LOCKSTEP_TEST_UNSET_KEY}]\n")
    for path, needle in (
        (routes, "environment variable LOCKSTEP_TEST_UNSET_KEY"),
        (tmp_path / "none.yaml", "does not exist"),
    ):
        r = lockstep(
            "sink", "--routes", str(path), "--db", str(tmp_path / "f.duckdb"), "--bootstrap-servers", "127.0.0.1:1"
        )
        assert r.returncode != 0 and "Traceback" not in r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], r.stderr


def test_every_agent_setting_the_docs_list_is_a_flag_of_agent_run(tmp_path):
    """docs/agent.md: "the same names are flags of `lockstep agent run`" - identity flags included."""
    import re

    from tests.paths import ROOT

    agent_doc = (ROOT / "docs" / "agent.md").read_text()
    table = agent_doc[agent_doc.index("| setting | default | meaning |", agent_doc.index("Agent settings")) :]
    table = table[: table.index("\n\n")]
    names = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert {"rank", "host", "device", "labels", "redact", "spool_dir"} <= names
    values = {
        "labels": "pp=1",
        "redact": "paths=strip",
        "spool_dir": str(tmp_path),
        "raw_dir": str(tmp_path),
        "host": "hx",
        "device": "hx/gpu3",
        "nic": "hx/bond0",
        "switch": "leaf1",
        "job": "j",
        "tenant": "acme",
        "min_share": "0.01",
        "relay": "off",
        "log_level": "WARNING",
        "relay_dir": str(tmp_path / "relay"),
    }
    flags = [x for n in sorted(names) for x in (f"--{n.replace('_', '-')}", values.get(n, "3"))]
    show = (
        "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('LOCKSTEP_AGENT_')}))"
    )
    r = lockstep("agent", "run", *flags, "--bootstrap-servers", "127.0.0.1:1", "--", sys.executable, "-c", show)
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert (
        env["LOCKSTEP_AGENT_RANK"] == "3"
        and env["LOCKSTEP_AGENT_HOST"] == "hx"
        and env["LOCKSTEP_AGENT_DEVICE"] == "hx/gpu3"
    )
    assert env["LOCKSTEP_AGENT_LABELS"] == "pp=1" and env["LOCKSTEP_AGENT_JOB"] == "j"
    assert env["LOCKSTEP_AGENT_RUN_ID"] == "3"  # given; without it, a fresh one for every process the command starts
    help_text = lockstep("agent", "run", "--help").stdout
    assert "AGENTCFG" not in help_text and "--rank RANK" in help_text


def test_each_commands_help_lists_the_settings_it_reads_only():
    def flags(*command):
        r = lockstep(*command, "--help")
        assert r.returncode == 0, r.stderr
        return set(re.findall(r"(--[a-z][a-z-]+)", r.stdout))

    processor, sink, demo, query = flags("processor"), flags("sink"), flags("demo"), flags("query")
    assert {"--policy", "--faust-config", "--processor-id", "--step-timeout-s", "--log-format"} <= processor
    assert not {"--db", "--routes", "--sink-group", "--series-keep-steps"} & processor
    assert {"--db", "--routes", "--sink-group", "--resolve-after-s", "--series-keep-steps"} <= sink
    assert not {"--policy", "--faust-config", "--processor-id", "--step-timeout-s"} & sink
    assert (
        "--config" not in demo and not {"--processor-id", "--sink-group", "--routes"} & demo
    )  # the demo's groups are its own
    assert query == {"--help", "--db", "--tenant", "--json"}
    # a setting the command does not read is not accepted (a file or the environment may still set it)
    r = lockstep("processor", "--db", "x.duckdb", "--partitions", "zero")
    assert r.returncode == 2 and "unrecognized arguments: --db x.duckdb" in r.stderr


def test_agent_env_gives_each_command_a_run_of_its_own_unless_the_launcher_names_one():
    """Every process one `lockstep agent run` starts shares its run id (their spools are that run's); the next
    command is another run (it never sends what this one left), unless the launcher names the run (a requeued Slurm
    job is the same run: it sends its own spool)."""

    def run_id(**env):
        base = {"PATH": "/usr/bin:/bin", "LOCKSTEP_BOOTSTRAP_SERVERS": "127.0.0.1:1", **env}
        r = subprocess.run(
            [sys.executable, "-m", "lockstep", "agent", "env", "--job", "j", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=base,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["LOCKSTEP_AGENT_RUN_ID"]

    assert run_id() != run_id()
    assert run_id(SLURM_JOB_ID="41", SLURM_STEP_ID="2") == "41.2"
    assert run_id(LOCKSTEP_AGENT_RUN_ID="again") == "again"
