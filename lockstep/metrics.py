"""Process metrics in the Prometheus text format, without a client library.

Every long-running process (processor, sink) keeps one :class:`Metrics` and
serves ``render()`` at ``/metrics`` beside a ``/healthz`` endpoint.  Counters,
gauges and histograms (cumulative ``_bucket{le=...}``, ``_sum``, ``_count``);
:func:`parse` reads the text back (tests, the load run).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections import defaultdict

#: seconds: from a few milliseconds (a hop through Kafka) to minutes (a window)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _label_value(v: object) -> str:
    """Prometheus text format: backslash, double quote and line feed escaped (a job name comes from a record)."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items())) + "}"


class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0


class Metrics:
    def __init__(self, prefix: str = "lockstep"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._histograms: dict[str, dict[tuple, _Histogram]] = defaultdict(dict)
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

    def replace(self, name: str, series: dict[tuple[tuple[str, str], ...], float], help: str = "") -> None:
        """Set a gauge's whole family at once: series absent from ``series`` disappear (jobs gone)."""
        with self._lock:
            self._gauges[name] = {tuple(sorted(k)): v for k, v in series.items()}
            if help:
                self._help.setdefault(name, help)

    def observe(self, name: str, value: float, help: str = "", buckets: tuple[float, ...] = LATENCY_BUCKETS, **labels: str) -> None:
        """Add one observation to a histogram (buckets are fixed by the first observation)."""
        with self._lock:
            series = self._histograms[name]
            key = tuple(sorted(labels.items()))
            h = series.get(key)
            if h is None:
                h = series[key] = _Histogram(buckets)
            h.counts[bisect.bisect_left(h.bounds, value)] += 1
            h.sum += value
            if help:
                self._help.setdefault(name, help)

    def get(self, name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            if name in self._counters:
                return self._counters[name].get(key, 0.0)
            if name in self._histograms:
                h = self._histograms[name].get(key)
                return float(sum(h.counts)) if h else 0.0
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
            for name in sorted(self._histograms):
                full = f"{self.prefix}_{name}"
                if name in self._help:
                    lines.append(f"# HELP {full} {self._help[name]}")
                lines.append(f"# TYPE {full} histogram")
                for key, h in sorted(self._histograms[name].items()):
                    labels = dict(key)
                    running = 0
                    for bound, n in zip((*h.bounds, math.inf), h.counts):
                        running += n
                        le = "+Inf" if bound == math.inf else f"{bound:g}"
                        lines.append(f"{full}_bucket{_labels({**labels, 'le': le})} {running}")
                    lines.append(f"{full}_sum{_labels(labels)} {h.sum:g}")
                    lines.append(f"{full}_count{_labels(labels)} {running}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(full name, sorted (label, value) pairs): value}; comments skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, rest = series.partition("{")
        labels = tuple(sorted((k, re.sub(r"\\(.)", r"\1", v)) for k, v in _LABEL.findall(rest)))
        out[(name, labels)] = float(value)
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET a /metrics endpoint and :func:`parse` it."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse(r.read().decode())


def value(samples: dict, name: str, **labels: str) -> float:
    """One series of :func:`parse`'s result (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
