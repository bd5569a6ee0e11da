"""The host agent inside a training process: ``agent.step()`` once per iteration.

Three threads, so that the training step never waits for the agent:

- the **training thread** calls :meth:`Agent.step`: it measures the step, queues a
  heartbeat (an append to a bounded queue), takes any trigger the control
  follower handed over, and at window boundaries starts, steps or stops
  ``torch.profiler`` and the hardware sampler;
- ``lockstep-agent-io`` publishes (batched, spooled when Kafka is away) and follows
  the control topic;
- on a host of several ranks (``relay``, :mod:`~lockstep.producers.agent.relay`), the agent of
  local rank 0 also runs ``lockstep-agent-relay``, which gathers the other agents' heartbeats for
  its one Kafka producer and forwards them the control records; those agents hand their heartbeats
  over on a local socket and have no Kafka client while the relay answers;
- ``lockstep-agent-window`` exports the finished window's trace, summarises it into
  one feature record (``WindowFeatures``), keeps the raw trace, and answers raw-trace requests.

Nothing here raises into the training loop: a window that cannot be profiled or
summarised is logged and counted (``failed_windows``), and training goes on.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec

from ...kafka import (
    CONFLUENT,
    Clients,
    Topics,
    agent_consumer_config,
    agent_producer_config,
    heartbeat_key,
    window_features_key,
)
from ...schemas.records import AgentCounters, ProfileTrigger, RawRequest, StepHeartbeat, batch_heartbeats, encode
from . import tcpdiag
from .control import ControlFollower
from .hang import HangResponder, ProcessRegistry
from .meta import Identity, discover
from .outbox import Outbox
from .relay import Relay, RelayLink, merge_batches, run_dir
from .retention import RawStore
from .sampler import HardwareSampler, SamplerStats
from .schedule import ScheduledWindow, WindowSchedule
from .settings import AgentConfig
from .spool import Spool

if TYPE_CHECKING:  # torch is imported only when a window starts
    from .profiler import ProfilerKind, TorchWindow

log = logging.getLogger("lockstep.agent")

#: an agent linked to a relay closes its own Kafka producer after this long without a record of its own to send
IDLE_PRODUCER_S = 30.0
#: an agent that starts before its host's relay waits this long (or six flush intervals) for it, keeping its heartbeats
RELAY_JOIN_S = 3.0
#: trigger echoes waiting for a heartbeat each (receipts and refusals; a burst of triggers keeps the newest)
ECHOES_PENDING = 16


@dataclass
class WindowRecord:
    """What happened to one accepted window (for tests, benchmarks and logs)."""

    window: str
    start_step: int
    steps: int
    summarised: int = 0  # steps summarised (all in one WindowFeatures record)
    record_bytes: int = 0  # that record, encoded
    trace_bytes: int = 0
    events: int = 0
    summarise_s: float = 0.0
    sampler: SamplerStats | None = None
    error: str = ""


@dataclass
class AgentReport:
    step: int
    counters: AgentCounters
    sent: int
    spooled_now: int
    kafka_down: bool
    refused: list[tuple[str, str]] = field(default_factory=list)  # (window, reason)
    windows: list[WindowRecord] = field(default_factory=list)
    raw_answers: int = 0
    relay_role: str = "direct"  # Agent.relay_role
    handed_over: int = 0  # heartbeat batches this agent handed to its host's relay
    relay_fallbacks: int = 0  # times the relay stopped answering and this agent went its own way
    relayed_rows: int = 0  # heartbeats of other agents this agent relayed
    kafka_producer: bool = True  # whether this agent holds a Kafka producer now


def agent_logging(level: str) -> None:
    """The agent's lines (logger ``lockstep.agent``) at ``level``, on stderr when the training process set up no
    logging of its own (then Python would show only warnings, and not the agent's INFO lines); through the process's
    own handlers otherwise.  At INFO the agent says one line when it attaches, accepts, refuses or publishes a window,
    and when it spools or drops records; the rest of what it does is DEBUG, and so are librdkafka's own lines."""
    logger = logging.getLogger("lockstep.agent")
    logger.setLevel(getattr(logging, level))
    client = logging.getLogger("lockstep.librdkafka")
    if client.level == logging.NOTSET and level != "DEBUG":
        # librdkafka's own lines (a FAIL line per retry while Kafka is down) only at DEBUG: the agent says it spools
        client.setLevel(logging.CRITICAL + 1)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False  # a handler the process adds later does not print the agent's lines twice


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        identity: Identity | None = None,
        clients: Clients = CONFLUENT,
        profiler: ProfilerKind | None = None,
    ):
        agent_logging(config.log_level)
        self.config = config
        self._kind = profiler  # None: torch.profiler (made when the first window starts)
        ident = identity or discover(config)
        self.meta = ident.meta
        self.world_size = ident.world_size
        self._world_reported = ident.world_size if ident.world_known else msgspec.UNSET  # never a guess of 1
        self._gpu_uuid = ident.gpu_uuid
        self._pid = os.getpid()
        settings = config.settings()
        self.topics = Topics.named(settings.topic_prefix)
        self._job_key = config.job.encode()
        spool = Spool(config.resolved_spool_dir(self.meta.rank), config.spool_max_bytes)
        self._store = RawStore(config.resolved_raw_dir(self.meta.rank), config.raw_max_bytes)
        self._relay: Relay | None = None  # local rank 0: this agent relays its host's heartbeats
        self._link: RelayLink | None = None  # another local rank: this agent hands its heartbeats to the relay
        if config.relay == "auto" and self.world_size > 1 and config.heartbeat_shard_workers > 0:
            self._join_relay()
        self._hang = self._hang_responder()
        self._control = ControlFollower(
            agent_consumer_config(settings, config.job), self.topics.control, config.job, clients=clients
        )
        self._outbox = Outbox(
            agent_producer_config(settings, config.delivery_timeout_s),
            spool,
            queue_max=config.queue_max,
            flush_interval_s=config.flush_interval_s,
            tick=self._io_tick,
            on_sent=self._sent,
            coalesce=self._coalesce if config.heartbeat_shard_workers else None,
            clients=clients,
            lazy=self._link is not None,  # a Kafka producer only when a record has to go to Kafka itself
            idle_close_s=IDLE_PRODUCER_S if self._link is not None else None,
        )
        self._schedule = WindowSchedule()
        self._inbox: deque[ProfileTrigger] = deque()  # io thread -> training thread
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._window_thread = threading.Thread(target=self._window_loop, name="lockstep-agent-window", daemon=True)
        self._refused: list[tuple[str, str]] = []
        self._failed = 0
        self._windows: list[WindowRecord] = []
        self._raw_answers = 0
        self._io_snapshot = (0, 0)  # (dropped, spooled) as the io thread last saw them
        self._last_counters = AgentCounters()
        # (window, receipt latency, refusal: "" accepted) of the triggers received, one on each next heartbeat (the io
        # thread appends receipts, the training thread refusals: a deque's append and popleft are atomic)
        self._echoes: deque[tuple[str, float, str]] = deque(maxlen=ECHOES_PENDING)
        # the running window
        self._torch: TorchWindow | None = None
        self._sampler: HardwareSampler | None = None
        self._tcp_before: dict[tuple[str, str], tcpdiag.Socket] | None = None
        self._prepared: tuple[str, HardwareSampler] | None = (
            None  # (window, its sampler process, started at acceptance)
        )
        self._boundaries: dict[int, float] = {}
        self._record: WindowRecord | None = None

        self._step = config.start_step
        self._t_last = time.perf_counter()
        self._last_dt = 0.0
        self._closed = False
        self._outbox.start()
        self._window_thread.start()
        #: the agent's own threads, whose events are taken out of the trace before summarising
        self._own_threads: frozenset[int] = frozenset(
            t
            for t in (
                self._outbox.native_id,
                self._window_thread.native_id,
                self._relay.native_id if self._relay is not None else None,
            )
            if t is not None
        )
        atexit.register(self.close)
        log.info(
            "lockstep agent attached: job %s (run %s), worker %d of %d on %s (%s), NIC %s, publishing to %s",
            config.job,
            config.run_id,
            self.meta.rank,
            self.world_size,
            self.meta.host,
            self.meta.device,
            self.meta.nic or "?",
            settings.bootstrap_servers,
        )

    def _hang_responder(self) -> HangResponder | None:
        """What answers hang triggers from the io thread (the training thread, which creates the agent, is stuck
        then); None when it cannot be made: the agent works without it, and this worker leaves hang triggers
        unanswered."""
        cfg = self.config
        try:
            return HangResponder(
                self.meta,
                cfg.redact,
                cfg.tenant,
                registry=ProcessRegistry(
                    (cfg.relay_dir if cfg.relay_dir is not None else run_dir(cfg.job, self.meta.host)) / "pids"
                ),
            )
        except Exception:
            log.exception("hang answers are off for this worker")
            return None

    def _join_relay(self) -> None:
        """Become the host's relay (local rank 0) or link to it; without either, the agent works on its own."""
        cfg = self.config
        directory = cfg.relay_dir if cfg.relay_dir is not None else run_dir(cfg.job, self.meta.host)
        try:
            if self.meta.local_rank == 0:
                # no periodic pings: each would wake every agent's publishing thread (~0.1 ms of CPU here); a
                # hand-over the relay takes tells an agent it is there, one it cannot take that it is not
                self._relay = Relay(directory).start()
            else:
                join = max(RELAY_JOIN_S, 6 * cfg.flush_interval_s)
                self._link = RelayLink(directory, join_s=join, retry_s=2 * join)
        except OSError as exc:
            log.warning("no host relay in %s (%s): this agent sends to Kafka itself", directory, exc)

    @property
    def relay_role(self) -> str:
        """``relay`` (this agent sends its host's heartbeats), ``relayed`` (it hands its own to the relay now),
        ``direct`` (it sends its own: no relay, or the relay does not answer)."""
        if self._relay is not None:
            return "relay"
        return "relayed" if self._link is not None and self._link.relayed else "direct"

    # ------------------------------------------------------------------ the training thread

    @property
    def current_step(self) -> int:
        """The step now running."""
        return self._step

    def step(self) -> None:
        """Call once per training iteration, at its end."""
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        self._last_dt = dt
        step = self._step
        self._step = step + 1
        self._outbox.put(self.topics.heartbeats, self._job_key, self._heartbeat(step, dt))
        if self._inbox:
            self._take_triggers()
        if self._schedule.busy:
            self._boundary(self._step)

    def _heartbeat(self, step: int, dt: float, **extra) -> StepHeartbeat:
        """The heartbeat of ``step``; optional fields only when there is news (the always-on signal stays small)."""
        dropped, spooled = self._io_snapshot
        c = self._last_counters
        if (c.dropped_records, c.spooled_records, c.refused_triggers, c.failed_windows) != (
            dropped,
            spooled,
            len(self._refused),
            self._failed,
        ):
            c = self._last_counters = AgentCounters(
                dropped_records=dropped,
                spooled_records=spooled,
                refused_triggers=len(self._refused),
                failed_windows=self._failed,
            )
            extra["agent"] = c
        if self._echoes:  # the detector measures the control topic's latency from these
            extra["trigger_window"], extra["trigger_latency_s"], refused = self._echoes.popleft()
            if refused:  # the detector closes a window every worker refused, and may ask again at once
                extra["trigger_refused"] = refused
        return StepHeartbeat(
            job=self.config.job,
            worker=self.meta.rank,
            step=step,
            step_time_s=max(dt, 1e-9),
            host=self.meta.host,
            sent_at=time.time(),
            tenant=self.config.tenant,
            world_size=self._world_reported,  # the job's membership, which the processor counts steps and windows against
            **extra,
        )

    def _sent(self, topic: str, key: bytes | None, size: int) -> None:
        """The io thread: Kafka acknowledged a record.  A window's feature record is the window published."""
        if topic == self.topics.windowfeatures and key is not None:
            window = key.decode(errors="replace").rsplit(":", 2)[-2] if key.count(b":") >= 2 else "?"
            log.info("published window %s: its %d-byte feature record is in Kafka", window, size)

    def _coalesce(self, items: list) -> list:
        """The io thread, at each flush: the heartbeats that accumulated go as one ``HeartbeatBatch`` (key ``job/shard``),
        ahead of the other records, which are unchanged.  A relay adds what its host's agents handed over (one batch
        per shard for the host); an agent linked to a relay hands its batch over instead (what the relay does not
        take goes to Kafka here)."""
        beats = [record for _, _, record in items if isinstance(record, StepHeartbeat)]
        batches = [b for _, b in batch_heartbeats(beats, self.config.heartbeat_shard_workers)] if beats else []
        if self._relay is not None:
            batches = merge_batches([*batches, *self._relay.take()])
        elif self._link is not None and batches:
            batches = self._link.hand_over(batches)
        if not beats:
            return [(self.topics.heartbeats, heartbeat_key(b.job, b.shard), b) for b in batches] + items
        return [(self.topics.heartbeats, heartbeat_key(b.job, b.shard), b) for b in batches] + [
            item for item in items if not isinstance(item[2], StepHeartbeat)
        ]

    def _take_triggers(self) -> None:
        while self._inbox:
            trig = self._inbox.popleft()
            offer = self._schedule.offer(trig, self._step - 1)  # the step that just ended is past
            if offer.accepted:
                log.info(
                    "accepted profiling window %s: steps %d..%d (%s)",
                    trig.window,
                    trig.start_step,
                    trig.start_step + trig.steps - 1,
                    trig.reason or "no reason given",
                )
                self._prepare_sampler(trig)
            elif offer.reason != "duplicate":
                self._refused.append((trig.window, offer.reason))
                # echoed on the next heartbeat, so that a window every worker refused closes at once
                self._echoes.append(
                    (trig.window, time.time() - trig.created_at if trig.created_at else 0.0, offer.reason)
                )
                log.warning(
                    "refused profiling window %s starting at step %d: %s (this worker is at step %d)",
                    trig.window,
                    trig.start_step,
                    "that step has already begun" if offer.reason == "past" else "it overlaps an accepted window",
                    self._step,
                )

    def _boundary(self, step: int) -> None:
        for action, window in self._schedule.boundary(step):
            try:
                if action == "start":
                    self._start_window(window, step)
                elif action == "step":
                    self._boundaries[step] = time.time() * 1e6
                    self._profiler().step()
                elif action == "stop":
                    self._stop_window(window)
                else:  # missed
                    self._fail(
                        WindowRecord(window.name, window.start, window.trigger.steps),
                        f"step counter jumped past its start step {window.start}",
                    )
            except Exception as exc:
                log.exception("profiling window %s failed at step %d", window.name, step)
                self._abort(window, f"{type(exc).__name__}: {exc}")

    def _profiler(self) -> TorchWindow:
        """The running window's profiler; raising (the window is then aborted) when there is none."""
        if self._torch is None:
            raise RuntimeError("no profiler runs for this window (its start failed)")
        return self._torch

    def _start_window(self, window: ScheduledWindow, step: int) -> None:
        from .profiler import torch_kind

        trig = window.trigger
        self._record = WindowRecord(window.name, window.start, trig.steps)
        self._boundaries = {step: time.time() * 1e6}
        prepared, self._prepared = self._prepared, None
        sampler = prepared[1] if prepared is not None and prepared[0] == window.name else None
        if prepared is not None and sampler is None:
            prepared[1].close()
        self._sampler = (sampler or self._new_sampler(trig)).start()
        if self._kind is None:
            self._kind = torch_kind()
        self._torch = self._kind.window(trig.sampling)
        self._tcp_before = tcpdiag.snapshot()  # the training process's TCP connections as the window begins
        self._torch.start(step)

    def _new_sampler(self, trig: ProfileTrigger) -> HardwareSampler:
        hz = min(trig.sampling.hardware_hz, self.config.hardware_hz_max)
        return HardwareSampler(self.meta.rank, hz, nic=self.meta.nic, gpu_uuid=self._gpu_uuid)

    def _prepare_sampler(self, trig: ProfileTrigger) -> None:
        """Start the window's sampler process now (a vfork, ~0.3 ms), so that it is ready when the window begins."""
        if self._prepared is not None:
            self._prepared[1].close()
        self._prepared = (trig.window, self._new_sampler(trig).prepare())

    def _stop_window(self, window: ScheduledWindow) -> None:
        prof = self._profiler().stop()
        self._torch = None
        sampler, self._sampler = self._sampler, None
        sampler.halt()  # type: ignore[union-attr]
        record, boundaries = self._record, self._boundaries
        tcp = (self._tcp_before, tcpdiag.snapshot())
        self._work.put(lambda: self._summarise(prof, window.trigger, sampler, boundaries, record, tcp))  # type: ignore[arg-type]

    def _abort(self, window: ScheduledWindow, error: str) -> None:
        """Detach whatever of the window is running and count it as failed."""
        self._schedule.abort()
        if self._torch is not None:
            try:
                if self._torch.recording:
                    self._torch.stop()
            except Exception:
                log.exception("could not stop the profiler of window %s", window.name)
            self._torch = None
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._fail(self._record or WindowRecord(window.name, window.start, window.trigger.steps), error)
        self._record = None

    def _fail(self, record: WindowRecord, error: str) -> None:
        record.error = error
        self._windows.append(record)
        self._failed += 1

    # ------------------------------------------------------------------ the io thread

    def _io_tick(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for control records and route them; False if it could not wait (not connected)."""
        relay_dropped = self._relay.counters.dropped_rows if self._relay is not None else 0
        self._io_snapshot = (self._outbox.dropped + relay_dropped, len(self._outbox.spool))
        if self._link is not None:
            records: list | None = self._link.poll(timeout_s)  # waits only while the relay answers (or may soon)
            if self._link.relayed or self._link.joining:  # the relay forwards the control records: no consumer
                if self._control.connected:
                    self._control.close()
            else:  # on our own: follow the control topic too (a record seen twice is refused as a duplicate)
                more = self._control.poll(timeout_s)
                records = None if more is None and not records else [*(records or ()), *(more or ())]
        else:
            records = self._control.poll(timeout_s)
            if self._relay is not None and records:
                self._relay.fan_out(records)
        for rec in records or ():
            if isinstance(rec, ProfileTrigger):
                if rec.kind == "hang" and self._hang is not None:
                    self._answer_hang(rec)
                if rec.created_at:
                    self._echoes.append((rec.window, time.time() - rec.created_at, ""))
                self._inbox.append(rec)
            elif isinstance(rec, RawRequest) and self.meta.rank in rec.workers:
                self._work.put(partial(self._answer, rec))
        return records is not None

    def _answer_hang(self, trig: ProfileTrigger) -> None:
        """Where the training thread is (:mod:`~lockstep.producers.agent.hang`), sent at once: it may never step again."""
        try:
            report = self._hang.answer(trig, self._step - 1) if self._hang is not None else None
        except Exception:
            log.exception("could not answer hang window %s", trig.window)
            return
        if report is not None:
            self._outbox.put(self.topics.hangs, self._job_key, report)
            self._outbox.wake()
            log.info(
                "hang window %s: answered at step %d from %s%s",
                trig.window,
                report.last_step,
                report.region or report.frame or "no frame",
                f", in {report.collective} #{report.collective_seq}" if report.collective_open else "",
            )

    # ------------------------------------------------------------------ the window thread

    def _window_loop(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("agent background work failed")

    def _summarise(
        self,
        prof,
        trigger: ProfileTrigger,
        sampler: HardwareSampler,
        boundaries,
        record: WindowRecord,
        tcp: tuple[dict | None, dict | None],
    ) -> None:
        from .window import process_window

        samples, record.sampler = sampler.collect()
        try:
            outcome = process_window(
                prof,
                trigger,
                self.meta,
                samples,
                boundaries,
                sampler.source,
                self.config.redact,
                self._store,
                own_threads=self._own_threads,
                min_share=self.config.min_share,
                tenant=self.config.tenant,
                kind=self._kind,
                connections=tcpdiag.connections(self.meta.rank, *tcp),
            )
        except Exception as exc:
            log.exception("could not summarise window %s", trigger.window)
            self._fail(record, f"{type(exc).__name__}: {exc}")
            return
        if outcome.steps < trigger.steps:
            log.warning("window %s: %d of %d steps summarised", trigger.window, outcome.steps, trigger.steps)
        if outcome.record is not None:
            value = encode(outcome.record)
            self._outbox.put(
                self.topics.windowfeatures,
                window_features_key(trigger.job, trigger.window, outcome.record.shard),
                value,
            )
            self._outbox.wake()
            record.record_bytes = len(value)
        record.summarised = outcome.steps
        record.trace_bytes, record.events, record.summarise_s = outcome.trace_bytes, outcome.events, outcome.seconds
        self._windows.append(record)
        log.debug(
            "window %s: %d step(s) summarised, a %d-byte feature record from a %d-byte trace, in %.2fs; sampler %s at %.0f Hz (%.1f%% of a core)",
            trigger.window,
            record.summarised,
            record.record_bytes,
            record.trace_bytes,
            record.summarise_s,
            record.sampler.source if record.sampler else "-",
            record.sampler.hz_achieved if record.sampler else 0,
            100 * record.sampler.cpu_share if record.sampler else 0,
        )

    def _answer(self, req: RawRequest) -> None:
        from .window import answer_raw_request

        answer = answer_raw_request(
            req,
            self.meta,
            self._store,
            self.config.redact,
            self.config.raw_upload_max_bytes,
            own_threads=self._own_threads,
            tenant=self.config.tenant,
        )
        self._outbox.put(self.topics.raw, self._job_key, answer)
        self._outbox.wake()
        self._raw_answers += 1
        log.info(
            "raw request %s: sent %d bytes of window %s%s",
            req.request,
            len(answer.trace),
            answer.window or "-",
            f" ({answer.error})" if answer.error else "",
        )

    # ------------------------------------------------------------------ state and shutdown

    def report(self) -> AgentReport:
        dropped, spooled = self._outbox.dropped, len(self._outbox.spool)
        if self._relay is not None:
            dropped += self._relay.counters.dropped_rows
        counters = AgentCounters(
            dropped_records=dropped,
            spooled_records=spooled,
            refused_triggers=len(self._refused),
            failed_windows=self._failed,
        )
        return AgentReport(
            step=self._step,
            counters=counters,
            sent=self._outbox.counters.sent,
            spooled_now=spooled,
            kafka_down=self._outbox.down,
            refused=list(self._refused),
            windows=list(self._windows),
            raw_answers=self._raw_answers,
            relay_role=self.relay_role,
            handed_over=self._link.handed if self._link is not None else 0,
            relay_fallbacks=self._link.fallbacks if self._link is not None else 0,
            relayed_rows=self._relay.counters.rows_in if self._relay is not None else 0,
            kafka_producer=self._outbox.connected,
        )

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until finished windows are summarised and queued for publishing (tests, benchmarks, shutdown)."""
        done = threading.Event()
        self._work.put(done.set)
        done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop profiling, finish background work, send (or spool) what is queued.  Idempotent."""
        if self._closed or os.getpid() != self._pid:  # a forked child owns none of the threads
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._schedule.active is not None:
            self._abort(self._schedule.active, "the agent was closed during the window")
        if self._prepared is not None:
            self._prepared[1].close()
            self._prepared = None
        try:  # workers of this host that exited before this one without closing: name the first (worker_died)
            exit_report = (
                self._hang.exit_report(self.config.job, self.world_size, self._step - 1)
                if self._hang is not None
                else None
            )
        except Exception:
            log.exception("could not read this host's workers at close")
            exit_report = None
        if exit_report is not None:
            self._outbox.put(self.topics.hangs, self._job_key, exit_report)
            log.warning("worker(s) %s of this host exited before this one without closing", exit_report.exited)
        if self._step > self.config.start_step:  # tell the detector this worker ends (not a hang)
            last = self._step - 1
            self._outbox.put(self.topics.heartbeats, self._job_key, self._heartbeat(last, self._last_dt, final=True))
        self.drain(timeout_s)
        self._work.put(None)
        self._window_thread.join(timeout=timeout_s)
        if self._relay is not None:  # the host's agents send themselves from now on; what they handed over goes below
            self._relay.close()
        if self._link is not None:  # a relay that has not answered yet is waited for no longer
            self._link.leave()
        self._outbox.close(timeout_s)
        self._control.close()
        if self._link is not None:
            self._link.close()
        if self._hang is not None:
            self._hang.close()
        log.debug("lockstep agent closed at step %d", self._step)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(job: str | None = None, **settings) -> Agent:
    """Create and start the agent: ``agent = attach(job="llm-7b")``, then ``agent.step()`` every iteration.

    Settings not given here come from ``LOCKSTEP_AGENT_*`` variables, the agent's
    config file and (for Kafka) the pipeline's settings; see :class:`AgentConfig`.
    In a process that imported JAX and not torch, windows are ``jax.profiler``'s
    (:func:`attach_jax`).
    """
    from .settings import load

    if "jax" in sys.modules and "torch" not in sys.modules:  # a JAX program: windows by jax.profiler
        return attach_jax(job, **settings)
    return Agent(load({"job": job, **settings}))


def attach_jax(job: str | None = None, **settings: Any) -> Agent:
    """The agent for a JAX training loop: ``agent = attach_jax(job="llm-7b")``, then ``agent.step()`` every
    iteration (:func:`attach` does the same in a process that imported JAX and not torch)."""
    from .jaxprof import jax_identity, jax_kind
    from .settings import load

    config = load(jax_identity({"job": job, **settings}))
    return Agent(config, identity=discover(config), profiler=jax_kind())
