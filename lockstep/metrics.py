"""Process metrics, exposed through the official Prometheus client (``prometheus_client``).

Every metric either process exports is declared once in :data:`CATALOGUE` (name without the
``lockstep_`` prefix, kind, labels, help, which process exports it): docs/deployment.md's table, the
Prometheus alert rules and the Grafana dashboard under ``deploy/`` are checked against it.  The
names are a contract: add, never rename.

Each long-running process keeps one :class:`Metrics` (its own registry) and serves
:meth:`Metrics.render` at ``/metrics`` beside ``/healthz``.  Call sites name a metric and its
labels (``metrics.inc("records_in_total", topic=t)``); the help is the catalogue's only, and a name
missing from it is an error (:class:`UnknownMetric`).  :func:`parse` reads the text format back with the client's
own parser (tests, the load run).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .schemas.errors import LockstepError

prometheus_client.disable_created_metrics()  # no *_created series: counters are what docs/deployment.md lists

PREFIX = "lockstep"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
#: seconds: from a few milliseconds (a hop through Kafka) to minutes (a window)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class Spec:
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    process: str  # processor | sink | both


_BOTH, _PROC, _SINK = "both", "processor", "sink"
CATALOGUE: dict[str, Spec] = {
    # records through Kafka
    "records_in_total": Spec("counter", ("topic",), "records consumed, by topic", _BOTH),
    "bytes_in_total": Spec("counter", ("topic",), "bytes consumed, by topic", _PROC),
    "records_out_total": Spec("counter", ("topic",), "records published, by topic", _BOTH),
    "bytes_out_total": Spec("counter", ("topic",), "bytes published, by topic", _PROC),
    "dead_letters_total": Spec(
        "counter", ("reason", "stage"), "records sent to the dead-letter topic, by reason", _BOTH
    ),
    "consumer_lag_seconds": Spec(
        "gauge", ("topic",), "age of the last record consumed, by topic (now - its Kafka timestamp)", _BOTH
    ),
    "consumer_lag_records": Spec(
        "gauge",
        ("topic", "partition"),
        "high watermark - next offset, by partition (a lower bound on brokers that under-report the watermark)",
        _BOTH,
    ),
    # the processor's stages
    "open_shards": Spec("gauge", (), "shards of windows waiting for workers' features", _PROC),
    "shards_closed_total": Spec(
        "counter", ("reason",), "shards of windows closed, by reason (complete, timeout, budget)", _PROC
    ),
    "heartbeats_total": Spec(
        "counter",
        (),
        "heartbeats aggregated by the heartbeat stage (rows of HeartbeatBatch and StepHeartbeat records)",
        _PROC,
    ),
    "open_heartbeat_steps": Spec("gauge", (), "shards' steps waiting for their workers' heartbeats", _PROC),
    "step_partials_total": Spec(
        "counter", ("closed",), "step partials sent to the detector, by why (complete, later, timeout, news)", _PROC
    ),
    "open_steps": Spec("gauge", (), "steps waiting for feature batches", _PROC),
    "open_windows": Spec("gauge", (), "windows waiting for step reports", _PROC),
    "steps_closed_total": Spec("counter", ("reason",), "steps closed, by reason (complete, timeout, budget)", _PROC),
    "windows_closed_total": Spec(
        "counter", ("reason",), "windows closed, by terminal state (complete, timeout, failed)", _PROC
    ),
    "step_analysis_seconds": Spec("gauge", (), "time of the last step analysis", _PROC),
    "step_close_latency_seconds": Spec("histogram", (), "first feature batch of a step to its step report", _PROC),
    "window_close_latency_seconds": Spec(
        "histogram", (), "first step report of a window to its findings published", _PROC
    ),
    "findings_total": Spec("counter", ("cause",), "findings published, by cause", _PROC),
    "hang_reports_total": Spec("counter", (), "agents' answers to hang triggers (HangReport) read", _PROC),
    "late_records_total": Spec("counter", ("stage",), "records for steps or windows already closed", _PROC),
    "kafka_batches_skipped_total": Spec(
        "counter",
        ("topic",),
        "compressed record batches skipped unread: they inflate beyond the largest batch a Lockstep client sends "
        "(MAX_BATCH_BYTES, 33 MiB), or cannot be inflated",
        _PROC,
    ),
    "budget_closes_total": Spec(
        "counter",
        ("stage",),
        "steps, shards, windows or heartbeat steps closed early because the stage's open units held more than its "
        "memory budget (stage_budget_mib)",
        _PROC,
    ),
    # the detector
    "triggers_total": Spec("counter", ("kind",), "profiling windows triggered, by what opened them", _PROC),
    "triggers_suppressed": Spec(
        "gauge", ("code",), "automatic windows not opened, by the policy check that stopped them", _PROC
    ),
    "trigger_refusals_total": Spec("counter", ("code",), "operators' trigger requests refused, by reason", _PROC),
    "windows_refused_total": Spec(
        "counter",
        ("retry",),
        "windows every expected worker's agent refused (closed at once); retry: asked again without the cool-down",
        _PROC,
    ),
    "policy_info": Spec("gauge", ("policy",), "1 for the policy in force (id@hash)", _PROC),
    "detector_jobs": Spec("gauge", (), "jobs the detector follows", _PROC),
    "detector_open_windows": Spec("gauge", (), "windows open or scheduled by this processor", _PROC),
    "step_series_points_total": Spec("counter", (), "points of the per-job step-time series published", _PROC),
    "job_changes_total": Spec(
        "counter", ("change",), "slowdowns profiled, recovered, and jobs ended, as the detector saw them", _PROC
    ),
    # the host agents' own counters, carried on their heartbeats
    "agent_dropped_records": Spec(
        "gauge",
        ("job",),
        "records the agents dropped because their queue or spool was full, summed over the job's workers",
        _PROC,
    ),
    "agent_spooled_records": Spec(
        "gauge", ("job",), "records waiting in the agents' spools for Kafka, summed over the job's workers", _PROC
    ),
    "agent_refused_triggers": Spec(
        "gauge",
        ("job",),
        "triggers the agents refused (start step past, or overlapping a window), summed over the job's workers",
        _PROC,
    ),
    "agent_failed_windows": Spec(
        "gauge",
        ("job",),
        "accepted windows the agents could not profile or summarise, summed over the job's workers",
        _PROC,
    ),
    # the sink
    "findings_written_total": Spec("counter", ("cause",), "finding rows upserted, by cause", _SINK),
    "windows_written_total": Spec("counter", (), "window rows upserted", _SINK),
    "triggers_written_total": Spec("counter", (), "profiling trigger rows upserted", _SINK),
    "step_series_written_total": Spec("counter", (), "step-time series points upserted", _SINK),
    "job_changes_written_total": Spec(
        "counter", ("change",), "the detector's JobChange records stored, by change", _SINK
    ),
    "write_seconds": Spec("histogram", (), "one DuckDB transaction (rows, incidents and offsets)", _SINK),
    "incident_events_total": Spec(
        "counter", ("action",), "incident changes, by action (trigger, update, resolve)", _SINK
    ),
    "webhook_deliveries_total": Spec(
        "counter", ("route", "receiver", "result"), "page attempts, by result (delivered, retry, failed)", _SINK
    ),
    # the HTTP endpoints
    "http_requests_total": Spec("counter", ("path", "code"), "HTTP requests answered, by path and status code", _BOTH),
    "http_refused_total": Spec(
        "counter",
        ("reason",),
        "HTTP connections or requests turned away (connections: over the bound; busy: too many queries at once)",
        _BOTH,
    ),
}


def exported_names(spec_name: str) -> set[str]:
    """The series names a metric puts on /metrics (histograms add _bucket, _sum and _count)."""
    full = f"{PREFIX}_{spec_name}"
    if CATALOGUE.get(spec_name, Spec("gauge", (), "", _BOTH)).kind == "histogram":
        return {full + s for s in ("_bucket", "_sum", "_count")}
    return {full}


class UnknownMetric(LockstepError, LookupError):
    """A call site named a metric that the catalogue does not declare."""


class Metrics:
    """One process's metrics.  ``process`` ("processor" or "sink") declares its catalogue entries up front,
    so that /metrics lists them (unlabelled ones at 0) before anything happened."""

    def __init__(self, process: str | None = None, prefix: str = PREFIX):
        self.prefix = prefix
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._metrics: dict[str, object] = {}
        self._children: dict[tuple, object] = {}
        if process is not None:
            for name, spec in CATALOGUE.items():
                if spec.process in (process, _BOTH):
                    self._metric(name)

    def _metric(self, name: str):
        m = self._metrics.get(name)
        if m is not None:
            return m
        with self._lock:
            if name in self._metrics:
                return self._metrics[name]
            spec = CATALOGUE.get(name)
            if spec is None:
                raise UnknownMetric(f"{name}: not in lockstep.metrics.CATALOGUE (declare it there, with its help)")
            full = f"{self.prefix}_{name}"
            if spec.kind == "counter":
                m = Counter(full, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "histogram":
                m = Histogram(full, spec.help, spec.labels, registry=self.registry, buckets=LATENCY_BUCKETS)
            else:
                m = Gauge(full, spec.help, spec.labels, registry=self.registry)
            self._metrics[name] = m
            return m

    def _child(self, name: str, labels: dict[str, str]):
        key = (name, *labels.items())  # the hot path (a few calls per record): one dict lookup when seen before
        child = self._children.get(key)
        if child is None:
            m = self._metric(name)
            child = self._children[key] = m.labels(**{k: str(v) for k, v in labels.items()}) if labels else m
        return child

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._child(name, labels).inc(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)

    def replace(self, name: str, series: dict[tuple[tuple[str, str], ...], float]) -> None:
        """Set a gauge's whole family at once: series absent from ``series`` disappear (jobs gone)."""
        m = self._metric(name)
        with self._lock:
            self._children = {k: c for k, c in self._children.items() if k[0] != name}  # cleared below
            m.clear()
            for key, value in series.items():
                m.labels(**dict(key)).set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Add one observation to a histogram (buckets: :data:`LATENCY_BUCKETS`)."""
        self._child(name, labels).observe(value)

    def get(self, name: str, **labels: str) -> float:
        """A counter's or gauge's value, or a histogram's count (0 when the series does not exist)."""
        spec = CATALOGUE.get(name)
        full = f"{self.prefix}_{name}" + ("_count" if spec and spec.kind == "histogram" else "")
        return self.registry.get_sample_value(full, {k: str(v) for k, v in labels.items()}) or 0.0

    def total(self, name: str) -> float:
        """A counter summed over its labels."""
        full = f"{self.prefix}_{name}"
        return sum(s.value for fam in self.registry.collect() for s in fam.samples if s.name == full)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(series name, sorted (label, value) pairs): value}, by the client's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET a /metrics endpoint and :func:`parse` it."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse(r.read().decode())


def value(samples: dict, name: str, **labels: str) -> float:
    """One series of :func:`parse`'s result (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
