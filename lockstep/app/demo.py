"""The demo: the whole pipeline on the embedded broker, one injected fault, findings in DuckDB.

Separate processes: the broker (Tansu), the stream processor (faust) and the
DuckDB sink.  The simulated fleet runs in this process and talks to them only
through Kafka, as real agents would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..broker import free_port, kafka_or_embedded
from ..config import ConfigError, Settings
from ..kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config, read_all
from ..producers.simulator.faults import Fault
from ..producers.simulator.fleet import FleetSimulator, Scenario
from ..producers.simulator.hang import SimulatedHang
from ..producers.simulator.live import run_live
from ..producers.simulator.topology import Topology
from ..schemas.records import ProfileTrigger
from ..sinks.http import query, wait_for
from ..streams.app import changelog_topics
from .runtime import Child, RuntimeFailure, settings_flags

log = logging.getLogger("lockstep.demo")


@dataclass
class TopicStat:
    topic: str
    records: int
    bytes: int


@dataclass
class DemoResult:
    scenario: Scenario
    findings: list[dict]
    windows: list[dict]
    topics: list[TopicStat]
    seconds: float
    db: Path
    log_dir: Path


#: the demo's severity of a fault, as it shows up in production (faults.py says what a severity does); 0.3 otherwise.
#: In the demo's data-parallel job NVLink carries only the intra-host part of the gradient all-reduce and the
#: host-to-device copy overlaps compute, so a link at 77% (0.3) costs 0.3-0.4% of the step: below the noise, and
#: not what pages anyone.  The failures seen in production cost more:
DEMO_SEVERITY = {
    "nvlink": 3.0,  # the GPU's NVLink at a quarter of its bandwidth (links down): +2.5% step time in this job
    "pcie": 0.7,  # PCIe at an eighth of its throughput (a Gen4 x16 link fallen back to Gen1): +4% step time
}


def default_scenario(
    workers: int = 64, fault: str = "gpu_throttle_thermal", culprit: int = 13, seed: int = 7
) -> Scenario:
    return Scenario(
        job="demo-job",
        seed=seed,
        topology=Topology(workers=workers, gpus_per_host=8),
        faults=(Fault(type=fault, workers=(culprit,), severity=DEMO_SEVERITY.get(fault, 0.3), start_step=40),),
    )


#: ``--fault hang``'s policy: a hang after 3 s without progress (the default's 30 s would make a slow demo)
HANG_POLICY = """id: demo-hang
detector:
  hang_factor: 10
  hang_min_s: 3
  baseline_every_steps: 0
"""


def hang_scenario(
    workers: int = 64, culprit: int = 13, at_step: int = 60, seed: int = 7
) -> tuple[Scenario, SimulatedHang]:
    """``--fault hang``: a healthy job until ``at_step``, where worker ``culprit`` stops in its data loading."""
    return (
        Scenario(job="demo-job", seed=seed, topology=Topology(workers=workers, gpus_per_host=8), faults=()),
        SimulatedHang(culprit, at_step),
    )


def detector_saw(settings: Settings, scenario: Scenario, steps: int) -> str:
    """What the detector saw of the demo's job (re-simulated: the same step times), for a demo that did not trigger."""
    from ..streams.policy import load_policy
    from .detector_eval import detector_view

    return detector_view(scenario, steps, load_policy(settings.policy))


def demo_settings(args) -> Settings:
    """The demo's settings from its flags alone: no ``LOCKSTEP_*`` variable, no settings file.

    Consumer groups are always the demo's own; on a Kafka given with ``--bootstrap-servers`` the topics
    are too (a fresh prefix unless ``--topic-prefix``); without ``--db`` the store is a new file in a
    new temporary folder, kept afterwards for ``lockstep query`` and the report."""
    s = config.load(args, env={})
    tag = uuid.uuid4().hex[:8]
    prefix = args.topic_prefix or (f"lockstep-demo-{tag}" if s.bootstrap_servers else s.topic_prefix)
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="lockstep-demo-")) / "lockstep.duckdb"
    return dataclasses.replace(
        s, topic_prefix=prefix, db=db, processor_id=f"lockstep-demo-{tag}", sink_group=f"lockstep-demo-{tag}-sink"
    )


