"""Packaging, docker-compose and CI stay consistent with the code; the tests mirror its folders; a class name means one thing."""

import re
import tomllib
from pathlib import Path

from lockstep.commands.cli import build_parser
from tests.compose import container_argv, documented_commands, interpolate, load_compose
from tests.paths import CODE, DATA_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
#: the folders of code -> the packages they install as (pyproject.toml's package-dir, read by tests/paths.py)
STAGES = CODE


def test_every_package_folder_is_packaged():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in {**STAGES, **DATA_PACKAGES}.items():
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


def test_ci_runs_the_pinned_lint_and_type_checks_before_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".ci/lint" in ci and ci.index(".ci/lint") < ci.index("-m pytest")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert sorted(req.split("==")[0] for req in dev if "==" in req) == ["mypy", "ruff"]
    lint = (ROOT / ".ci" / "lint").read_text()
    assert all(check in lint for check in ("ruff check", "ruff format --check", ".ci/typecheck.py"))


# ------------------------------------------------------------------------------------------ tests mirror the code

# test files that test no single module: what they check instead
NOT_MIRRORED = {
    "tests/test_deploy.py": "deploy/ (alerts, dashboard) against the metrics catalogue and docs/deployment.md",
    "tests/test_layout.py": "packaging, docker-compose, CI, the layout of the tests and one name per class",
    "tests/test_packaging.py": "the wheel built from the repository",
    "tests/test_readme_examples.py": "the README's example outputs against what the commands print (scripts/readme_examples.py)",
    "tests/test_window_length.py": "scripts/window_length.py: longer recordings of the real corpus cut into windows and scored",
    "tests/test_layers.py": "the layers of the whole code and its import graph (ARCHITECTURE.md)",
    "tests/schemas/test_bad_input.py": "the bad-input contract (brief section 7) across records, function tables and the store that keeps them",
    "tests/streams/test_bad_input.py": "the bad-input contract (brief section 7) across the processor's stages: detector, step and window",
}
# folders whose tests cross the pipeline, and the tests' own data
CROSSING = {"integration", "adversarial", "data"}


def _names(test: Path) -> list[str]:
    """The module names a test file may mean, longest first: ``test_cli_errors.py``: ``cli_errors``, ``cli``."""
    words = test.stem.removeprefix("test_").split("_")
    return ["_".join(words[:n]) for n in range(len(words), 0, -1)]


def _module_named_by(test: Path) -> Path | None:
    """The module a test file names: ``tests/<folder>/test_<module>[_<aspect>].py`` tests ``<folder>/<module>.py``
    (or the package ``<folder>/<module>/``); the longest ``<module>`` that exists wins."""
    folder = ROOT.joinpath(*test.relative_to(ROOT / "tests").parts[:-1])
    for name in _names(test):
        for candidate in (folder / f"{name}.py", folder / name / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _where_it_went(test: Path) -> list[str]:
    """Where modules of the names the test may mean are now (the longest name found anywhere)."""
    for name in _names(test):
        found = sorted(str(p.relative_to(ROOT)) for top in STAGES for p in (ROOT / top).rglob(f"{name}.py"))
        if found:
            return found
    return []


def test_every_test_file_names_the_module_it_tests():
    """tests/ mirrors the code: ``tests/streams/diagnosis/test_window.py`` tests ``streams/diagnosis/window.py``.
    When a module moves, its tests move with it (``git mv``), so that they can be found where the code is."""
    wrong = []
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = test.relative_to(ROOT)
        if rel.parts[1] in CROSSING or str(rel) in NOT_MIRRORED:
            continue
        if len(rel.parts) == 2 or rel.parts[1] not in STAGES:
            wrong.append(
                f"{rel}: tests no folder of the code ({', '.join(STAGES)}); a check of the whole repository goes in NOT_MIRRORED"
            )
            continue
        if _module_named_by(test) is None:
            moved = _where_it_went(test)
            hint = (
                f"; modules of that name: {', '.join(moved)} (git mv the test to the mirrored folder)" if moved else ""
            )
            wrong.append(f"{rel}: names no module in {Path(*rel.parts[1:-1])}/{hint}")
    assert not wrong, "\n".join(wrong)


def test_the_files_that_are_not_mirrored_exist():
    assert [name for name in NOT_MIRRORED if not (ROOT / name).is_file()] == []


# ------------------------------------------------------------------------------------------ one name per idea


def test_no_two_public_classes_share_a_name():
    """A class name means one thing across the code (``Window`` was three different things): a reader, a grep and
    a traceback then point at one class."""
    import ast
    from collections import defaultdict

    where = defaultdict(list)
    for top in STAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where[node.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
