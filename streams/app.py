"""The stream processor: faust agents around the pure state machines and diagnosis.

Three agents, one faust app (one consumer group), at-least-once, concurrency 1:

- ``detect``   lockstep.heartbeats  -> SlowdownDetector      -> lockstep.control
  (heartbeats, plus the detector's own hang ticks and operators' trigger requests)
- ``steps``    lockstep.features    -> StepAssembler + analyze_step -> lockstep.stepreports
- ``windows``  lockstep.stepreports -> WindowAssembler + diagnose_window -> lockstep.findings, lockstep.windows

Recovery (see ARCHITECTURE.md): input records of open steps and windows are
not acknowledged until what they contributed to has been published, and acks
go out in offset order (InOrderAcks), so the committed offset never passes an
open step or window; after a crash the processor replays from it.  A faust
table (changelog-backed) remembers closed windows so that a replay that
contains only part of an already closed window is dropped instead of being
diagnosed again.  Finding ids are deterministic and the sink upserts, so a
replay of a whole window changes nothing.  A third table keeps each job's
baseline of healthy windows (``JobHistory``) for the job-wide regression check.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import logging
import time
from dataclasses import dataclass, field

import faust

from ..kafka import Topics, faust_broker_kwargs
from ..metrics import Metrics
from ..schemas import functions as ft
from ..schemas.records import (
    DetectorTick,
    FeatureBatch,
    ProfileTrigger,
    RecordError,
    StepHeartbeat,
    StepReport,
    TriggerRequest,
    WindowTimeout,
    dead_letter,
    decode,
    encode,
)
from .detector import SlowdownDetector
from .pictures import SeriesBuilder, deviation_map
from .diagnosis import HistoryError, JobHistory, StepFrame, WindowInfo, analyze_step, diagnose_window, step_report, step_result
from .policy import Policy, PolicyFile
from .windows import ClosedStep, ClosedWindow, InOrderAcks, StepAssembler, WindowAssembler

log = logging.getLogger("lockstep.processor")

TABLES = ("closed_windows", "detector", "job_history")
#: the host agents' counters (AgentCounters, carried by heartbeats) exported per job as lockstep_agent_<name>
AGENT_COUNTERS = {
    "dropped_records": "records the agents dropped because their queue or spool was full",
    "spooled_records": "records waiting in the agents' spools for Kafka",
    "refused_triggers": "triggers the agents refused (start step past, or overlapping a window)",
    "failed_windows": "accepted windows the agents could not profile or summarise",
}


def changelog_topics(app_id: str) -> list[str]:
    return [f"{app_id}-{t}-changelog" for t in TABLES]


@dataclass
class ProcessorState:
    policy: Policy
    step_timeout_s: float
    window_timeout_s: float
    metrics: Metrics = field(default_factory=Metrics)
    detector: SlowdownDetector = None  # type: ignore[assignment]
    steps: StepAssembler = None  # type: ignore[assignment]
    windows: WindowAssembler = None  # type: ignore[assignment]
    step_acks: InOrderAcks = field(default_factory=InOrderAcks)
    window_acks: InOrderAcks = field(default_factory=InOrderAcks)
    step_stream: object = None
    window_stream: object = None
    assigned: bool = False
    policies: dict[str, Policy] = field(default_factory=dict)  # every policy loaded, by ref
    job_partition: dict[str, object] = field(default_factory=dict)  # job -> heartbeats partition (TP) seen
    positions: dict[object, int] = field(default_factory=dict)  # TP -> next offset to consume (for the lag)
    crashed: dict[str, str] = field(default_factory=dict)  # agent -> why it died (fails /healthz)
    series: SeriesBuilder = field(default_factory=SeriesBuilder)  # per-job step times for the pictures

    def __post_init__(self) -> None:
        self.detector = SlowdownDetector(self.policy)
        self.steps = StepAssembler(self.step_timeout_s)
        self.windows = WindowAssembler(self.window_timeout_s)
        self.set_policy(self.policy)

    def set_policy(self, policy: Policy) -> None:
        """The policy in force for new windows: the detector's and the diagnosis'."""
        self.policy = policy
        self.policies[policy.ref] = policy
        self.detector.set_policy(policy)
        for ref in self.policies:
            self.metrics.set("policy_info", float(ref == policy.ref), help="1 for the policy in force (id@hash)", policy=ref)

    def policy_for(self, ref: str) -> Policy:
        """The policy a window was opened under (its trigger's ``id@hash``), else the one in force."""
        return self.policies.get(ref, self.policy)


def limit_fetch_wait(ms: int) -> None:
    """faust creates its aiokafka consumer with a fixed 1500 ms fetch wait; cap it.

    The embedded broker (Tansu) does not answer a waiting fetch when data
    arrives, so every hop through the pipeline would cost up to the full wait.
    Against Kafka a shorter wait only costs a few more (empty) fetches.
    """
    from faust.transport.drivers import aiokafka as driver

    original = getattr(driver.AIOKafkaConsumerThread._create_worker_consumer, "__wrapped__", driver.AIOKafkaConsumerThread._create_worker_consumer)

    def create(self, transport):
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = ms  # read by aiokafka 0.14 when the consumer starts its fetcher
        return consumer

    create.__wrapped__ = original  # type: ignore[attr-defined]
    driver.AIOKafkaConsumerThread._create_worker_consumer = create


def build_app(settings, policy: Policy, *, roles: tuple[str, ...] = ("detect", "steps", "windows")) -> tuple[faust.App, ProcessorState]:
    """The faust app and its state.  Its HTTP endpoints are :func:`serve_http`'s, not faust's web server."""
    topics = Topics.named(settings.topic_prefix)
    limit_fetch_wait(settings.fetch_wait_ms)
    datadir = os.path.join(tempfile.gettempdir(), "lockstep-faust", settings.processor_id)  # not the cwd
    os.makedirs(os.path.dirname(datadir), exist_ok=True)  # faust creates only the last level
    app = faust.App(
        settings.processor_id,
        **faust_broker_kwargs(settings),
        store="memory://",
        processing_guarantee="at_least_once",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=False,  # topics are created by `lockstep topics` with the same partition count
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.session_timeout_ms / 1000.0,
        broker_heartbeat_interval=max(0.5, settings.session_timeout_ms / 6000.0),
        broker_commit_interval=1.0,
        # records of open steps and windows stay unacknowledged until those close, which needs more records:
        # waiting for every record to be acknowledged before a rebalance or a shutdown (faust's default)
        # never ends while a window is open.  The new owner replays them from the committed offset instead.
        stream_wait_empty=False,
        datadir=datadir,
        web_enabled=False,  # /healthz and /metrics: serve_http (the same bounded server as the sink's)
        **{k: _coerce(v) for k, v in settings.faust.items()},
    )
    st = ProcessorState(policy=policy, step_timeout_s=settings.step_timeout_s, window_timeout_s=settings.window_timeout_s, metrics=Metrics("processor"))
    policy_file = PolicyFile(settings.policy, policy)  # watched: edits apply without a restart
    m = st.metrics

    def t(name: str) -> faust.TopicT:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw", partitions=settings.partitions)

    heartbeats, control, features = t(topics.heartbeats), t(topics.control), t(topics.features)
    stepreports, findings, windows, deadletter = t(topics.stepreports), t(topics.findings), t(topics.windows), t(topics.deadletter)
    series = t(topics.series)
    closed_windows = app.Table("closed_windows", key_type=str, value_type=float, partitions=settings.partitions)
    detector_table = app.Table("detector", key_type=str, value_type=str, partitions=settings.partitions)
    # per job: the baseline of its earlier healthy windows (JobHistory JSON), for job-wide regressions
    job_history = app.Table("job_history", key_type=str, value_type=str, partitions=settings.partitions)

    async def send(topic: faust.TopicT, key: str, record) -> asyncio.Future:
        """Queue a record; the returned future resolves once Kafka acknowledged it."""
        value = record if isinstance(record, bytes) else encode(record)
        delivered = await topic.send(key=key.encode(), value=value)
        m.inc("records_out_total", topic=topic.get_topic_name(), help="records published, by topic")
        m.inc("bytes_out_total", len(value), topic=topic.get_topic_name())
        return delivered

    async def dead(event, err: RecordError, stage: str) -> None:
        msg = event.message
        dl = dead_letter(topic=msg.topic, partition=msg.partition, offset=msg.offset, error=err, stage=stage, payload=event.value)
        log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, err)
        await deadletter.send(key=msg.key, value=encode(dl))
        m.inc("dead_letters_total", reason=err.reason, stage=stage, help="records sent to the dead-letter topic, by reason")

    async def failed(events, exc: Exception, stage: str) -> None:
        """A bug, not bad input (that is caught on the way in): the stage goes on, and the records it could
        not process go to the dead-letter topic, to be replayed once the bug is fixed."""
        log.exception("%s: processing failed; %d input record(s) go to the dead-letter topic", stage, len(events))
        err = RecordError("processing_failed", f"{type(exc).__name__}: {exc}")
        for event in events:
            await dead(event, err, stage)

    def seen(event) -> None:
        msg = event.message
        m.inc("records_in_total", topic=msg.topic, help="records consumed, by topic")
        m.inc("bytes_in_total", len(event.value or b""), topic=msg.topic)
        st.positions[msg.tp] = msg.offset + 1
        if msg.timestamp:  # the producer's CreateTime: right on any broker, unlike the watermarks
            m.set("consumer_lag_seconds", max(0.0, time.time() - msg.timestamp), topic=msg.topic,
                  help="age of the last record consumed, by topic (now - its Kafka timestamp)")  # fmt: skip

    # ------------------------------------------------------------------ detector
    async def decided(decision) -> None:
        if isinstance(decision, ProfileTrigger):
            detector_table[decision.job] = f"{decision.start_step},{decision.start_step + decision.steps}"
            log.info("trigger %s/%s (%s) at step %d for %d steps: %s", decision.job, decision.window, decision.kind, decision.start_step, decision.steps, decision.reason)
            m.inc("triggers_total", kind=decision.kind, help="profiling windows triggered, by what opened them")
        else:
            log.info("refused a window for %s (request %s): %s", decision.job, decision.request, decision.reason)
            m.inc("trigger_refusals_total", code=decision.code, help="operators' trigger requests refused, by reason")
        await send(control, decision.job, decision)

    async def detect(stream):
        async for event in stream.events():
            seen(event)
            try:
                rec = decode(event.value, (StepHeartbeat, DetectorTick, TriggerRequest))
                st.job_partition[rec.job] = event.message.tp
                if rec.job not in st.detector.jobs and rec.job in detector_table:
                    last_start, last_end = map(int, detector_table[rec.job].split(","))
                    st.detector.restore(rec.job, last_start, last_end)
                now = time.time()
                if isinstance(rec, StepHeartbeat):
                    decisions = st.detector.observe(rec, now)  # raises RecordError('from_the_future')
                    st.series.add(rec, now)
                elif isinstance(rec, DetectorTick):
                    decisions = st.detector.tick(rec.job, now)
                else:
                    decisions = [st.detector.request(rec, now)]
            except RecordError as err:
                await dead(event, err, "detect")
                continue
            except Exception as exc:
                await failed([event], exc, "detect")
                continue
            for decision in decisions:
                await decided(decision)

    async def hang_ticks() -> None:
        """No heartbeat arrives during a hang: a timer sends a tick into the job's partition, and the
        agent checks the job there (a timer cannot write the detector's table)."""
        now = time.time()
        for job in st.detector.due_ticks(now):
            await send(heartbeats, job, DetectorTick(job=job, at=now))
        for job in st.detector.forget_idle(now):
            st.job_partition.pop(job, None)
            st.series.drop([job])
        for rec in st.series.due(now):
            await send(series, rec.job, rec)
            m.inc("step_series_points_total", len(rec.steps))
        for code, n in st.detector.suppressed.items():
            m.set("triggers_suppressed", n, code=code, help="automatic windows not opened, by the policy check that stopped them")
        m.set("detector_jobs", len(st.detector.jobs), help="jobs the detector follows")
        m.set("detector_open_windows", st.detector.open_windows(now), help="windows open or scheduled by this processor")
        counters = st.detector.agent_counters()
        for name, what in AGENT_COUNTERS.items():
            m.replace(f"agent_{name}", {(("job", job),): getattr(c, name) for job, c in counters.items()},
                      help=f"{what}, summed over the job's workers as their agents last reported (jobs this processor follows)")  # fmt: skip

    async def report_lag() -> None:
        """Records behind per partition from the high watermarks the fetches carry (a lower bound where the
        broker under-reports the watermark, as Tansu does; ``consumer_lag_seconds`` is right everywhere)."""
        for tp, pos in list(st.positions.items()):
            high = app.consumer.highwater(tp) if app.consumer else None
            if high is not None:
                m.set("consumer_lag_records", max(0, high - pos), topic=tp.topic, partition=str(tp.partition),
                      help="high watermark - next offset, by partition (a lower bound on brokers that under-report the watermark)")  # fmt: skip

    async def reload_policy() -> None:
        new = policy_file.check()
        if new is not None:
            st.set_policy(new)

    # ------------------------------------------------------------------ steps
    async def release_steps(handles) -> None:
        for ev in st.step_acks.release(handles):
            await st.step_stream.ack(ev)  # type: ignore[attr-defined]

    async def finish_step(closed: ClosedStep) -> None:
        p = closed.pending
        t0 = time.perf_counter()
        entries = [p.batches[r] for r in sorted(p.batches)] + p.replaced
        report = None
        try:
            # the function tables' values, for the whole step at once (ft.read left them unchecked)
            errors = ft.check_tables([table for _, table, _ in entries])
            good = [e for e, err in zip(entries[: len(p.batches)], errors) if err is None]
            if good:
                recs = [b for b, _, _ in good]
                frame = StepFrame.from_tables(
                    p.job, p.window, p.step, [b.worker for b in recs], [b.step_time_us for b in recs],
                    [table for _, table, _ in good], st.policy_for(p.policy).diagnosis.peer_group_keys, [b.hardware for b in recs],
                )  # fmt: skip
                result = analyze_step(frame, st.policy_for(p.policy).diagnosis)
                report = encode(step_report(
                    result, window_start=p.window_start, window_steps=p.window_steps, expected_workers=p.expected_workers,
                    bytes_in=p.bytes_in, policy=p.policy, tenant=p.tenant, closed=closed.reason,
                ))  # fmt: skip
        except Exception as exc:
            await failed([h.event for h in p.handles], exc, "steps")
            await release_steps(p.handles)
            return
        for (_, _, handle), err in zip(entries, errors):
            if err is not None:
                await dead(handle.event, err, "steps")
        if report is not None:
            await send(stepreports, p.job, report)
            m.inc("steps_closed_total", reason=closed.reason, help="steps closed, by reason")
            m.set("step_analysis_seconds", time.perf_counter() - t0, help="time of the last step analysis")
            m.observe("step_close_latency_seconds", time.time() - p.opened_at, help="first feature batch of a step to its step report")
        await release_steps(p.handles)

    async def steps(stream):
        st.step_stream = s = stream.noack()
        async for event in s.events():
            seen(event)
            msg = event.message
            h = st.step_acks.hold(msg.tp, msg.offset, event)
            try:
                batch = decode(event.value, FeatureBatch)
                table = ft.read(batch.functions, batch.functions_codec)  # values: checked per step (finish_step)
                closed, late = st.steps.add(batch, table, len(event.value), h, time.time())
            except RecordError as err:
                await dead(event, err, "steps")
                await release_steps([h])
                continue
            except Exception as exc:  # a bug, not bad input: the record must not stop the stage (again after every restart)
                await failed([event], exc, "steps")
                await release_steps([h])
                continue
            if late:
                m.inc("late_records_total", stage="steps", help="records for steps or windows already closed")
                await release_steps([h])
            elif closed:
                await finish_step(closed)
            m.set("open_steps", st.steps.open_steps)

    async def expire_steps() -> None:
        for closed in st.steps.expire(time.time()):
            await finish_step(closed)

    # ------------------------------------------------------------------ windows
    async def release_windows(handles) -> None:
        for ev in st.window_acks.release(handles):
            await st.window_stream.ack(ev)  # type: ignore[attr-defined]

    async def finish_window(closed: ClosedWindow) -> None:
        w = closed.pending
        now = time.time()
        policy = st.policy_for(w.policy)
        info = WindowInfo(job=w.job, window=w.window, start_step=w.window_start, steps=w.window_steps,
                          expected_workers=w.expected_workers, tenant=w.tenant, policy=policy.ref)  # fmt: skip
        history = None
        if w.job in job_history:
            try:
                history = JobHistory.decode(job_history[w.job])
            except HistoryError as err:
                log.warning("job %s: dropping its stored history: %s", w.job, err)
        try:
            diagnosis = diagnose_window(info, list(w.results.values()), policy, now=now, closed=closed.reason, bytes_in=w.bytes_in, history=history)
            new_history = diagnosis.history.encode() if diagnosis.history is not None and diagnosis.history is not history else None
            out = [(f.cause, encode(f)) for f in diagnosis.findings]
            report = encode(diagnosis.report)
        except Exception as exc:
            await failed([h.event for h in w.handles], exc, "windows")
            await release_windows(w.handles)
            return
        sent = []
        for cause, value in out:
            sent.append(await send(findings, w.job, value))
            m.inc("findings_total", cause=cause, help="findings published, by cause")
        sent.append(await send(windows, w.job, report))
        # the tables' changelogs travel apart from the findings: mark the window closed (which makes a replay
        # skip it) only once its findings and report are in Kafka, or a crash in between would lose them
        await asyncio.gather(*sent)
        try:  # the window's heatmap: for people, so it must never hold up the window
            dmap = deviation_map(w.job, w.window, w.tenant, w.window_start, w.window_steps, list(w.results.values()), now)
            await send(series, w.job, dmap)
        except Exception:
            log.exception("window %s/%s: no deviation map", w.job, w.window)
        if new_history is not None:
            job_history[w.job] = new_history
        closed_windows[f"{w.job}:{w.window}"] = now
        m.inc("windows_closed_total", reason=closed.reason, help="windows closed, by reason")
        m.observe("window_close_latency_seconds", time.time() - w.opened_at, help="first step report of a window to its findings published")
        log.info("window %s/%s closed (%s): %d finding(s), coverage %.2f", w.job, w.window, closed.reason, len(diagnosis.findings), diagnosis.report.coverage)
        await release_windows(w.handles)

    async def windows_agent(stream):
        st.window_stream = s = stream.noack()
        async for event in s.events():
            seen(event)
            msg = event.message
            h = st.window_acks.hold(msg.tp, msg.offset, event)
            try:
                rec = decode(event.value, (StepReport, WindowTimeout))
                if f"{rec.job}:{rec.window}" in closed_windows:
                    m.inc("late_records_total", stage="windows")
                    await release_windows([h])
                    continue
                if isinstance(rec, WindowTimeout):
                    key = (rec.job, rec.window)
                    if not st.windows.hold(key, h):
                        await release_windows([h])
                        continue
                    closed = st.windows.close(key, "timeout")
                else:
                    closed = st.windows.add(rec, step_result(rec), h, time.time())
            except RecordError as err:
                await dead(event, err, "windows")
                await release_windows([h])
                continue
            except Exception as exc:  # a bug, not bad input: the record must not stop the stage (again after every restart)
                await failed([event], exc, "windows")
                await release_windows([h])
                continue
            if closed:
                await finish_window(closed)
            m.set("open_windows", st.windows.open_windows, help="windows waiting for step reports")

    async def request_timeouts() -> None:
        for job, window in st.windows.due(time.time()):
            await send(stepreports, job, WindowTimeout(job=job, window=window))

    def supervised(name: str, fun):
        """An agent that dies (I/O errors, bugs outside the guarded diagnosis) fails /healthz, so that the
        process is restarted and replays from the committed offsets instead of idling while it looks healthy."""

        async def run(stream):
            try:
                await fun(stream)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                st.crashed[name] = f"{type(exc).__name__}: {exc}"
                raise

        return run

    app.timer(1.0, name="reload_policy")(reload_policy)
    app.timer(1.0, name="report_lag")(report_lag)
    if "detect" in roles:
        app.agent(heartbeats, name="detect", concurrency=1)(supervised("detect", detect))
        app.timer(0.5, name="hang_ticks")(hang_ticks)
    if "steps" in roles:
        app.agent(features, name="steps", concurrency=1)(supervised("steps", steps))
        app.timer(0.5, name="expire_steps")(expire_steps)
    if "windows" in roles:
        app.agent(stepreports, name="windows", concurrency=1)(supervised("windows", windows_agent))
        app.timer(0.5, name="request_timeouts")(request_timeouts)

    @app.on_partitions_revoked.connect
    async def on_revoked(app_, revoked, **kwargs) -> None:  # noqa: ARG001
        gone = [job for job, tp in st.job_partition.items() if tp in revoked]
        st.detector.drop(gone)
        st.series.drop(gone)
        for job in gone:
            del st.job_partition[job]
        st.steps.drop(set(revoked))
        st.step_acks.drop(set(revoked))
        st.windows.drop(set(revoked))
        st.window_acks.drop(set(revoked))
        for tp in revoked:
            st.positions.pop(tp, None)
        log.info("partitions revoked: %s", describe_partitions(revoked) or "none")

    @app.on_partitions_assigned.connect
    async def on_assigned(app_, assigned, **kwargs) -> None:  # noqa: ARG001
        st.assigned = True
        log.info("partitions assigned: %s", describe_partitions(assigned) or "none")

    return app, st


