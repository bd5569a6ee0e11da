"""The window stage: step reports (key ``job``) -> findings, the window's report and its deviation map.

:class:`~lockstep.streams.windows.WindowAssembler` collects a window's step reports until every
step reported; a window that waits too long is closed by a ``WindowTimeout`` that the timer sends
into the window's own partition (the close writes tables, which only the input stream may).  Every
trigger ends in a ``WindowReport`` with a terminal state (:data:`~lockstep.schemas.records.Closed`):
the detect stage announces each window it triggers (``WindowExpected``), so a window whose step
reports never come closes ``failed`` at its deadline, or at once when every expected worker refused its
trigger (``WindowRefused``, from the detector's count of the agents' echoed refusals); a step report whose tables cannot be read is
dead-lettered and counted as reported, and its window closes ``failed`` with the reason while the
other steps still give their findings; a bug in the diagnosis closes the window ``failed`` too (its
records go to the dead letters, to be replayed once the bug is fixed).  Two
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
from collections.abc import Awaitable, MutableMapping

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import (
    MAX_NAMED_MISSING,
    Closed,
    RecordError,
    StepReport,
    WindowExpected,
    WindowRefused,
    WindowTimeout,
    decode,
    encode,
)
from ..diagnosis import HistoryError, JobHistory, WindowInfo, diagnose_window, step_result, window_report
from ..pictures import deviation_map
from ..windows import ClosedWindow, Handle, PendingWindow, WindowAssembler
from .base import AssemblingStage, Clock, Output, Policies, RecordIn

log = logging.getLogger("lockstep.processor")

#: an agent's refusal of a trigger (``Echo.refused``), for people
REFUSALS = {
    "past": "the window's first step had begun when the trigger reached the worker",
    "overlap": "it overlapped a window the worker had accepted",
}


class WindowStage(AssemblingStage[ClosedWindow[RecordIn]]):
    """``topics.stepreports`` -> :class:`WindowAssembler` + :func:`diagnose_window` -> ``topics.findings``,
    ``topics.windows`` (and the ``DeviationMap`` -> ``topics.series``)."""

    name = "windows"
    assembler_class = WindowAssembler
    assembler: WindowAssembler[RecordIn]
    open_gauge = "open_windows"

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
        super().__init__(topics, out, policies, metrics, timeout_s, clock)
        self.closed_windows = closed_windows  # "job:window" -> when it closed
        self.job_history = job_history  # job -> JobHistory JSON

    async def _add(self, record: RecordIn, h: Handle[RecordIn]) -> tuple[ClosedWindow[RecordIn] | None, bool]:
        """A step report into its window, a trigger's notice opens one, a timeout request closes one; a record of a
        window closed already is late.  A timeout request for a window not open is released (nothing to close)."""
        rec = decode(record.value, (StepReport, WindowTimeout, WindowExpected, WindowRefused))
        if f"{rec.job}:{rec.window}" in self.closed_windows:
            return None, True
        if isinstance(rec, WindowRefused):  # every worker refused its trigger: close it now, not at its deadline
            key = (rec.job, rec.window)
            if not self.assembler.hold(key, h):
                await self.release([h])
                return None, False
            return self.assembler.refuse(key, rec.reasons), False
        if isinstance(rec, WindowTimeout):
            key = (rec.job, rec.window)
            if not self.assembler.hold(key, h):
                await self.release([h])
                return None, False
            return self.assembler.close(key, "timeout"), False
        if isinstance(rec, WindowExpected):
            self.assembler.expect(rec, h, self.clock())
            return None, False
        return await self._add_report(record, rec, h), False

    async def _add_report(
        self, record: RecordIn, rec: StepReport, h: Handle[RecordIn]
    ) -> ClosedWindow[RecordIn] | None:
        """A step report into its window; one whose tables cannot be read goes to the dead letters (for people to
        read) and still counts for its window, which then closes ``failed`` with the reason instead of vanishing."""
        try:
            result = step_result(rec)
        except RecordError as err:
            await self.dead_letter(record, err)
            return self.assembler.add_invalid(rec, str(err), h, self.clock())
        return self.assembler.add(rec, result, h, self.clock())

    async def on_timer(self, now: float) -> None:
        """Windows past their timeout: a ``WindowTimeout`` into the window's partition closes them there."""
        for job, window in self.assembler.due(now):
            await self.send(self.topics.stepreports, job, WindowTimeout(job=job, window=window))

    def _history(self, job: str) -> JobHistory | None:
        if job not in self.job_history:
            return None
        try:
            return JobHistory.decode(self.job_history[job])
        except HistoryError as err:
            log.warning("job %s: dropping its stored history: %s", job, err)
            return None

    def _terminal(self, closed: ClosedWindow[RecordIn]) -> tuple[Closed, str]:
        """How the window ended, and why (for people) unless it is complete."""
        w = closed.pending
        invalid = {s: why for s, why in w.invalid.items() if s not in w.results}  # a good twin supersedes it
        if invalid:
            step, why = min(invalid.items())
            return "failed", (
                f"{len(invalid)} of {w.window_steps} step reports unreadable (step {step}: {why}); "
                f"findings from the {len(w.results)} others"
            )
        if w.refused:
            why = ", ".join(
                f"{n} {reason}{f' ({REFUSALS[reason]})' if reason in REFUSALS else ''}"
                for reason, n in w.refused.items()
            )
            return "failed", (
                f"every one of the {w.expected_workers} expected workers refused the trigger: {why}; closed at once, "
                "not at the trigger's deadline"
            )
        if not w.results:
            return "failed", (
                f"no step report by the trigger's deadline (+{self.assembler.timeout_s:g} s): the workers did not "
                "profile the window, or their features were lost or refused (see the agents' failed and refused "
                "windows, and the dead letters)"
            )
        if closed.reason == "budget":
            return "timeout", (
                f"closed early with {len(w.results)} of {w.window_steps} steps: the processor's open windows held more "
                f"than its stage budget ({self.budget_bytes >> 20} MiB of step results; stage_budget_mib)"
            )
        if closed.reason == "timeout":
            return "timeout", (
                f"{len(w.results)} of {w.window_steps} steps reported within {self.assembler.timeout_s:g} s "
                "of the first"
            )
        if w.missing_total:  # every step reported, but without some of the expected workers: they were waited for
            named = sorted(w.missing)[:8]
            who = f" ({', '.join(map(str, named))}{', ...' if len(w.missing) > len(named) else ''})" if named else ""
            return "timeout", (
                f"{max(w.missing_total, len(w.missing))} of {w.expected_workers} expected workers delivered nothing for "
                f"some steps{who}: they refused the trigger (see the agents' refused triggers), were late, or failed"
            )
        return "complete", ""

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
        state, why = self._terminal(closed)
        history = self._history(w.job)
        try:
            diagnosis = diagnose_window(
                info,
                list(w.results.values()),
                policy,
                now=now,
                closed=state,
                closed_reason=why,
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
            await self._diagnosis_failed(w, info, exc)
            return
        sent: list[Awaitable[object]] = []
        for cause, value in out:
            sent.append(await self.send(self.topics.findings, w.job, value))
            m.inc("findings_total", cause=cause)
        sent.append(await self.send(self.topics.windows, w.job, report))
        # the tables' changelogs travel apart from the findings: mark the window closed (which makes a replay
        # skip it) only once its findings and report are in Kafka, or a crash in between would lose them
        await asyncio.gather(*sent)
        if w.results:
            try:  # the window's heatmap: for people, so it must never hold up the window
                dmap = deviation_map(
                    w.job,
                    w.window,
                    w.tenant,
                    w.window_start,
                    w.window_steps,
                    list(w.results.values()),
                    now,
                    policy=policy.diagnosis,
                )
                await self.send(self.topics.series, w.job, dmap)
            except Exception:
                log.exception("window %s/%s: no deviation map", w.job, w.window)
        if new_history is not None:
            self.job_history[w.job] = new_history
        self.closed_windows[f"{w.job}:{w.window}"] = now
        m.inc("windows_closed_total", reason=state)
        if w.first_report_at is not None:
            m.observe(
                "window_close_latency_seconds",
                self.clock() - w.first_report_at,
            )
        (log.warning if state == "failed" else log.info)(
            "window %s/%s closed (%s%s): %d finding(s), coverage %.2f",
            w.job,
            w.window,
            state,
            f": {why}" if why else "",
            len(diagnosis.findings),
            diagnosis.report.coverage,
        )
        await self.release(w.handles)

    async def _diagnosis_failed(self, w: PendingWindow[RecordIn], info: WindowInfo, exc: Exception) -> None:
        """A bug in the diagnosis: the window's records go to the dead letters (to be replayed once it is fixed, so the
        window is not marked closed), and the window still ends visibly, ``failed`` with the exception."""
        await self.failed([h.item for h in w.handles], exc)
        try:
            report = window_report(
                info,
                list(w.results.values()),
                self.policies.for_ref(w.policy),
                now=self.clock(),
                closed="failed",
                closed_reason=f"the diagnosis failed ({type(exc).__name__}: {exc}); its step reports are in the dead letters",
                bytes_in=w.bytes_in,
            )
            await (await self.send(self.topics.windows, w.job, report))
            self.metrics.inc("windows_closed_total", reason="failed")
        except Exception:
            log.exception("window %s/%s: no report of its failure either", w.job, w.window)
        await self.release(w.handles)
