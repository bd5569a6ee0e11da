"""docker-compose.yml, run as the containers run it, without a Docker engine.

Each service's argv is the image's ENTRYPOINT (Dockerfile) followed by its ``command``, exactly as
Docker builds it.  The test maps only what the container runtime provides: the host name ``kafka``
(the embedded broker here), the volumes (folders here), the container's ports (free ports here,
since this machine is shared) and the image's ``python``/``lockstep`` (this environment's).  Then it
runs the services in compose's order: topics to completion, processor and sink until their own
healthchecks pass, the simulate job to completion, and the `exec` command the compose file
documents, which must show the simulated fault's finding.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lockstep.broker import EmbeddedBroker, free_port
from tests.compose import ROOT, container_argv, documented_commands, load_compose

pytestmark = pytest.mark.integration


class Runtime:
    """What Docker provides a container, mapped onto this machine."""

    def __init__(self, broker: EmbeddedBroker, tmp: Path):
        self.broker = broker
        self.volumes = {"lockstep-data": tmp / "lockstep-data"}
        self.volumes["lockstep-data"].mkdir()
        self.ports: dict[str, str] = {}
        self.tmp = tmp

    def mounts(self, svc: dict) -> dict[str, Path]:
        out = {}
        for vol in svc.get("volumes", []):
            source, target = vol.split(":")[:2]
            out[target] = self.volumes[source] if source in self.volumes else (ROOT / source).resolve()
        return out

    def local(self, svc: dict, argv: list[str]) -> list[str]:
        for i, a in enumerate(argv[:-1]):
            if a == "--http-port":
                self.ports.setdefault(argv[i + 1], str(free_port()))
        out = []
        for a in argv:
            a = a.replace("kafka:9092", self.broker.bootstrap_servers)
            for target, source in sorted(self.mounts(svc).items(), key=lambda kv: -len(kv[0])):
                if a == target or a.startswith(target + "/"):
                    a = str(source) + a[len(target) :]
            for port, mapped in self.ports.items():
                a = a if a != port else mapped
                a = a.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{mapped}/")
            out.append(a)
        head = {"lockstep": [sys.executable, "-m", "lockstep"], "python": [sys.executable]}.get(out[0], out[:1])
        return head + out[1:]

    def env(self, svc: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
        env.update({str(k): str(v) for k, v in (svc.get("environment") or {}).items()})
        return env


def test_every_compose_service_runs_as_its_container_would(tmp_path):
    compose = load_compose()
    services = compose["services"]
    with EmbeddedBroker() as broker:
        rt = Runtime(broker, tmp_path)

        def run(name: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
            svc = services[name]
            return subprocess.run(
                rt.local(svc, argv), env=rt.env(svc), capture_output=True, text=True, timeout=timeout, cwd=tmp_path
            )

        r = run("topics", container_argv(services["topics"]), 60)
        assert r.returncode == 0, r.stderr
        assert "lockstep.features" in r.stdout

        procs = {}
        try:
            for name in ("processor", "sink"):
                svc = services[name]
                log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - the service writes into it until the end
                procs[name] = subprocess.Popen(
                    rt.local(svc, container_argv(svc)),
                    env=rt.env(svc),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                )
            for name, proc in procs.items():
                check = services[name]["healthcheck"]["test"]
                assert check[0] == "CMD"
                deadline = time.monotonic() + 120
                while True:
                    assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
                    if run(name, check[1:], 10).returncode == 0:
                        break
                    assert time.monotonic() < deadline, (
                        f"{name} never healthy: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
                    )
                    time.sleep(1)

            r = run("simulate", container_argv(services["simulate"]), 240)
            assert r.returncode == 0, r.stderr[-3000:]
            assert re.search(r"windows delivered: w\d+", r.stdout), r.stdout

            # the command the compose file documents for reading the findings, run in the sink's container
            (exec_cmd,) = [c for c in documented_commands() if c[:2] == ["exec", "sink"] and "findings" in c]
            deadline = time.monotonic() + 60
            while True:
                r = run("sink", exec_cmd[2:], 60)
                assert r.returncode == 0, r.stderr
                if "gpu_throttle_thermal" in r.stdout:
                    break
                assert time.monotonic() < deadline, r.stdout
                time.sleep(1)
            row = next(line for line in r.stdout.splitlines() if "gpu_throttle_thermal" in line)
            assert "node0001/gpu5" in row  # worker 13 of scenarios/demo.yaml

            # the simulated job ended like a job (every worker's final heartbeat): its incident resolves as job_ended,
            # read with the documented query command in the sink's container
            sql = "SELECT cause, resolved_reason FROM incidents"
            deadline = time.monotonic() + 60
            while True:
                r = run("sink", ["lockstep", "query", "--db", "/data/lockstep.duckdb", sql], 60)
                assert r.returncode == 0, r.stderr
                if "job_ended" in r.stdout:
                    break
                assert time.monotonic() < deadline, r.stdout
                time.sleep(1)
            assert "gpu_throttle_thermal" in r.stdout

            # the documented way to the live page: its address, with the token, from inside the sink's container
            (url_cmd,) = [c for c in documented_commands() if c[:2] == ["exec", "sink"] and "--live-url" in c]
            r = run("sink", url_cmd[2:], 60)
            assert r.returncode == 0, r.stderr
            url = r.stdout.strip().replace(":8080/", f":{rt.ports['8080']}/")  # the port compose publishes
            browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
            with browser.open(url, timeout=30) as page:
                body = page.read().decode()
            assert page.status == 200 and "demo-job" in body and 'class="heatmap"' in body
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
