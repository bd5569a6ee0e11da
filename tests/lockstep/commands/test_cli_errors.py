"""Every subcommand, given bad arguments or bad files, answers with one line on stderr and a non-zero exit: no traceback."""

import subprocess
import sys

import pytest

from lockstep.commands.cli import build_parser
from tests.paths import ROOT

NOKAFKA = ["--bootstrap-servers", "127.0.0.1:1"]  # nothing listens there: the command must fail before it matters

#: (args, what the one line must say); {tmp}: a scratch folder, {text}: a file of plain text, {db}: an empty
#: findings store, {other}: a DuckDB file that is not a findings store, {yaml}: YAML that is a list
CASES = [
    (["demo", "--workers", "0"], "--workers"),
    (["demo", "--fault", "meteor"], "--fault"),
    (["demo", "--culprit", "64"], "--culprit"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["demo", "--scenario", "{text}"], "{text}"),
    (["demo", "--db", "{text}"], "was not written by `lockstep demo`"),
    (["demo", "--db", "{tmp}/no/such/folder/x.duckdb"], "does not exist"),
    (["processor", "--partitions", "zero"], "partitions"),
    (["processor", "--policy", "{tmp}/none.yaml"], "does not exist"),
    (["processor", "--policy", "{yaml}"], "mapping"),
    (["processor", "--roles", "detect,dance"], "--roles"),
    (["processor", "--log-format", "xml"], "log_format"),
    (["sink", "--db", "{text}", *NOKAFKA], "not a valid DuckDB"),
    (["sink", "--db", "{other}", *NOKAFKA], "not a findings store"),
    (["sink", "--routes", "{yaml}", "--db", "{tmp}/s.duckdb", *NOKAFKA], "{yaml}"),
    (["test-page", "--routes", "{tmp}/none.yaml"], "No such file"),
    (["test-page", "--routes", "{text}"], "{text}"),
    (["agent", "run", "--job", "j", *NOKAFKA], "give the command after --"),
    (["agent", "run", "--job", "j", *NOKAFKA, "--", "no-such-command-anywhere"], "not found"),
    (["agent", "env", "--job", "j", *NOKAFKA, "--min-share", "2"], "min_share"),
    (["agent", "env", "--job", "j", *NOKAFKA, "--rank", "-1"], "rank"),
    (["agent", "status", "--db", "{other}"], "not a Lockstep findings store"),
    (["broker", "--port", "seventy"], "--port"),
    (["topics"], "needs a running Kafka"),
    (["simulate", "{tmp}/none.yaml", "--out", "{tmp}/o"], "{tmp}/none.yaml"),
    (["simulate", "{text}", "--out", "{tmp}/o"], "{text}"),
    (["simulate", "{yaml}", "--publish"], "{yaml}"),
    (["trigger", "j"], "--bootstrap-servers"),
    (["trigger", "j", "--steps", "0", *NOKAFKA], "--steps"),
    (["raw", "j", "--workers", "a,b", *NOKAFKA], "comma-separated numbers"),
    (["raw", "j", "--workers", "1", "--max-bytes", "5", *NOKAFKA], "--max-bytes"),
    (["diagnose", "{tmp}/none.json"], "none.json"),
    (["diagnose", "{text}"], "{text}"),
    (["diagnose", "{csv}", "--peer-group", "nosuchcol"], "nosuchcol"),
    (
        ["diagnose", "{db}"],
        "{db} is a DuckDB file (a findings store?), not a trace or an op-event table: list its findings with `lockstep findings --db {db}`",
    ),
    (["evaluate", "{tmp}/none"], "no such file"),
    (["evaluate", "{text}"], "{text}"),
    (["findings", "--db", "{text}"], "not a valid DuckDB"),
    (["findings", "--db", "{db}", "--limit", "-1"], "--limit"),
    (["findings", "--db", "{db}", "--since", "yesterday-ish"], "--since"),
    (["findings", "--db", "{other}"], "{other} is a DuckDB file but not a Lockstep findings store"),
    (["findings", "--db", "{db}", "--cause", "nosuchcause"], "invalid choice: 'nosuchcause' (choose from 'gpu_"),
    (["query", "SELECT 1", "--db", "{text}"], "not a valid DuckDB"),
    (["query", "SELECT 1", "--db", "{other}"], "not a Lockstep findings store"),
    (["query", "DELETE FROM findings", "--db", "{db}"], "read-only"),
    (["query", "SELEC nonsense", "--db", "{db}"], "does not parse"),
    (["report", "--db", "{text}"], "not a valid DuckDB"),
    (["report", "--db", "{db}", "--out", "{tmp}/no/such/folder/r.html"], "--out"),
    (["report", "--db", "{db}", "--live-url"], "no sink is running"),
    (["report", "--db", "{db}", "--limit", "0"], "--limit"),
    (["schemas", "--write"], "unrecognized arguments"),
    (["jobs", "--db", "{text}"], "not a valid DuckDB"),
    (["jobs", "--db", "{db}", "--limit", "0"], "--limit"),
    (["prune", "--older-than", "soon", "--db", "{db}"], "--older-than"),
    (["prune", "--older-than", "30d", "--db", "{tmp}/none.duckdb"], "no such findings file"),
    (["incident", "ack", "nosuch-1", "--db", "{db}"], "no incident"),
    (["incident", "resolve", "x-1", "--db", "{other}"], "not a findings store"),
]


