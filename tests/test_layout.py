"""Packaging, docker-compose and CI stay consistent with the code."""

import re
import tomllib
from pathlib import Path

from lockstep.app.cli import build_parser
from tests.compose import container_argv, documented_commands, interpolate, load_compose

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"lockstep": "lockstep", "schemas": "lockstep.schemas", "producers": "lockstep.producers", "streams": "lockstep.streams", "sinks": "lockstep.sinks"}


def test_every_package_folder_is_packaged():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in STAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_compose_services_run_real_cli_commands():
    """Every service's argv as Docker builds it (entrypoint + command) is a real CLI command; the integration
    test tests/integration/test_compose.py runs them."""
    compose = load_compose()
    parser = build_parser()
    commands = {}
    for name, svc in compose["services"].items():
        if not svc.get("command"):
            continue
        argv = container_argv(svc)
        assert argv[0] == "lockstep" and argv[1] != "lockstep", (name, argv)
        args = parser.parse_args(argv[1:])
        assert callable(args.func), name
        commands[name] = args.command
    # the processes the tests start are the ones compose starts
    assert {"processor", "sink"} <= set(commands.values())
    for svc in ("processor", "sink", "topics", "simulate"):
        assert compose["services"][svc]["build"] == "."
    scenario = compose["services"]["simulate"]["command"][1]
    assert (ROOT / scenario.replace("/app/", "")).is_file()
    for line in documented_commands():
        if line[0] == "exec":
            assert line[2] == "lockstep" and callable(parser.parse_args(line[3:]).func), line


def test_compose_publishes_the_sink_on_loopback_unless_opened():
    (published,) = load_compose()["services"]["sink"]["ports"]
    assert interpolate(published, {}).startswith("127.0.0.1:")
    assert interpolate(published, {"LOCKSTEP_SINK_ADDRESS": "0.0.0.0"}).startswith("0.0.0.0:")
    for name, svc in load_compose()["services"].items():
        for port in svc.get("ports", []):
            assert interpolate(port, {}).startswith("127.0.0.1:"), (name, port)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:sh|bash)?\n(.+?)\n```", readme, re.S)
    assert m, "README must mark its test command with <!-- test-command -->"
    command = m.group(1).strip().splitlines()[-1]
    assert command in ci
