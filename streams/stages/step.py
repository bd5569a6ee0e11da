"""The step stage: feature batches (key ``job:step``) -> one ``StepReport`` per step (key ``job``).

:class:`~lockstep.streams.windows.StepAssembler` collects a step's batches until every expected
worker reported (or the step timed out); the stage then checks the function tables of the whole step
at once (``ft.check_tables``: the refused ones go to the dead-letter topic, the step goes on
without them), runs :func:`analyze_step` and publishes the report.  A step's input records are
acknowledged only once its report is sent, in offset order per partition (:class:`InOrderAcks`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas import functions as ft
from ...schemas.records import FeatureBatch, RecordError, decode, encode
from ..diagnosis import StepFrame, analyze_step, step_report
from ..windows import ClosedStep, StepAssembler
from .base import Clock, HoldingStage, Output, Partition, Policies, RecordIn


class StepStage(HoldingStage):
    """``topics.features`` -> :class:`StepAssembler` + :func:`analyze_step` -> ``topics.stepreports``."""

    name = "steps"

    def __init__(
        self,
        topics: Topics,
        out: Output,
        policies: Policies,
        metrics: Metrics,
        timeout_s: float,
        clock: Clock = time.time,
    ):
        super().__init__(topics, out, metrics, clock)
        self.policies = policies
        self.assembler: StepAssembler[RecordIn] = StepAssembler(timeout_s)

    @property
    def open_steps(self) -> int:
        return self.assembler.open_steps

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        for record in records:
            await self._one(record)
        self.metrics.set("open_steps", self.assembler.open_steps)

    async def _one(self, record: RecordIn) -> None:
        h = self.hold(record)
        try:
            batch = decode(record.value, FeatureBatch)
            table = ft.read(batch.functions, batch.functions_codec)  # values: checked per step (_finish)
            closed, late = self.assembler.add(batch, table, len(record.value), h, self.clock())
        except RecordError as err:
            await self.dead_letter(record, err)
            await self.release([h])
            return
        except Exception as exc:  # a bug, not bad input: the record must not stop the stage (again after every restart)
            await self.failed([record], exc)
            await self.release([h])
            return
        if late:
            self.metrics.inc("late_records_total", stage=self.name, help="records for steps or windows already closed")
            await self.release([h])
        elif closed:
            await self._finish(closed)

    async def on_timer(self, now: float) -> None:
        """Steps that waited ``timeout_s`` for their last workers close without them."""
        for closed in self.assembler.expire(now):
            await self._finish(closed)

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        self.assembler.drop(partitions)
        self.acks.drop(partitions)

    async def _finish(self, closed: ClosedStep[RecordIn]) -> None:
        p = closed.pending
        m = self.metrics
        t0 = time.perf_counter()
        entries = [p.batches[r] for r in sorted(p.batches)] + p.replaced
        report = None
        try:
            # the function tables' values, for the whole step at once (ft.read left them unchecked)
            errors = ft.check_tables([table for _, table, _ in entries])
            good = [e for e, err in zip(entries[: len(p.batches)], errors) if err is None]
            if good:
                recs = [b for b, _, _ in good]
                diagnosis = self.policies.for_ref(p.policy).diagnosis
                frame = StepFrame.from_tables(
                    p.job,
                    p.window,
                    p.step,
                    [b.worker for b in recs],
                    [b.step_time_us for b in recs],
                    [table for _, table, _ in good],
                    diagnosis.peer_group_keys,
                    [b.hardware for b in recs],
                )
                report = encode(
                    step_report(
                        analyze_step(frame, diagnosis),
                        window_start=p.window_start,
                        window_steps=p.window_steps,
                        expected_workers=p.expected_workers,
                        bytes_in=p.bytes_in,
                        policy=p.policy,
                        tenant=p.tenant,
                        closed=closed.reason,
                    )
                )
        except Exception as exc:
            await self.failed([h.item for h in p.handles], exc)
            await self.release(p.handles)
            return
        for (_, _, handle), err in zip(entries, errors):
            if err is not None:
                await self.dead_letter(handle.item, err)
        if report is not None:
            await self.send(self.topics.stepreports, p.job, report)
            m.inc("steps_closed_total", reason=closed.reason, help="steps closed, by reason")
            m.set("step_analysis_seconds", time.perf_counter() - t0, help="time of the last step analysis")
            m.observe(
                "step_close_latency_seconds",
                self.clock() - p.opened_at,
                help="first feature batch of a step to its step report",
            )
        await self.release(p.handles)
