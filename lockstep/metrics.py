"""Process metrics in the Prometheus text format, without a client library.

Every long-running process (processor, sink) keeps one :class:`Metrics` and
serves ``render()`` at ``/metrics`` beside a ``/healthz`` endpoint.
"""

from __future__ import annotations

import threading
from collections import defaultdict


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Metrics:
    def __init__(self, prefix: str = "lockstep"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, help: str = "", **labels: str) -> None:
        with self._lock:
            self._counters[name][tuple(sorted(labels.items()))] += value
            if help:
                self._help.setdefault(name, help)

    def set(self, name: str, value: float, help: str = "", **labels: str) -> None:
        with self._lock:
            self._gauges[name][tuple(sorted(labels.items()))] = value
            if help:
                self._help.setdefault(name, help)

    def get(self, name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            if name in self._counters:
                return self._counters[name].get(key, 0.0)
            return self._gauges.get(name, {}).get(key, 0.0)

    def total(self, name: str) -> float:
        with self._lock:
            return sum(self._counters.get(name, {}).values())

    def render(self) -> str:
        lines = []
        with self._lock:
            for kind, store in (("counter", self._counters), ("gauge", self._gauges)):
                for name in sorted(store):
                    full = f"{self.prefix}_{name}"
                    if name in self._help:
                        lines.append(f"# HELP {full} {self._help[name]}")
                    lines.append(f"# TYPE {full} {kind}")
                    for key, value in sorted(store[name].items()):
                        lines.append(f"{full}{_labels(dict(key))} {value:g}")
        return "\n".join(lines) + "\n"
