"""The window stage: step reports (key ``job``) -> findings, the window's report and its deviation map.

:class:`~lockstep.streams.windows.WindowAssembler` collects a window's step reports until every
step reported; a window that waits too long is closed by a ``WindowTimeout`` that the timer sends
into the window's own partition (the close writes tables, which only the input stream may).  Two
tables: ``closed_windows`` (``job:window`` -> when it closed) makes a replay that holds only part of
a closed window be dropped instead of diagnosed again, and is written only once the window's
findings and report are acknowledged by Kafka (a crash in between must not skip a window whose
findings were lost); ``job_history`` keeps each job's baseline of healthy windows
(:class:`JobHistory` JSON) for the job-wide regression check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, MutableMapping, Sequence

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import MAX_NAMED_MISSING, RecordError, StepReport, WindowTimeout, decode, encode
from ..diagnosis import HistoryError, JobHistory, WindowInfo, diagnose_window, step_result
from ..pictures import deviation_map
from ..windows import ClosedWindow, WindowAssembler
from .base import Clock, HoldingStage, Output, Partition, Policies, RecordIn

log = logging.getLogger("lockstep.processor")


class WindowStage(HoldingStage):
    """``topics.stepreports`` -> :class:`WindowAssembler` + :func:`diagnose_window` -> ``topics.findings``,
    ``topics.windows`` (and the ``DeviationMap`` -> ``topics.series``)."""

    name = "windows"

    def __init__(
        self,
        topics: Topics,
        out: Output,
        closed_windows: MutableMapping[str, float],
        job_history: MutableMapping[str, str],
        policies: Policies,
        metrics: Metrics,
        timeout_s: float,
        clock: Clock = time.time,
    ):
        super().__init__(topics, out, metrics, clock)
        self.closed_windows = closed_windows  # "job:window" -> when it closed
        self.job_history = job_history  # job -> JobHistory JSON
        self.policies = policies
        self.assembler: WindowAssembler[RecordIn] = WindowAssembler(timeout_s)

    @property
    def open_windows(self) -> int:
        return self.assembler.open_windows

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        for record in records:
            await self._one(record)
        self.metrics.set("open_windows", self.assembler.open_windows, help="windows waiting for step reports")

    async def _one(self, record: RecordIn) -> None:
        h = self.hold(record)
        try:
            rec = decode(record.value, (StepReport, WindowTimeout))
            if f"{rec.job}:{rec.window}" in self.closed_windows:
                self.metrics.inc("late_records_total", stage=self.name)
                await self.release([h])
                return
            if isinstance(rec, WindowTimeout):
                key = (rec.job, rec.window)
                if not self.assembler.hold(key, h):
                    await self.release([h])
                    return
                closed = self.assembler.close(key, "timeout")
            else:
                closed = self.assembler.add(rec, step_result(rec), h, self.clock())
        except RecordError as err:
            await self.dead_letter(record, err)
            await self.release([h])
            return
        except Exception as exc:  # a bug, not bad input: the record must not stop the stage (again after every restart)
            await self.failed([record], exc)
            await self.release([h])
            return
        if closed:
            await self._finish(closed)

    async def on_timer(self, now: float) -> None:
        """Windows past their timeout: a ``WindowTimeout`` into the window's partition closes them there."""
        for job, window in self.assembler.due(now):
            await self.send(self.topics.stepreports, job, WindowTimeout(job=job, window=window))

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        self.assembler.drop(partitions)
        self.acks.drop(partitions)

    def _history(self, job: str) -> JobHistory | None:
        if job not in self.job_history:
            return None
        try:
            return JobHistory.decode(self.job_history[job])
        except HistoryError as err:
            log.warning("job %s: dropping its stored history: %s", job, err)
            return None

    async def _finish(self, closed: ClosedWindow[RecordIn]) -> None:
        w = closed.pending
        m = self.metrics
        now = self.clock()
        policy = self.policies.for_ref(w.policy)
        info = WindowInfo(
            job=w.job,
            window=w.window,
            start_step=w.window_start,
            steps=w.window_steps,
            expected_workers=w.expected_workers,
            tenant=w.tenant,
            policy=policy.ref,
        )
        history = self._history(w.job)
        try:
            diagnosis = diagnose_window(
                info,
                list(w.results.values()),
                policy,
                now=now,
                closed=closed.reason,
                bytes_in=w.bytes_in,
                history=history,
            )
            new_history = (
                diagnosis.history.encode()
                if diagnosis.history is not None and diagnosis.history is not history
                else None
            )
            out = [(f.cause, encode(f)) for f in diagnosis.findings]
            diagnosis.report.missing_workers = sorted(w.missing)[:MAX_NAMED_MISSING]
            diagnosis.report.missing_total = max(w.missing_total, len(w.missing))
            report = encode(diagnosis.report)
        except Exception as exc:
            await self.failed([h.item for h in w.handles], exc)
            await self.release(w.handles)
            return
        sent: list[Awaitable[object]] = []
        for cause, value in out:
            sent.append(await self.send(self.topics.findings, w.job, value))
            m.inc("findings_total", cause=cause, help="findings published, by cause")
        sent.append(await self.send(self.topics.windows, w.job, report))
        # the tables' changelogs travel apart from the findings: mark the window closed (which makes a replay
        # skip it) only once its findings and report are in Kafka, or a crash in between would lose them
        await asyncio.gather(*sent)
        try:  # the window's heatmap: for people, so it must never hold up the window
            dmap = deviation_map(
                w.job, w.window, w.tenant, w.window_start, w.window_steps, list(w.results.values()), now
            )
            await self.send(self.topics.series, w.job, dmap)
        except Exception:
            log.exception("window %s/%s: no deviation map", w.job, w.window)
        if new_history is not None:
            self.job_history[w.job] = new_history
        self.closed_windows[f"{w.job}:{w.window}"] = now
        m.inc("windows_closed_total", reason=closed.reason, help="windows closed, by reason")
        m.observe(
            "window_close_latency_seconds",
            self.clock() - w.opened_at,
            help="first step report of a window to its findings published",
        )
        log.info(
            "window %s/%s closed (%s): %d finding(s), coverage %.2f%s",
            w.job,
            w.window,
            closed.reason,
            len(diagnosis.findings),
            diagnosis.report.coverage,
            f", {diagnosis.report.missing_total} expected worker(s) missing: {diagnosis.report.missing_workers}"
            if diagnosis.report.missing_total
            else "",
        )
        await self.release(w.handles)
