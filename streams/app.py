"""The stream processor's faust adapter: topics, tables, agents that feed the stages, timers, rebalances.

The stages (:mod:`lockstep.streams.stages`) hold the processor's logic; this module only connects
them to faust, one app (one consumer group), at-least-once, concurrency 1:

- ``heartbeats`` lockstep.heartbeats -> HeartbeatStage -> lockstep.partials (a shard's heartbeats of a step)
- ``detect``   lockstep.partials    -> DetectStage  -> lockstep.control, lockstep.series, lockstep.stepreports (WindowExpected)
- ``shards``   lockstep.windowfeatures -> ShardStage -> lockstep.features (step slices)
- ``steps``    lockstep.features    -> StepStage    -> lockstep.stepreports
- ``windows``  lockstep.stepreports -> WindowStage  -> lockstep.findings, lockstep.windows, lockstep.series
- ``hangs``    lockstep.hangs       -> HangStage    -> lockstep.findings (who holds a hung job, and where)

Each agent reads its topic without faust's automatic acks (``noack``), turns every event into a
:class:`RecordIn` and hands it to its stage (the heartbeat stage, which writes no table, gets them in
batches of up to :data:`TAKE_MAX`, ``noack_take``: it aggregates a batch in columns); :class:`FaustOutput` sends what the stages publish and
acknowledges, through the stream it came from, each record a stage says it is done with (faust then
commits up to there).  The tables are faust tables (changelog-backed), written by the stages only
while they process a record (faust's rule; the stages' timers send records instead).
Delivery guarantees: ARCHITECTURE.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

import faust
from faust.types import TP, EventT, StreamT, TableT

from ..kafka import Topics, faust_broker_kwargs
from ..kafka.clients import MAX_BATCH_BYTES
from ..kafka.inflate import bound_aiokafka
from ..metrics import Metrics
from .policy import Policy, PolicyFile
from .stages import Partition, Processor, RecordIn, Stage, Tables

log = logging.getLogger("lockstep.processor")

TABLES = tuple(f.name for f in dataclasses.fields(Tables))
ROLES = ("heartbeats", "detect", "shards", "steps", "windows", "hangs")
#: the heartbeat stage's batches: at most this many records, gathered for at most this long.  faust's own cost per
#: record (~100 µs here) is the same either way; a batch lets the stage decode and aggregate in columns.  Only a stage
#: that writes no table may take batches (a table write lands in the partition of the batch's last record).
TAKE_MAX, TAKE_WITHIN_S = 2000, 0.05


def changelog_topics(app_id: str) -> list[str]:
    return [f"{app_id}-{t}-changelog" for t in TABLES]


class FaustOutput:
    """The stages' Output on faust: records go out through the app's topics; a record a stage is done with
    is acknowledged through the stream it came from (faust commits the offsets of acknowledged records)."""

    def __init__(self, topics: dict[str, faust.TopicT]):
        self.topics = topics
        self._held: dict[tuple[Partition, int], tuple[StreamT, EventT]] = {}  # (partition, offset) -> its event
        self._partitions: dict[TP, Partition] = {}  # one object per partition, shared by its records

    def received(self, stream: StreamT, event: EventT) -> RecordIn:
        msg = event.message
        source = self._partitions.get(msg.tp)
        if source is None:
            source = self._partitions[msg.tp] = Partition(msg.topic, msg.partition)
        self._held[(source, msg.offset)] = (stream, event)
        return RecordIn(source, msg.offset, msg.key, event.value or b"", msg.timestamp or None)

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[object]:
        return await self.topics[topic].send(key=key, value=value)

    async def acknowledge(self, records: Sequence[RecordIn]) -> None:
        for r in records:
            held = self._held.pop((r.source, r.offset), None)
            if held is not None:
                await held[0].ack(held[1])

    def forget(self, partitions: Collection[Partition]) -> None:
        """Partitions revoked: their events will not be acknowledged here (the new owner replays them)."""
        for k in [k for k in self._held if k[0] in partitions]:
            del self._held[k]


def limit_fetch_wait(ms: int) -> None:
    """faust creates its aiokafka consumer with a fixed 1500 ms fetch wait; cap it.

    The embedded broker (Tansu) does not answer a waiting fetch when data
    arrives, so every hop through the pipeline would cost up to the full wait.
    Against Kafka a shorter wait only costs a few more (empty) fetches.
    """
    from faust.transport.drivers import aiokafka as driver

    original = getattr(
        driver.AIOKafkaConsumerThread._create_worker_consumer,
        "__wrapped__",
        driver.AIOKafkaConsumerThread._create_worker_consumer,
    )

    def create(self, transport):
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = ms  # read by aiokafka 0.14 when the consumer starts its fetcher
        return consumer

    create.__wrapped__ = original  # type: ignore[attr-defined]
    driver.AIOKafkaConsumerThread._create_worker_consumer = create  # type: ignore[method-assign]  # the patch


def build_app(settings, policy: Policy, *, roles: tuple[str, ...] = ROLES) -> tuple[faust.App, Processor]:
    """The faust app and the processor it drives.  Its HTTP endpoints are :func:`serve_http`'s, not faust's web server."""
    limit_fetch_wait(settings.fetch_wait_ms)
    app = _faust_app(settings)
    topics = Topics.named(settings.topic_prefix)
    output = FaustOutput(
        {
            name: app.topic(
                name,
                key_type=bytes,
                value_type=bytes,
                key_serializer="raw",
                value_serializer="raw",
                partitions=settings.partitions,
            )
            for name in topics.all()
        }
    )
    processor = _processor(app, settings, policy, topics, output)
    policy_file = PolicyFile(settings.policy, policy)  # watched: edits apply without a restart
    intake = _Intake(processor, output)
    bound_aiokafka(MAX_BATCH_BYTES, on_skip=intake.skipped)  # aiokafka would inflate each batch whole, without a bound

    async def reload_policy(now: float) -> None:
        new = policy_file.check()
        if new is not None:
            processor.set_policy(new)

    async def report_lag(now: float) -> None:
        intake.report_lag(app)

    _every(app, 1.0, "reload_policy", reload_policy)
    _every(app, 1.0, "report_lag", report_lag)
    inputs = {
        "heartbeats": (topics.heartbeats, processor.heartbeats, "expire_heartbeats"),
        "detect": (topics.partials, processor.detect, "hang_ticks"),
        "shards": (topics.windowfeatures, processor.shards, "expire_shards"),
        "steps": (topics.features, processor.steps, "expire_steps"),
        "windows": (topics.stepreports, processor.windows, "request_timeouts"),
        "hangs": (topics.hangs, processor.hangs, "expire_hangs"),
    }
    for role in roles:
        topic, stage, timer = inputs[role]
        app.agent(output.topics[topic], name=role, concurrency=1)(
            intake.agent(role, stage, batches=role == "heartbeats")
        )
        _every(app, 0.5, timer, stage.on_timer)
    _on_rebalance(app, processor, output, intake.positions)
    return app, processor


def _faust_app(settings) -> faust.App:
    """The faust app: one consumer group, at-least-once, topics declared elsewhere, no web server of its own."""
    datadir = os.path.join(tempfile.gettempdir(), "lockstep-faust", settings.processor_id)  # not the cwd
    os.makedirs(os.path.dirname(datadir), exist_ok=True)  # faust creates only the last level
    return faust.App(
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


def _processor(app: faust.App, settings, policy: Policy, topics: Topics, output: FaustOutput) -> Processor:
    """The processor's stages over the app's changelog-backed tables."""

    def table(name: str, value_type: type) -> TableT:
        return app.Table(name, key_type=str, value_type=value_type, partitions=settings.partitions)

    tables = Tables(
        closed_windows=table("closed_windows", float),
        detector=table("detector", str),
        job_history=table("job_history", str),
    )
    return Processor(
        policy,
        topics,
        output,
        tables,
        step_timeout_s=settings.step_timeout_s,
        window_timeout_s=settings.window_timeout_s,
        heartbeat_lateness_s=settings.heartbeat_lateness_s,
        heartbeat_lateness_steps=settings.heartbeat_lateness_steps,
        stage_budget_bytes=settings.stage_budget_mib << 20,
        metrics=Metrics("processor"),
    )


class _Intake:
    """The records coming in: each agent's loop that hands them to its stage, counted as they come (records, bytes,
    the lag in seconds), with each partition's next offset (``positions``) for the lag in records."""

    def __init__(self, processor: Processor, output: FaustOutput):
        self.processor = processor
        self.output = output
        self.m = processor.metrics
        self.positions: dict[Partition, int] = {}  # next offset to consume, for the lag

    def skipped(self, topic: str, partition: int, first: int, last: int, reason: str) -> None:
        """A compressed batch that inflates beyond MAX_BATCH_BYTES (or cannot be inflated): its records are not read."""
        log.warning(
            "skipped a record batch of %s[%d], offsets %d..%d, unread: %s", topic, partition, first, last, reason
        )
        self.m.inc("kafka_batches_skipped_total", topic=topic)

    def seen(self, r: RecordIn) -> None:
        m = self.m
        m.inc("records_in_total", topic=r.topic)
        m.inc("bytes_in_total", len(r.value), topic=r.topic)
        self.positions[r.source] = r.offset + 1
        if r.timestamp:  # the producer's CreateTime: right on any broker, unlike the watermarks
            m.set(
                "consumer_lag_seconds",
                max(0.0, time.time() - r.timestamp),
                topic=r.topic,
            )

    def agent(self, name: str, stage: Stage, batches: bool) -> Callable[..., Awaitable[None]]:
        """The agent: every record to the stage (``batches``: as they come, up to TAKE_MAX at a time).  One that dies
        (an I/O error, a bug outside the stages' guards) fails /healthz, so that the process is restarted and replays
        instead of idling while it looks healthy."""
        output, seen, processor = self.output, self.seen, self.processor

        async def agent(stream: faust.Stream) -> None:
            try:
                if batches:
                    async for events in stream.noack_take(TAKE_MAX, within=TAKE_WITHIN_S):  # acknowledged by the stage
                        records = [output.received(stream, event) for event in events]
                        for record in records:
                            seen(record)
                        await stage.on_records(records)
                    return
                s = stream.noack()  # the stage acknowledges, through the Output
                async for event in s.events():
                    record = output.received(s, event)
                    seen(record)
                    await stage.on_record(record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                processor.crashed[name] = f"{type(exc).__name__}: {exc}"
                raise

        return agent

    def report_lag(self, app: faust.App) -> None:
        """Records behind per partition from the high watermarks the fetches carry (a lower bound where the
        broker under-reports the watermark, as Tansu does; ``consumer_lag_seconds`` is right everywhere)."""
        for p, pos in list(self.positions.items()):
            high = app.consumer.highwater(TP(p.topic, p.partition)) if app.consumer else None
            if high is not None:
                self.m.set(
                    "consumer_lag_records",
                    max(0, high - pos),
                    topic=p.topic,
                    partition=str(p.partition),
                )


def _every(app: faust.App, seconds: float, name: str, fun: Callable[[float], Awaitable[None]]) -> None:
    async def timer() -> None:
        await fun(time.time())

    app.timer(seconds, name=name)(timer)


def _on_rebalance(app: faust.App, processor: Processor, output: FaustOutput, positions: dict[Partition, int]) -> None:
    """Partitions revoked: the stages drop what they hold of them, and so do the output and the lag; assigned: the
    stages learn of them (and /healthz turns ready)."""

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # faust's stubs: a handler of any signal
    async def on_revoked(app_, revoked: set[TP], **kwargs) -> None:
        gone = {Partition(tp.topic, tp.partition) for tp in revoked}
        for stage in processor.stages:
            stage.on_revoked(gone)
        output.forget(gone)
        for p in gone:
            positions.pop(p, None)
        log.info("partitions revoked: %s", describe_partitions(gone) or "none")

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]  # faust's stubs: a handler of any signal
    async def on_assigned(app_, assigned: set[TP], **kwargs) -> None:
        got = {Partition(tp.topic, tp.partition) for tp in assigned}
        for stage in processor.stages:
            stage.on_assigned(got)
        processor.assigned = True
        log.info("partitions assigned: %s", describe_partitions(got) or "none")


