"""Runtime wiring shared by the commands: child processes (the processor, the sink), their flags, readiness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..broker import parent_death_signal
from ..config import Settings
from ..schemas.errors import LockstepError


class RuntimeFailure(LockstepError, RuntimeError):
    """A child process died or did not become ready."""


def settings_flags(settings: Settings, command: str) -> list[str]:
    """Flags that hand these settings to a child ``lockstep <command>`` (``processor``, ``sink``, ...): the ones it
    reads, the only ones it accepts."""
    from ..config import flag_name, read_by

    flags: list[str] = []
    for name in read_by(command):
        value = getattr(settings, name)
        if isinstance(value, dict):
            for k, v in value.items():
                flags += [flag_name(name), f"{k}={v}"]
        elif value is not None:
            flags += [flag_name(name), str(value)]
    return flags


class Child:
    """A ``lockstep`` subcommand in its own process, with its log in a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path, health_url: str | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.health_url = health_url
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes into it until stop() closes it
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )  # a killed parent leaves no child behind

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        if not self.alive():
            raise RuntimeFailure(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{self.tail()}")
        if not self.health_url:
            return True
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as r:
                return r.status == 200 and json.loads(r.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return
            time.sleep(0.2)
        raise RuntimeFailure(f"{self.name} not ready after {timeout_s:.0f}s; see {self.log_path}:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class Pipeline:
    """The stream processor and the DuckDB sink as child processes, each with its own HTTP port.

    For the load run and the crash tests: either process can be killed and started again on the
    same port, settings, consumer group and DuckDB file.
    """

    def __init__(self, settings: Settings, log_dir: Path):
        from ..broker import free_port

        self.settings = settings
        self.log_dir = log_dir
        self._free_port = free_port
        self.ports: dict[str, int] = {}
        self.children: dict[str, Child] = {}

    def start(self, name: str, timeout_s: float = 60.0, command: str | None = None) -> Child:
        """Start ``processor`` or ``sink`` (``command``, default ``name``) and wait until its /healthz answers ok."""
        port = self.ports.setdefault(name, self._free_port())
        command = command or name
        child = Child(
            name,
            [command, *settings_flags(self.settings, command), "--http-port", str(port)],
            self.log_dir,
            f"http://127.0.0.1:{port}/healthz",
        )
        self.children[name] = child
        child.wait_healthy(timeout_s)
        return child

    def metrics(self, name: str) -> dict:
        from ..metrics import scrape

        return scrape(f"http://127.0.0.1:{self.ports[name]}/metrics")

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown code runs (no commit, no flush, no DuckDB checkpoint)."""
        self.children[name].kill()

    def stop(self) -> None:
        for child in self.children.values():
            child.stop()
