"""The layers of ARCHITECTURE.md ("Layers"), checked on the import graph (every import, those inside functions too).

    application      lockstep/app/, lockstep/commands/, python -m lockstep
    pipeline         producers/, streams/, sinks/: none imports another
    infrastructure   lockstep/kafka/, config, broker, logs, metrics, web, units
    schemas          schemas/: imports nothing of ours

A module imports its own layer or the layers below it, and no module imports itself through others (no cycles).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.paths import CODE

ROOT = Path(__file__).resolve().parents[1]
#: folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = CODE

#: lowest first; a module is in the layer of the longest prefix that names it (``lockstep`` alone: only the root package)
LAYERS: dict[str, tuple[str, ...]] = {
    "schemas": ("lockstep.schemas",),
    "infrastructure": (
        "lockstep",
        "lockstep.kafka",
        "lockstep.config",
        "lockstep.broker",
        "lockstep.logs",
        "lockstep.metrics",
        "lockstep.web",
        "lockstep.units",
    ),
    "pipeline": ("lockstep.producers", "lockstep.streams", "lockstep.sinks"),
    "application": ("lockstep.app", "lockstep.commands", "lockstep.__main__"),
}
RANK = {layer: i for i, layer in enumerate(LAYERS)}
#: packages of one layer that must not import each other
APART = ("lockstep.producers", "lockstep.streams", "lockstep.sinks")


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    out.pop(
        "lockstep.producers.agent.boot.sitecustomize", None
    )  # copied onto PYTHONPATH by the launcher: imports nothing of ours
    return out


def extensions() -> set[str]:
    """Modules written in C (``producers/agent/_tracescan.c``): importable, and they import nothing of ours."""
    return {
        ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
        for folder, package in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.c")
    }


def imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(module of ours, line) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``import lockstep.kafka.tail`` names a module; anything else is not ours
                t = t.rpartition(".")[0] if t.startswith("lockstep.") else ""
            if t:
                yield t, node.lineno


def layer(name: str) -> str | None:
    best = None
    for lay, prefixes in LAYERS.items():
        for p in prefixes:
            matches = name == p or (p != "lockstep" and name.startswith(p + "."))
            if matches and (best is None or len(p) > len(best[1])):
                best = (lay, p)
    return best[0] if best else None


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    known = set(mods) | extensions()
    out = {name: {t: line for t, line in imports(name, path, known) if t != name} for name, path in mods.items()}
    return out | {name: {} for name in extensions()}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in graph() if layer(m) is None)
    assert not unplaced, (
        f"modules in no layer: {unplaced}; the application goes into lockstep/app/, shared infrastructure is listed in LAYERS"
    )


def test_modules_import_only_their_layer_and_the_ones_below():
    wrong = []
    for name, targets in graph().items():
        for t, line in targets.items():
            if RANK[layer(t)] > RANK[layer(name)]:
                wrong.append(f"{name}:{line} ({layer(name)}) imports {t} ({layer(t)})")
            apart = [p for p in APART if name.startswith(p + ".") or t.startswith(p + ".")]
            if len(apart) == 2 and apart[0] != apart[1]:
                wrong.append(
                    f"{name}:{line} imports {t}: producers, streams and sinks meet only through Kafka and the schemas"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_application_library_does_not_import_the_commands():
    """lockstep/commands/ (the command line and its commands) uses lockstep/app/; the arrow points one way."""
    g = graph()
    wrong = {m: sorted(t for t in g[m] if t.startswith("lockstep.commands")) for m in g if m.startswith("lockstep.app")}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_checks_see_what_they_check():
    """The graph resolves relative, absolute and submodule imports (else the rules above would pass on nothing)."""
    g = graph()
    assert "lockstep.kafka.publisher" in g["lockstep.kafka.tail"]  # from .publisher import Publisher
    assert "lockstep.schemas.records" in g["lockstep.kafka.publisher"]  # from ..schemas.records import encode
    assert "lockstep.config" in g["lockstep.commands.trigger"]  # from .. import config
    assert "lockstep.app.operator" in g["lockstep.commands.trigger"]  # inside run()
    assert "lockstep.commands.cli" in g["lockstep.__main__"]
    assert layer("lockstep") == "infrastructure" and layer("lockstep.kafka.tail") == "infrastructure"
    assert (
        layer("lockstep.app.demo") == "application"
        and layer("lockstep.streams.app") == "pipeline"
        and layer("lockstep.something_new") is None
    )
