"""The load run: a large simulated job through the whole pipeline for minutes, with lag and latency measured.

The processor and the sink run as child processes (as in production); the simulated fleet runs here and
behaves like the agents (heartbeats every step, feature batches during windows, triggers followed from
the control topic).  An operator asks for a new window as soon as the last one ended (``lockstep trigger``'s
record, through the detector), so the job is profiled nearly all the time: the worst case, where the
policy's cool-down would otherwise allow one window per ``cooldown_steps``.

What is measured, and how (Tansu under-reports high watermarks, so no figure here comes from them):

* **lag, records**: records the fleet has handed to Kafka (its producer's delivery reports) minus the
  records the processor has consumed (its ``/metrics``), per input topic, sampled every second;
* **lag, seconds**: the processor's ``lockstep_consumer_lag_seconds`` (now minus the Kafka timestamp of
  the record it consumed last), sampled every second;
* **step latency**: the last feature record of a step handed to the producer (agents send a window's
  records when it ends: the window's last step), to its step report's Kafka timestamp;
* **end-to-end latency**: the last feature batch of a window's last step handed to the producer, to its
  findings' ``first_seen`` in DuckDB (the sink's transaction).

Every clock involved is this host's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import psutil

from ..broker import kafka_or_embedded
from ..config import Settings
from ..kafka import Publisher, Tail, Topics, consumer_config, ensure_topics, producer_config
from ..metrics import value
from ..producers.simulator.faults import Fault
from ..producers.simulator.fleet import FleetSimulator, Scenario
from ..producers.simulator.live import run_live
from ..producers.simulator.topology import Topology
from ..schemas.records import ProfileTrigger, StepReport, TriggerRequest, decode
from ..sinks.http import query, wait_for
from ..streams.app import changelog_topics
from .runtime import Pipeline

log = logging.getLogger("lockstep.load")

POLICY = """\
id: load
detector: {cooldown_steps: 0, window_steps: 8, max_windows_per_job: 1, slowdown_threshold: 10.0, hang_min_s: 3600, baseline_every_steps: 0}
"""


@dataclass
class Sample:
    at: float  # seconds since the fleet started
    step: int
    lag_records: dict[str, float]  # topic -> records behind
    lag_seconds: dict[str, float]  # topic -> age of the last record consumed


@dataclass
class LoadResult:
    workers: int
    steps_per_s: float
    seconds: float  # the fleet's run
    steps: int
    windows: list[str]  # delivered by the fleet
    stored: list[str]  # windows with their findings in DuckDB
    culprits: dict[str, list[int]]  # window -> workers named by its findings
    published: dict[str, int]  # topic -> records delivered
    samples: list[Sample]
    step_latency_s: list[float]
    window_latency_s: list[float]
    drain_s: float  # from the fleet's last record to the last window in DuckDB and every heartbeat consumed
    unconsumed: dict[
        str, float
    ]  # topic -> records delivered that the processor had not consumed at the end (0: none lost)
    cpu_s: dict[str, float]  # process -> CPU seconds over the run
    dead_letters: float
    log_dir: Path = field(default=Path("."))
    processors: int = 1
    killed: dict[str, int] = field(default_factory=dict)  # processor SIGKILLed -> the fleet's step then
    findings: dict[str, list[str]] = field(default_factory=dict)  # window -> its finding ids in DuckDB (one row each)
    finding_rows: int = 0  # rows of the job's findings in DuckDB (== the ids' count: none stored twice)

    def quantiles(self, xs: list[float]) -> dict[str, float]:
        if not xs:
            return {"n": 0}
        a = np.asarray(xs)
        return {
            "n": len(xs),
            "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)),
            "max": float(a.max()),
        }

    def lag(self, topic: str, kind: str = "records") -> list[float]:
        return [getattr(s, f"lag_{kind}").get(topic, 0.0) for s in self.samples]

    def summary(self) -> dict:
        topics = sorted(self.published)
        return {
            "workers": self.workers,
            "steps_per_s": self.steps_per_s,
            "seconds": round(self.seconds, 1),
            "steps": self.steps,
            "windows": len(self.windows),
            "windows_stored": len(self.stored),
            "published": self.published,
            "lag_records": {t: self.quantiles(self.lag(t)) for t in topics},
            "lag_seconds": {t: self.quantiles(self.lag(t, "seconds")) for t in topics},
            "step_latency_s": self.quantiles(self.step_latency_s),
            "window_latency_s": self.quantiles(self.window_latency_s),
            "drain_s": round(self.drain_s, 2),
            "unconsumed": self.unconsumed,
            "cpu_s": {k: round(v, 1) for k, v in self.cpu_s.items()},
            "dead_letters": self.dead_letters,
            "processors": self.processors,
            "killed": self.killed,
        }


def scenario(workers: int) -> Scenario:
    """A job of ``workers`` workers with one thermally throttled GPU (worker 13) from the start."""
    return Scenario(
        job=f"load-{workers}w",
        topology=Topology(workers=workers, gpus_per_host=8),
        faults=(Fault(type="gpu_throttle_thermal", workers=(13,), severity=0.3),),
    )


def run_load(
    settings: Settings,
    *,
    workers: int = 1024,
    duration_s: float = 120.0,
    steps_per_s: float = 1.0,
    log_dir: Path | None = None,
    drain_timeout_s: float = 120.0,
    windows: bool = True,
    features: Literal["window", "step"] = "window",
    processors: int = 1,
    kill: int | None = None,
    stop_after_windows: int = 0,
) -> LoadResult:
    """``windows=False``: heartbeats only (the always-on signal's cost).  ``features``: what the fleet sends, one
    ``WindowFeatures`` per worker and window (as agents do), or a ``FeatureBatch`` per worker and step (as older agents did).

    ``processors``: that many processors in one consumer group share the partitions (the job's heartbeat shards and
    feature shards spread over them).  ``kill``: the last processor is SIGKILLed halfway through window number
    ``kill`` (0: the first) and not restarted: the others take its partitions over after the group's session timeout
    and replay what it had not committed.  ``stop_after_windows``: the fleet stops a few steps after that many windows
    were delivered, or at ``duration_s``, whichever comes first (0: at ``duration_s``)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="lockstep-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    policy = log_dir / "load-policy.yaml"
    policy.write_text(POLICY)
    settings = dataclasses.replace(settings, policy=policy)
    sc = scenario(workers)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(kafka_or_embedded(settings))
        topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
        pipeline = Pipeline(s, log_dir)
        stack.callback(pipeline.stop)
        names = _start(pipeline, processors)
        cpu = _CpuTime(pipeline)
        scraped = _Scraped(pipeline, names)

        fleet = FleetSimulator(sc)
        publisher = Publisher(producer_config(s))
        control = stack.enter_context(Tail(consumer_config(s, None), topics.control).open())
        # what the fleet sends
        inputs = (topics.heartbeats, topics.windowfeatures if features == "window" else topics.features)
        samples: list[Sample] = []
        t0 = time.time()
        state = _RunState()
        operator = _Operator(sc.job, topics.heartbeats, publisher, pipeline, names, scraped, cpu, state, windows, kill)
        sampler = threading.Thread(
            target=_sample, args=(state, scraped, publisher, inputs, samples, t0), name="load-sampler", daemon=True
        )
        sampler.start()
        try:
            live = run_live(
                fleet,
                publisher,
                control,
                topics,
                steps_per_s=steps_per_s,
                max_steps=int(duration_s * steps_per_s),
                stop_after_windows=stop_after_windows,
                progress=operator.progress,
                features=features,
            )
            seconds = time.time() - t0
            t_end = time.time()
            done = list(live.windows_done)
            _drain(s.db, sc.job, done, scraped, publisher, topics.heartbeats, drain_timeout_s)
            drain_s = time.time() - t_end
            time.sleep(1.5)  # a last sample after the drain
        finally:
            state.done = True
            sampler.join(5)
        cpu_s = cpu.seconds()
        scraped.refresh()
        publisher.poll(0)
        unconsumed = {t: publisher.stats.records[t] - scraped.sum("lockstep_records_in_total", topic=t) for t in inputs}
        findings, finding_rows = _findings_by_window(s.db, sc.job)
        window_latency, culprits = _window_latency(s.db, sc.job, live.triggers, operator.sent_at)
        step_latency = _step_latency(s, topics, sc.job, features, operator.sent_at)
        return LoadResult(
            workers=workers,
            steps_per_s=steps_per_s,
            seconds=seconds,
            steps=live.steps,
            windows=done,
            stored=sorted(culprits),
            culprits=culprits,
            published=dict(publisher.stats.records),
            samples=samples,
            step_latency_s=step_latency,
            window_latency_s=window_latency,
            drain_s=drain_s,
            unconsumed=unconsumed,
            cpu_s=cpu_s,
            dead_letters=scraped.total("lockstep_dead_letters_total"),
            log_dir=log_dir,
            processors=processors,
            killed=operator.killed,
            findings=findings,
            finding_rows=finding_rows,
        )


def _start(pipeline: Pipeline, processors: int) -> list[str]:
    """The sink and ``processors`` processors (one consumer group) started; the processors' names."""
    pipeline.start("sink")
    names = ["processor", *(f"processor-{i}" for i in range(2, processors + 1))]
    for name in names:
        pipeline.start(name, command="processor")
    return names


@dataclass
class _RunState:
    """What the fleet's progress callback and the sampler thread share during a load run."""

    step: int = 0  # the fleet's last step
    asked_at: float = 0.0  # when the run last asked for a window (0: never)
    done: bool = False  # the run is over: the sampler stops


class _CpuTime:
    """The CPU seconds (user and system) each of the pipeline's processes has used since this was made."""

    def __init__(self, pipeline: Pipeline):
        self.procs = {name: psutil.Process(child.proc.pid) for name, child in pipeline.children.items()}
        self.start = {name: self._used(name) for name in self.procs}
        self.stopped: dict[str, float] = {}  # a killed process's CPU seconds, taken just before

    def _used(self, name: str) -> float:
        return sum(self.procs[name].cpu_times()[:2])

    def stop(self, name: str) -> None:
        """``name`` is about to be killed: its CPU seconds now are its last."""
        self.stopped[name] = self._used(name) - self.start[name]

    def seconds(self) -> dict[str, float]:
        return {name: self.stopped.get(name) or self._used(name) - self.start[name] for name in self.procs}


class _Operator:
    """The fleet's progress callback, as an operator would act during the run: it asks for a new window as soon as the
    last one ended (or 10 s after asking went unanswered), kills the last processor halfway through window ``kill``,
    and checks that the other processes are still alive.  ``sent_at``: when each step's last record went out."""

    def __init__(
        self,
        job: str,
        requests_topic: str,
        publisher: Publisher,
        pipeline: Pipeline,
        names: list[str],
        scraped: _Scraped,
        cpu: _CpuTime,
        state: _RunState,
        windows: bool,
        kill: int | None,
    ):
        self.job, self.requests_topic, self.publisher = job, requests_topic, publisher
        self.pipeline, self.names, self.scraped, self.cpu = pipeline, names, scraped, cpu
        self.state, self.windows, self.kill = state, windows, kill
        self.sent_at: dict[int, float] = {}  # step -> its last record handed to the producer
        self.killed: dict[str, int] = {}  # processor SIGKILLed -> the fleet's step then

    def progress(self, step, res) -> None:
        state = self.state
        now = time.time()
        self.sent_at[step] = now
        state.step = step
        last = res.triggers[-1] if res.triggers else None
        active = last is not None and step < last.start_step + last.steps
        asked = state.asked_at and (not last or last.created_at < state.asked_at)
        if (
            self.kill is not None
            and last is not None
            and len(res.triggers) == self.kill + 1
            and step >= last.start_step + last.steps // 2
            and not self.killed
        ):
            self._kill_last(step)
        if self.windows and not active and (not asked or now - state.asked_at > 10.0):
            self.publisher.send(
                self.requests_topic,
                self.job,
                TriggerRequest(job=self.job, request=uuid.uuid4().hex[:12], reason="load run", requested_at=now),
            )
            state.asked_at = now
        for name in self.names:
            if name not in self.scraped.dead:
                self.pipeline.children[name].healthy()

    def _kill_last(self, step: int) -> None:
        victim = self.names[-1]
        self.cpu.stop(victim)
        self.scraped.refresh()  # its counts so far stay in the sums
        self.pipeline.kill(victim)
        self.scraped.dead.add(victim)
        self.killed[victim] = step


def _drain(
    db: Path,
    job: str,
    done: list[str],
    scraped: _Scraped,
    publisher: Publisher,
    heartbeats: str,
    timeout_s: float,
) -> None:
    """Wait (up to ``timeout_s``) until every window the fleet finished has its findings stored and every heartbeat
    delivered has been consumed; a warning names the windows not stored when that does not come."""

    def stored() -> list[str]:
        return [r[0] for r in query(db, "SELECT DISTINCT window_id FROM findings WHERE job = ?", [job])[1]]

    def drained() -> bool:  # every window's findings stored, and every heartbeat consumed
        scraped.refresh()
        return (
            set(done) <= set(stored())
            and scraped.sum("lockstep_records_in_total", topic=heartbeats) >= publisher.stats.records[heartbeats]
        )

    if not wait_for(drained, timeout_s, interval_s=0.1):
        log.warning("not drained after %.0fs; windows not stored: %s", timeout_s, sorted(set(done) - set(stored())))


def _findings_by_window(db: Path, job: str) -> tuple[dict[str, list[str]], int]:
    """The job's finding ids in DuckDB per window, and the rows they are (one each unless one was stored twice)."""
    ids = query(db, "SELECT window_id, id FROM findings WHERE job = ? ORDER BY window_id, id", [job])[1]
    findings: dict[str, list[str]] = {}
    for window, fid in ids:
        findings.setdefault(window, []).append(fid)
    return findings, len(ids)


def _sample(
    state: _RunState, scraped: _Scraped, publisher: Publisher, inputs: tuple[str, ...], samples: list[Sample], t0: float
) -> None:
    """Every second until the run is over: the lag of what the fleet sent behind what the processors consumed."""
    while not state.done:
        scraped.refresh()
        publisher.poll(0)  # run the delivery reports now: the count is this instant's
        delivered = dict(publisher.stats.records)
        samples.append(
            Sample(
                at=time.time() - t0,
                step=state.step,
                lag_records={
                    t: delivered.get(t, 0) - scraped.sum("lockstep_records_in_total", topic=t) for t in inputs
                },
                lag_seconds={t: scraped.max("lockstep_consumer_lag_seconds", topic=t) for t in inputs},
            )
        )
        time.sleep(1.0)


def _window_latency(
    db: Path, job: str, triggers: list[ProfileTrigger], sent_at: dict[int, float]
) -> tuple[list[float], dict[str, list[int]]]:
    """Each stored window's latency (its first finding stored after its last step was sent) and the workers its
    findings name."""
    rows = query(
        db,
        "SELECT window_id, min(epoch(first_seen)), list_distinct(flatten(list(workers))) FROM findings WHERE job = ? GROUP BY window_id",
        [job],
    )[1]
    window_latency, culprits = [], {}
    by_name = {t.window: t for t in triggers}
    for window, first_seen, named in rows:
        t = by_name.get(window)
        last_step = t.start_step + t.steps - 1 if t else None
        if last_step in sent_at:
            window_latency.append(first_seen - sent_at[last_step])
        culprits[window] = sorted(named)
    return window_latency, culprits


def _step_latency(
    s: Settings, topics: Topics, job: str, features: Literal["window", "step"], sent_at: dict[int, float]
) -> list[float]:
    """Each step report's latency: published after the step's records went out."""
    step_latency = []
    with Tail(consumer_config(s, None), topics.stepreports, from_start=True).open() as reports:
        for msg in reports.read_to_end():
            rep = decode(msg.value)
            if not isinstance(rep, StepReport) or rep.job != job or msg.timestamp_s is None:
                continue
            sent = rep.step if features == "step" else rep.window_start + rep.window_steps - 1  # its records went out
            if sent in sent_at:
                step_latency.append(msg.timestamp_s - sent_at[sent])
    return step_latency


class _Scraped:
    """The processors' /metrics, last scraped: counters summed over them (a killed one's counts as it left them:
    what it consumed and did not commit is consumed again by the others, so sums can only overcount), gauges of
    the live ones."""

    def __init__(self, pipeline: Pipeline, names: list[str]):
        self.pipeline = pipeline
        self.names = names
        self.last: dict[str, dict] = {}
        self.dead: set[str] = set()

    def refresh(self) -> None:
        for name in self.names:
            if name not in self.dead:
                with contextlib.suppress(OSError):
                    self.last[name] = self.pipeline.metrics(name)

    def sum(self, metric: str, **labels: str) -> float:
        return sum(value(m, metric, **labels) for m in self.last.values())

    def max(self, metric: str, **labels: str) -> float:
        return max((value(m, metric, **labels) for name, m in self.last.items() if name not in self.dead), default=0.0)

    def total(self, metric: str) -> float:
        """A counter summed over the processors and over all its series, whatever their labels."""
        return sum(v for m in self.last.values() for (name, _), v in m.items() if name == metric)
