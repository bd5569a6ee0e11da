"""The Prometheus alert rules and the Grafana dashboard under deploy/ name only metrics the processes export,
and the README's metrics table is the catalogue (lockstep/metrics.py)."""

import json
import re
from pathlib import Path

import yaml

from lockstep.metrics import CATALOGUE, Metrics, exported_names, parse

ROOT = Path(__file__).resolve().parents[1]
#: Prometheus' own series the rules may use
PROMETHEUS = {"up"}
FUNCTIONS = {
    "sum",
    "max",
    "min",
    "avg",
    "rate",
    "increase",
    "delta",
    "histogram_quantile",
    "by",
    "without",
    "count",
    "on",
    "and",
    "or",
    "unless",
}


def exported() -> set[str]:
    return {n for name in CATALOGUE for n in exported_names(name)}


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (identifiers not followed by '(' and outside {...} matchers and strings)."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on)\s*\([^)]*\)", "", bare)
    return {
        m.group(1) for m in re.finditer(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()", bare) if not m.group(1).isdigit()
    } - FUNCTIONS


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/lockstep-alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((ROOT / "deploy/grafana/lockstep-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_metric_the_alerts_and_the_dashboard_name_exists():
    known = exported() | PROMETHEUS
    for where, exprs in (("alerts", alert_exprs()), ("dashboard", dashboard_exprs())):
        assert exprs, where
        for e in exprs:
            names = series_names(e)
            assert names and names <= known, (where, e, names - known)


def test_the_alerts_are_well_formed():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/lockstep-alerts.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert len(names) == len(set(names))
    for g in rules["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning", "info") and r["annotations"]["summary"], r[
                "alert"
            ]
            assert re.fullmatch(r"\d+[smh]", r.get("for", "0s")), r["alert"]


def test_the_dashboard_covers_every_metric():
    used = {n for e in dashboard_exprs() for n in series_names(e)}
    missing = [name for name in CATALOGUE if not exported_names(name) & used]
    assert not missing, missing


def test_the_readme_lists_the_catalogue():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| metric | process | what |") :]
    table = table[: table.index("\n\n")]
    listed = {}
    for row in table.splitlines()[2:]:
        for name, labels in re.findall(r"`(\w+)(?:\{([\w,]+)\})?`", row.split("|")[1]):
            listed[name] = tuple(sorted(labels.split(","))) if labels else ()
    assert set(listed) == set(CATALOGUE), (set(CATALOGUE) - set(listed), set(listed) - set(CATALOGUE))
    for name, labels in listed.items():
        assert labels == tuple(sorted(CATALOGUE[name].labels)), name


def test_a_process_exports_its_catalogue_from_the_start():
    for process in ("processor", "sink"):
        text = Metrics(process).render()
        families = {n for n, _ in parse(text)} | set(re.findall(r"^# TYPE (\w+)", text, re.M))
        mine = [n for n, s in CATALOGUE.items() if s.process in (process, "both")]
        for name in mine:
            assert f"lockstep_{name}" in families or f"lockstep_{name}".removesuffix("_total") in families, (
                process,
                name,
            )