def report_path(db: Path) -> Path:
    return Path(db).with_name(f"{Path(db).stem}-report.html")


def claim_store(db: Path, *, explicit: bool) -> Path:
    """Make ``db`` the demo's, never touching a file it did not create; return the report's path.

    A file there (the store, its WAL, the sink's address file, the report) is replaced only when the
    marker ``<db>.demo`` says a demo wrote it; otherwise the demo stops with one line.  The marker is
    written before anything else, so a failed demo leaves nothing another demo cannot clean up."""
    db = Path(db)
    page = report_path(db)
    files = [db, Path(f"{db}.wal"), Path(f"{db}.sink.json"), page]
    marker = Path(f"{db}.demo")
    present = [f for f in files if f.exists() or f.is_symlink()]
    if present and not marker.is_file():
        flag = "--db" if explicit else "the demo's store"
        raise ConfigError(
            f"{flag}: {present[0]} exists and was not written by `lockstep demo`; the demo writes only files it "
            "created: name a new file (or leave out --db for a temporary one)"
        )
    if not db.parent.is_dir():
        raise ConfigError(f"--db: folder {db.parent} does not exist")
    for f in present:
        log.info("removing the previous demo's %s", f)
        f.unlink()
    marker.write_text(
        json.dumps(
            {"written_by": "lockstep demo", "pid": os.getpid(), "at": time.time(), "files": [str(f) for f in files]}
        )
        + "\n"
    )
    return page


def topic_stats(settings: Settings, topics: list[str]) -> list[TopicStat]:
    """Count every record and byte in each topic by reading it end to end."""
    records = read_all(settings, topics)
    return [TopicStat(t, len(records[t]), sum(len(v or b"") for _, v in records[t])) for t in topics]


def _start_pipeline(s: Settings, log_dir: Path, stack: contextlib.ExitStack) -> tuple[Child, Child]:
    """The stream processor and the sink as child processes (stopped when ``stack`` closes), once both are healthy."""
    processor_port, sink_port = free_port(), free_port()
    processor = Child(
        "processor",
        ["processor", *settings_flags(s, "processor"), "--http-port", str(processor_port)],
        log_dir,
        f"http://127.0.0.1:{processor_port}/healthz",
    )
    stack.callback(processor.stop)
    sink = Child(
        "sink",
        ["sink", *settings_flags(s, "sink"), "--http-port", str(sink_port)],
        log_dir,
        f"http://127.0.0.1:{sink_port}/healthz",
    )
    stack.callback(sink.stop)
    log.info(
        "started the stream processor (pid %d) and the DuckDB sink (pid %d); logs in %s",
        processor.proc.pid,
        sink.proc.pid,
        log_dir,
    )
    sink.wait_healthy(30)
    processor.wait_healthy(45)
    return processor, sink


def _window_stored(db: Path, job: str, trig: ProfileTrigger, hang: SimulatedHang | None) -> bool:
    """The window's report is in the store; for a hang window, the findings of who holds the job (no steps are
    profiled)."""
    sql = "SELECT count(*) FROM windows WHERE job = ? AND window_id = ?"
    if hang is not None:
        sql = "SELECT count(*) FROM findings WHERE job = ? AND window_id = ? AND cause IN ('hang', 'worker_died')"
    _, rows = query(db, sql, [job, trig.window])
    return rows[0][0] > 0


def _series_stored(db: Path, job: str, trig: ProfileTrigger) -> bool:
    """The job's step times are stored up to the window's last step."""
    _, rows = query(db, "SELECT coalesce(max(step), -1) FROM step_series WHERE job = ?", [job])
    return rows[0][0] >= trig.start_step + trig.steps - 1