def subcommands() -> list[str]:
    """Every leaf command (``agent run`` and ``agent env`` included)."""
    import argparse

    out = []
    for name, p in next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices.items():
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        out += [f"{name} {s}" for s in subs[0].choices] if subs else [name]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import duckdb

    from lockstep.sinks.store import FindingsStore

    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "text.txt").write_text("not what you think\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "ops.csv").write_text(
        "worker,step,function,kind,start_us,duration_us\n0,1,f,compute,0,10\n1,1,f,compute,0,12\n"
    )
    FindingsStore(tmp / "f.duckdb").close()
    con = duckdb.connect(str(tmp / "other.duckdb"))
    con.execute("CREATE TABLE sales (x INTEGER)")
    con.close()
    return {
        "{tmp}": str(tmp),
        "{text}": str(tmp / "text.txt"),
        "{yaml}": str(tmp / "list.yaml"),
        "{csv}": str(tmp / "ops.csv"),
        "{db}": str(tmp / "f.duckdb"),
        "{other}": str(tmp / "other.duckdb"),
    }


def fill(s: str, files: dict) -> str:
    for k, v in files.items():
        s = s.replace(k, v)
    return s


def lockstep(*args, cwd=None):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LOCKSTEP_")}
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, cwd=cwd, timeout=60, env=env
    )


def one_line_error(r) -> str:
    assert r.returncode not in (0, 70), (r.returncode, r.stderr)  # 70: an internal error, i.e. a bug
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_every_subcommand_has_a_bad_input_case():
    covered = {" ".join(a[:2]) if a[0] in ("agent", "incident") else a[0] for a, _ in CASES}
    assert set(subcommands()) <= covered, set(subcommands()) - covered


