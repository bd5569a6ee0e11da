"""deploy/: the Prometheus alert rules and the Grafana dashboard name only metrics the processes export, each
PromQL function is applied to the kind of metric it is for, promtool accepts the rules and the compose Prometheus's
configuration, docs/deployment.md's metrics table is the catalogue (lockstep/metrics.py), the Kubernetes manifests
render (kustomize) into objects valid against the Kubernetes schemas whose commands are real CLI commands, and the
Slurm example runs a real `lockstep agent run`."""

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
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


def test_the_deployment_doc_lists_the_catalogue():
    doc = (ROOT / "docs" / "deployment.md").read_text()
    table = doc[doc.index("| metric | process | what |") :]
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


# ------------------------------------------------------------------ PromQL functions against the metrics' kinds

#: functions for counters (they assume a value that only grows, resetting to 0) and for gauges
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
GAUGE_FUNCTIONS = {"delta", "idelta", "deriv", "predict_linear", "holt_winters", "double_exponential_smoothing"}


def kinds() -> dict[str, str]:
    """Each exported series name's kind: a histogram's _bucket, _sum and _count are counters."""
    out = {}
    for name, spec in CATALOGUE.items():
        for exported_name in exported_names(name):
            out[exported_name] = "counter" if spec.kind == "histogram" else spec.kind
    return out


def range_functions(expr: str) -> list[tuple[str, str]]:
    """(function, metric) of every range function applied to a metric selector in ``expr``."""
    fns = "|".join(sorted(COUNTER_FUNCTIONS | GAUGE_FUNCTIONS))
    return re.findall(rf"\b({fns})\s*\(\s*([a-zA-Z_:][\w:]*)", expr)