def run_demo(
    settings: Settings,
    scenario: Scenario,
    *,
    timeout_s: float = 90.0,
    steps_per_s: float = 10.0,
    keep_logs: Path | None = None,
    status=lambda text: None,
    hang: SimulatedHang | None = None,
) -> DemoResult:
    """Broker (unless ``settings`` names one), processor and sink, the simulated fleet, until the first window's
    findings are in ``settings.db``.  ``status(text)`` hears what it is doing (the progress line)."""
    t0 = time.monotonic()
    log_dir = keep_logs or Path(tempfile.mkdtemp(prefix="lockstep-demo-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    db = Path(settings.db)
    if hang is not None and settings.policy is None:
        policy = log_dir / "hang-policy.yaml"
        policy.write_text(HANG_POLICY)
        settings = dataclasses.replace(settings, policy=policy)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(kafka_or_embedded(settings))
        topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
        status("starting the stream processor and the sink")
        processor, sink = _start_pipeline(s, log_dir, stack)
        log.info("pipeline ready after %.1fs", time.monotonic() - t0)

        fleet = FleetSimulator(scenario)
        publisher = Publisher(producer_config(s))
        control = stack.enter_context(
            Tail(consumer_config(s, None), topics.control).open()
        )  # from its end, as an agent that just started
        f = scenario.faults[0] if scenario.faults else None
        log.info(
            "simulating %s: %d workers on %d hosts; %s",
            scenario.job,
            scenario.topology.workers,
            scenario.topology.hosts,
            f"fault {f.type} on worker(s) {list(f.workers)} from step {f.start_step}" if f else "no fault",
        )

        def progress(step, res):
            status(
                f"fleet at step {step}, {'window ' + res.triggers[0].window + ' profiling' if res.triggers else 'waiting for the detector'}"
            )
            if step % 25 == 0:
                log.info("fleet at step %d (%d trigger(s) received)", step, len(res.triggers))
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeFailure(
                    f"no profiling window within {timeout_s:.0f}s; the detector saw {detector_saw(s, scenario, step + 1)}; see {log_dir}"
                )
            processor.healthy()

        live = run_live(
            fleet,
            publisher,
            control,
            topics,
            steps_per_s=steps_per_s,
            max_steps=int(timeout_s * steps_per_s),
            progress=progress,
            end_job=False,  # the demo shows a job that still runs: its incident stays open for the reader's queries
            hang=hang,
        )
        if not live.windows_done:
            raise RuntimeFailure(
                f"the detector never triggered a profiling window; it saw {detector_saw(s, scenario, live.steps)}; see {processor.log_path}"
            )
        trig = live.triggers[0]
        log.info(
            "window %s delivered (steps %d..%d); waiting for the diagnosis",
            trig.window,
            trig.start_step,
            trig.start_step + trig.steps - 1,
        )
        status(f"window {trig.window} delivered; waiting for its findings")
        if not wait_for(
            lambda: _window_stored(db, scenario.job, trig, hang), max(5.0, timeout_s - (time.monotonic() - t0))
        ):
            raise RuntimeFailure(f"window {trig.window} did not reach {db} in time; see {log_dir}")
        status(f"window {trig.window} stored; waiting for its step times")
        if hang is None:  # the step times come every second or so: the picture should show the whole window
            wait_for(lambda: _series_stored(db, scenario.job, trig), 10.0)
        _, rows = query(db, "SELECT record FROM findings WHERE job = ? ORDER BY step_time_share DESC", [scenario.job])
        findings = [r[0] for r in rows]
        cols, wrows = query(db, "SELECT * FROM windows WHERE job = ?", [scenario.job])
        windows = [dict(zip(cols, r)) for r in wrows]
        t1 = time.monotonic()
        sink.stop()
        processor.stop()
        log.info("processes stopped in %.1fs", time.monotonic() - t1)
        t1 = time.monotonic()
        status("counting the records in Kafka")
        stats = topic_stats(s, topics.all())
        log.info("topics counted in %.1fs", time.monotonic() - t1)
    return DemoResult(scenario, findings, windows, stats, time.monotonic() - t0, db, log_dir)