def describe_partitions(partitions: Iterable[Partition]) -> str:
    """``heartbeats 0,1,2; features 0,1`` for a set of topic partitions."""
    by_topic: dict[str, list[int]] = {}
    for p in partitions:
        by_topic.setdefault(p.topic, []).append(p.partition)
    return "; ".join(f"{t} {','.join(map(str, sorted(n)))}" for t, n in sorted(by_topic.items()))


def serve_http(processor: Processor, host: str, port: int):
    """``GET /healthz`` (200 once partitions are assigned; 503 ``starting``, or ``failed`` when a stage died)
    and ``GET /metrics``, on :class:`lockstep.web.HttpServer` (bounded connections, timeouts)."""
    from aiohttp import web

    from ..metrics import CONTENT_TYPE
    from ..web import HttpServer, json_response

    async def healthz(request):
        status = "failed" if processor.crashed else "ok" if processor.assigned else "starting"
        body = {
            "status": status,
            "open_steps": len(processor.steps.assembler),
            "open_windows": len(processor.windows.assembler),
            "crashed": dict(processor.crashed),
        }
        return json_response(body, status=200 if status == "ok" else 503)

    async def metrics(request):
        return web.Response(body=processor.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    server = HttpServer(host, port, processor.metrics, name="processor-http")
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


#: how long a processor told to stop may take to stop cleanly; then it exits as it is (its effects are idempotent and
#: its offsets are committed only after their records' effects, so nothing is lost: the next owner replays)
STOP_GRACE_S = 10.0


def exit_after(grace_s: float) -> None:
    """End this process ``grace_s`` seconds from now unless it ended before: a faust worker whose Kafka client is
    stuck (its broker gone) never finishes stopping, and logged errors for as long as it was left."""

    def stop() -> None:
        time.sleep(grace_s)
        log.warning("did not stop within %.0f s of being told to; exiting now", grace_s)
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=stop, name="exit-after", daemon=True).start()


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

        def _schedule_shutdown(self, signum) -> None:  # SIGTERM, SIGINT (and a dead parent's SIGTERM)
            exit_after(STOP_GRACE_S)
            super()._schedule_shutdown(signum)

    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = _Worker(
        app, loglevel=loglevel.lower() if loglevel != "WARNING" else "warn", quiet=True, redirect_stdouts=False
    )
    worker.execute_from_commandline()
