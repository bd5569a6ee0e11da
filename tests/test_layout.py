"""Packaging, docker-compose and CI stay consistent with the code."""

import re
import tomllib
from pathlib import Path

import yaml

from lockstep.cli import build_parser

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
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = build_parser()
    commands = {}
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if not cmd:
            continue
        assert cmd[0] == "lockstep", name
        args = parser.parse_args(cmd[1:])
        assert callable(args.func), name
        commands[name] = args.command
    # the processes the tests start are the ones compose starts
    assert {"processor", "sink"} <= set(commands.values())
    for svc in ("processor", "sink", "topics", "simulate"):
        assert compose["services"][svc]["build"] == "."
    scenario = compose["services"]["simulate"]["command"][2]
    assert (ROOT / scenario.replace("/app/", "")).is_file()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:sh|bash)?\n(.+?)\n```", readme, re.S)
    assert m, "README must mark its test command with <!-- test-command -->"
    command = m.group(1).strip().splitlines()[-1]
    assert command in ci