def test_range_functions_fit_the_kind_of_metric():
    """rate()/increase() on a gauge read a drop as a counter reset (the suppressed-triggers rule did); delta() on a
    counter reads a restart as a fall."""
    known = kinds()
    applied = [(fn, m) for e in alert_exprs() + dashboard_exprs() for fn, m in range_functions(e)]
    assert applied
    for fn, metric in applied:
        want = "counter" if fn in COUNTER_FUNCTIONS else "gauge"
        assert known[metric] == want, f"{fn}({metric}): {metric} is a {known[metric]}, {fn} wants a {want}"
    assert range_functions('increase(lockstep_triggers_suppressed{code="x"}[5m])') == [
        ("increase", "lockstep_triggers_suppressed")
    ]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_rules_and_the_compose_prometheus_config():
    for args in (["check", "rules"], ["check", "config"]):
        target = "lockstep-alerts.yml" if args[1] == "rules" else "prometheus.yml"
        done = subprocess.run(
            [PROMTOOL, *args, str(ROOT / "deploy/prometheus" / target)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_compose_prometheus_scrapes_both_processes_with_the_rules():
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert cfg["rule_files"] == ["lockstep-alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"lockstep-processor", "lockstep-sink"}  # the job names the rules' `up` alert names
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ports = {name: _flag(compose[name]["command"], "--http-port") for name in ("processor", "sink")}
    (sd,) = jobs["lockstep-processor"]["dns_sd_configs"]  # every replica of a scaled service
    assert sd["names"] == ["processor"] and str(sd["port"]) == ports["processor"]
    assert jobs["lockstep-sink"]["static_configs"][0]["targets"] == [f"sink:{ports['sink']}"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in compose["prometheus"]["volumes"]
    mounts = compose["grafana"]["volumes"]
    assert "./deploy/grafana/lockstep-dashboard.json:/var/lib/grafana/dashboards/lockstep-dashboard.json:ro" in mounts
    dash = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/lockstep.yaml").read_text())
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and source["datasources"][0]["isDefault"]
    # Kafka keeps its log on a volume, where its log directory is
    kafka = compose["kafka"]
    (volume,) = kafka["volumes"]
    assert volume.split(":")[1] == kafka["environment"]["KAFKA_LOG_DIRS"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------ Kubernetes

K8S = ROOT / "deploy/kubernetes"
#: the Kubernetes release whose schemas the manifests are checked against (kubernetes-validate carries them)
K8S_VERSION = "1.31"


def kustomize(folder: Path) -> list[dict]:
    """The objects ``kubectl kustomize FOLDER`` renders, for the features these kustomizations use: resources
    (files and folders), namespace, configMapGenerator literals, images and labels."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "images"}, k
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        data = dict(item.split("=", 1) for item in gen["literals"])
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    docs = copy.deepcopy(docs)
    for d in docs:
        if "namespace" in k and d["kind"] != "Namespace":
            d["metadata"]["namespace"] = k["namespace"]
        for pair in k.get("labels", []):
            d["metadata"].setdefault("labels", {}).update(pair["pairs"])
        for c in containers(d):
            for img in k.get("images", []):
                if c["image"] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img.get('newTag', 'latest')}"
    return docs


def containers(d: dict) -> list[dict]:
    spec = d.get("spec", {})
    pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


@pytest.fixture(scope="module", params=["base", "with-kafka"])
def rendered(request) -> list[dict]:
    return kustomize(K8S / request.param)


def test_the_manifests_are_valid_kubernetes_objects(rendered):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra: pip install -e '.[test]')"
    )
    for d in rendered:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises, naming the field, when one is wrong
    names = [(d["kind"], d["metadata"]["name"]) for d in rendered]
    assert len(names) == len(set(names)), names


def test_the_manifests_run_real_cli_commands_with_valid_settings(rendered):
    from lockstep import config
    from lockstep.commands.cli import build_parser

    parser = build_parser()
    (settings,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lockstep-settings"]
    env = dict(settings["data"])
    loaded = config.load(None, env=env)  # every LOCKSTEP_* literal is a setting with a valid value
    assert loaded.retention == 30 * 86400.0 and loaded.bootstrap_servers == "kafka:9092"
    commands = {}
    for d in rendered:
        for c in containers(d):
            if not c["image"].startswith("lockstep"):
                continue
            assert c["envFrom"] == [{"configMapRef": {"name": "lockstep-settings"}}], d["metadata"]["name"]
            args = parser.parse_args(c["args"])  # the image's entrypoint is `lockstep`
            assert callable(args.func)
            commands[args.command] = (d, c)
    assert set(commands) == {"topics", "processor", "sink"}
    # the processors: a scalable Deployment without a volume of its own, scraped on its --http-port
    proc, c = commands["processor"]
    assert proc["kind"] == "Deployment" and proc["spec"]["replicas"] > 1
    assert all("persistentVolumeClaim" not in v for v in proc["spec"]["template"]["spec"].get("volumes", []))
    # the sink: a StatefulSet of ONE replica (DuckDB has one writer) whose file is on its claimed volume
    sink, s = commands["sink"]
    assert sink["kind"] == "StatefulSet" and sink["spec"]["replicas"] == 1
    (claim,) = sink["spec"]["volumeClaimTemplates"]
    (data,) = [m for m in s["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert _flag(s["args"], "--db").startswith(data["mountPath"] + "/")
    for d, c in (commands["processor"], commands["sink"]):
        notes = d["spec"]["template"]["metadata"]["annotations"]
        port = _flag(c["args"], "--http-port")
        assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": port, "prometheus.io/path": "/metrics"}
        assert _flag(c["args"], "--http-host") == "0.0.0.0" and c["ports"][0]["containerPort"] == int(port)
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/healthz"


def test_with_kafka_brings_the_service_the_settings_name():
    docs = kustomize(K8S / "with-kafka")
    host, port = kustomize(K8S / "base")[-1]["data"]["LOCKSTEP_BOOTSTRAP_SERVERS"].split(":")
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
    assert svc["spec"]["ports"][0]["port"] == int(port)
    (kafka,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kafka"]
    assert kafka["spec"]["volumeClaimTemplates"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", ["base", "with-kafka"])
def test_kubectl_kustomize_renders_the_same_objects(folder):
    done = subprocess.run(
        ["kubectl", "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
    for d in theirs:  # the generator's content hash
        if d["kind"] == "ConfigMap":
            d["metadata"]["name"] = re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    ours = sorted(kustomize(K8S / folder), key=key)
    theirs.sort(key=key)
    assert [key(d) for d in theirs] == [key(d) for d in ours]
    for a, b in zip(theirs, ours):
        assert a.get("metadata", {}).get("namespace") == b.get("metadata", {}).get("namespace"), key(a)
        assert [c["image"] for c in containers(a)] == [c["image"] for c in containers(b)], key(a)
        assert [c.get("args") for c in containers(a)] == [c.get("args") for c in containers(b)], key(a)


# ------------------------------------------------------------------ Slurm


def test_the_slurm_example_runs_a_real_agent_command():
    from lockstep.commands.cli import build_parser

    script = ROOT / "deploy/slurm/train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    assert re.search(r"^#SBATCH --nodes=\d+$", text, re.M)
    srun = re.search(r"^srun .*?(?<!\\)\n(?!\s)", text, re.M | re.S)
    assert srun, "the script runs one srun"
    argv = shlex.split(srun.group(0).replace("\\\n", " "))
    cmd = argv[argv.index("lockstep") + 1 :]
    args = build_parser().parse_args(cmd)
    assert args.command == "agent" and args.agent_command == "run" and args.agentcfg_job
    assert args.cmd[:2] == ["--", "torchrun"]