@pytest.mark.slow  # a subprocess per case
@pytest.mark.parametrize("args,needle", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_bad_input_is_one_line(files, tmp_path, args, needle):
    line = one_line_error(lockstep(*[fill(a, files) for a in args], cwd=tmp_path))
    assert line.startswith("lockstep ") and fill(needle, files) in line, line


#: what a command needs before an unknown flag is the first thing wrong
REQUIRED = {
    "test-page": ["--routes", "r.yaml"],
    "simulate": ["s.yaml"],
    "trigger": ["j"],
    "raw": ["j", "--workers", "1"],
    "diagnose": ["t.json"],
    "query": ["SELECT 1"],
    "incident ack": ["x-1"],
    "incident resolve": ["x-1"],
    "prune": ["--older-than", "30d"],
}


@pytest.mark.slow  # a subprocess per case
@pytest.mark.parametrize("command", subcommands())
def test_an_unknown_flag_is_one_line_naming_the_help(command):
    line = one_line_error(lockstep(*command.split(), *REQUIRED.get(command, []), "--no-such-flag"))
    assert "unrecognized arguments: --no-such-flag" in line and f"lockstep {command} --help" in line


@pytest.mark.slow  # a subprocess per case
def test_a_closed_pipe_ends_the_command_quietly(files):
    # many rows, read by a reader that stops after the first line (`lockstep query ... | head -1`)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "query", "SELECT range AS n FROM range(50000)", "--db", files["{db}"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first.split() == [b"n"] and err == "" and proc.returncode == 141


def test_a_cause_outside_the_catalogue_is_a_usage_error(files):
    r = lockstep("findings", "--db", files["{db}"], "--cause", "nosuchcause")
    assert r.returncode == 2 and "rank_specific_code" in one_line_error(r)


#: the commands that talk to a given Kafka, with what they need besides it
KAFKA_COMMANDS = [
    ["trigger", "j"],
    ["raw", "j", "--workers", "1"],
    ["topics"],
    ["simulate", str(ROOT / "scenarios" / "demo.yaml"), "--publish"],
]


@pytest.mark.slow  # a subprocess per case
@pytest.mark.parametrize("args", KAFKA_COMMANDS, ids=lambda a: a[0])
def test_a_closed_kafka_port_is_one_line_naming_the_address_and_exit_69(args):
    r = lockstep(*args, "--bootstrap-servers", "127.0.0.1:1")
    line = one_line_error(r)  # librdkafka's FAIL lines are quiet
    assert r.returncode == 69 and "cannot reach Kafka at 127.0.0.1:1: connection refused" in line, line


@pytest.mark.slow  # a subprocess per case, and a listener that never answers for --connect-timeout-s
@pytest.mark.parametrize("args", KAFKA_COMMANDS[:3], ids=lambda a: a[0])
def test_a_port_that_takes_the_connection_but_speaks_no_kafka_is_one_line_after_the_bound(args):
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel's backlog; nothing ever answers them
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        r = lockstep(*args, "--bootstrap-servers", address, "--connect-timeout-s", "1")
    line = one_line_error(r)
    assert r.returncode == 69 and address in line and ("1 s" in line or "no answer" in line), line


@pytest.mark.slow  # a subprocess per case, and a listener that never answers for --connect-timeout-s
@pytest.mark.parametrize("service", ["processor", "sink"])
def test_the_services_stop_with_one_line_after_connect_timeout_s_when_kafka_is_not_there(service, tmp_path):
    """``processor`` and ``sink`` read ``--connect-timeout-s`` too: a closed port is one line at once, a port that
    never answers one line saying the bound it waited (before: topic creation's fixed 15 s, librdkafka's lines)."""
    import socket

    extra = ["--db", str(tmp_path / "f.duckdb")] if service == "sink" else []

    def error_line(r) -> str:  # a service logs what it did before (the sink: its store); then the one line
        assert "Traceback" not in r.stderr and "librdkafka" not in r.stderr and "FAIL" not in r.stderr, r.stderr
        return r.stderr.strip().splitlines()[-1]

    r = lockstep(service, *extra, "--bootstrap-servers", "127.0.0.1:1")
    line = error_line(r)
    assert r.returncode == 69 and "cannot reach Kafka at 127.0.0.1:1: connection refused" in line, line
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        r = lockstep(service, *extra, "--bootstrap-servers", address, "--connect-timeout-s", "1")
    line = error_line(r)
    assert r.returncode == 69 and address in line and "within 1 s" in line, line


def test_librdkafkas_lines_show_at_debug_only():
    import logging

    from lockstep.logs import setup_logging

    try:
        setup_logging("INFO", client_logs=False)
        assert not logging.getLogger("lockstep.librdkafka").isEnabledFor(logging.ERROR)
        setup_logging("DEBUG", client_logs=False)
        assert logging.getLogger("lockstep.librdkafka").isEnabledFor(logging.ERROR)
        setup_logging("INFO")  # the services keep them
        assert logging.getLogger("lockstep.librdkafka").isEnabledFor(logging.WARNING)
    finally:
        logging.getLogger("lockstep.librdkafka").setLevel(logging.NOTSET)
        logging.getLogger().handlers.clear()