def describe_partitions(tps) -> str:
    """``heartbeats 0,1,2; features 0,1`` for a set of topic partitions."""
    by_topic: dict[str, list[int]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return "; ".join(f"{t} {','.join(map(str, sorted(p)))}" for t, p in sorted(by_topic.items()))


def serve_http(st: ProcessorState, host: str, port: int):
    """``GET /healthz`` (200 once partitions are assigned; 503 ``starting``, or ``failed`` when a stage died)
    and ``GET /metrics``, on :class:`lockstep.web.HttpServer` (bounded connections, timeouts)."""
    from aiohttp import web

    from ..metrics import CONTENT_TYPE
    from ..web import HttpServer, json_response

    async def healthz(request):  # noqa: ARG001
        status = "failed" if st.crashed else "ok" if st.assigned else "starting"
        body = {"status": status, "open_steps": st.steps.open_steps, "open_windows": st.windows.open_windows, "crashed": dict(st.crashed)}
        return json_response(body, status=200 if status == "ok" else 503)

    async def metrics(request):  # noqa: ARG001
        return web.Response(body=st.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    server = HttpServer(host, port, st.metrics, name="processor-http")
    server.get("/healthz", healthz)
    server.get("/metrics", metrics)
    return server.start()


def _coerce(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def run_worker(app: faust.App, loglevel: str = "INFO", log_format: str = "text") -> None:
    """Run the faust worker in this process until SIGTERM/SIGINT, logging in the format of every other
    command (:func:`lockstep.logs.setup_logging`), not faust's own."""
    from faust.worker import Worker

    from ..logs import setup_logging

    class _Worker(Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.spinner = None  # faust's terminal spinner writes escape codes into the log

        def _setup_logging(self) -> None:
            setup_logging(loglevel, log_format)

    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = _Worker(app, loglevel=loglevel.lower() if loglevel != "WARNING" else "warn", quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()
