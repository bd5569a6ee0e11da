"""The detect stage: the shards' step partials (and the detector's own ticks, operators' requests) -> triggers on control.

Around the pure :class:`~lockstep.streams.detector.SlowdownDetector` it keeps what the processor
needs: each job's last window in the ``detector`` table (``"start,end"``: the cool-down survives
restarts), the jobs of each partition (dropped when the partition goes), the step-time series for
the pictures (:class:`~lockstep.streams.pictures.SeriesBuilder`), and the hang check: no heartbeat
arrives during a hang, so the timer sends a ``DetectorTick`` into the job's own partition and the
check happens in order with the partials, where the table can be written.  It reads the partials
topic (key ``job``: a job's partials, ticks and requests meet in one partition), which the heartbeat
stage fills from the heartbeats of every shard of the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, MutableMapping, Sequence

from ...kafka import Topics
from ...metrics import Metrics
from ...schemas.records import (
    DetectorTick,
    JobChange,
    ProfileTrigger,
    RecordError,
    StepPartial,
    TriggerRefused,
    TriggerRequest,
    WindowExpected,
    WindowRefused,
    decode,
)
from ..detector import STEP_LATENESS_S, STEP_LATENESS_STEPS, WINDOW_EXPIRY_MIN_S, SlowdownDetector
from ..pictures import SeriesBuilder
from ..policy import Policy
from .base import Clock, Output, Partition, RecordIn, Stage

log = logging.getLogger("lockstep.processor")

#: the host agents' counters (AgentCounters, carried by heartbeats) exported per job as lockstep_agent_<name>
#: (their help in lockstep.metrics.CATALOGUE)
AGENT_COUNTERS = ("dropped_records", "spooled_records", "refused_triggers", "failed_windows")


#: per-job metric series: at most this many jobs each (the largest values), the rest summed as one series
TOP_JOBS = 50
OTHER_JOBS = "(other)"


def top_jobs(values: dict[str, float], k: int = TOP_JOBS) -> dict[tuple[tuple[str, str], ...], float]:
    """A per-job gauge's series, bounded in number: the ``k`` jobs of largest non-zero value, and the others' sum as
    ``job="(other)"`` (a scrape of 100,000 jobs' series was 101.6 MB and took 4 s).  Jobs at zero have no series."""
    nonzero = sorted(((v, j) for j, v in values.items() if v), reverse=True)
    out: dict[tuple[tuple[str, str], ...], float] = {(("job", j),): v for v, j in nonzero[:k]}
    if len(nonzero) > k:
        out[(("job", OTHER_JOBS),)] = sum(v for v, _ in nonzero[k:])
    return out


class DetectStage(Stage):
    """``topics.partials`` -> :class:`SlowdownDetector` -> ``topics.control`` (and ``StepSeries``, ``JobChange`` ->
    ``topics.series``; each trigger's ``WindowExpected``, and a ``WindowRefused`` for each window every worker
    refused, -> ``topics.stepreports``)."""

    name = "detect"

    def __init__(
        self,
        topics: Topics,
        out: Output,
        table: MutableMapping[str, str],
        policy: Policy,
        metrics: Metrics,
        clock: Clock = time.time,
        lateness_s: float = STEP_LATENESS_S,
        lateness_steps: int = STEP_LATENESS_STEPS,
    ):
        super().__init__(topics, out, metrics, clock)
        self.table = table  # job -> "start,end" of its last window
        self.detector = SlowdownDetector(policy, lateness_s, lateness_steps)
        self.series = SeriesBuilder()
        self.job_partition: dict[str, Partition] = {}  # job -> the partials partition it was seen on

    def set_policy(self, policy: Policy) -> None:
        self.detector.set_policy(policy)

    async def on_records(self, records: Sequence[RecordIn]) -> None:
        for record in records:
            try:
                decisions = self._decide(record)
            except RecordError as err:
                await self.dead_letter(record, err)
                continue
            except Exception as exc:
                await self.failed([record], exc)
                continue
            for decision in decisions:
                await self._decided(decision)
            await self._changes(self.detector.take_changes())
            await self._refused(self.detector.take_refused())
        await self.out.acknowledge(records)  # each record is done once it has been processed

    def _decide(self, record: RecordIn) -> Sequence[ProfileTrigger | TriggerRefused]:
        rec = decode(record.value, (StepPartial, DetectorTick, TriggerRequest))
        self.job_partition[rec.job] = record.source
        now = self.clock()
        if rec.job not in self.detector.jobs and rec.job in self.table:
            last_start, last_end = map(int, self.table[rec.job].split(","))
            self.detector.restore(rec.job, last_start, last_end, now)
        if isinstance(rec, StepPartial):
            decisions = self.detector.observe_partial(rec, now)  # raises RecordError('from_the_future')
            self.series.add_partial(rec, now)
            return decisions
        if isinstance(rec, DetectorTick):
            return self.detector.tick(rec.job, now)
        return [self.detector.request(rec, now)]

    async def _decided(self, decision: ProfileTrigger | TriggerRefused) -> None:
        m = self.metrics
        if isinstance(decision, ProfileTrigger):
            self.table[decision.job] = f"{decision.start_step},{decision.start_step + decision.steps}"
            log.info(
                "trigger %s/%s (%s) at step %d for %d steps: %s",
                decision.job,
                decision.window,
                decision.kind,
                decision.start_step,
                decision.steps,
                decision.reason,
            )
            m.inc("triggers_total", kind=decision.kind)
            # the window stage opens the window now, so that it ends in a report even if no step report ever comes
            await self.send(self.topics.stepreports, decision.job, self._expected(decision))
        else:
            log.info("refused a window for %s (request %s): %s", decision.job, decision.request, decision.reason)
            m.inc("trigger_refusals_total", code=decision.code)
        await self.send(self.topics.control, decision.job, decision)

    async def _changes(self, changes: Sequence[JobChange]) -> None:
        """The detector's news for the sink's incidents (a slowdown profiled, recovered; a job ended) -> ``topics.series``."""
        for ch in changes:
            log.info("job %s: %s", ch.job, ch.reason)
            self.metrics.inc(
                "job_changes_total",
                change=ch.change,
            )
            await self.send(self.topics.series, ch.job, ch)

    async def _refused(self, refused: Sequence[WindowRefused]) -> None:
        """Windows every worker refused -> ``topics.stepreports`` (the window stage closes each at once, ``failed``)."""
        for r in refused:
            log.warning(
                "window %s/%s: every one of its %d workers refused the trigger (%s)%s",
                r.job,
                r.window,
                r.expected_workers,
                ", ".join(f"{n} {why}" for why, n in r.reasons.items()),
                "; the slowdown asks again without the cool-down" if r.retry else "",
            )
            self.metrics.inc("windows_refused_total", retry="yes" if r.retry else "no")
            await self.send(self.topics.stepreports, r.job, r)

    def _expected(self, t: ProfileTrigger) -> WindowExpected:
        """The window stage's notice of a trigger, with the detector's own deadline for the window (by then its
        workers should have profiled every step: a few times the window's expected duration, at least a minute)."""
        st = self.detector.jobs.get(t.job)
        opened = next((w for w in st.windows if w.name == t.window), None) if st is not None else None
        deadline = opened.expires_at if opened is not None else t.created_at + WINDOW_EXPIRY_MIN_S
        return WindowExpected(
            job=t.job,
            window=t.window,
            start_step=t.start_step,
            steps=t.steps,
            expected_workers=t.expected_workers,
            kind=t.kind,
            policy=t.policy_ref,
            tenant=t.tenant,
            created_at=t.created_at,
            deadline=max(deadline, t.created_at),
        )

    async def on_timer(self, now: float) -> None:
        """Hang checks (a tick into each due job's partition: a timer cannot write the table), idle jobs
        forgotten, the step-time series published, the detector's gauges."""
        m = self.metrics
        for job in self.detector.due_ticks(now):
            await self.send(self.topics.partials, job, DetectorTick(job=job, at=now))
        await self._changes(self.detector.due_endings(now))
        for job in self.detector.forget_idle(now):
            self.job_partition.pop(job, None)
            self.series.drop([job])
        for rec in self.series.due(now):
            await self.send(self.topics.series, rec.job, rec)
            m.inc("step_series_points_total", len(rec.steps))
        for code, n in self.detector.suppressed.items():
            m.set(
                "triggers_suppressed",
                n,
                code=code,
            )
        m.set("detector_jobs", len(self.detector.jobs))
        m.set("detector_open_windows", self.detector.open_windows(now))
        counters = self.detector.agent_counters()
        for name in AGENT_COUNTERS:
            m.replace(
                f"agent_{name}",
                top_jobs({job: getattr(c, name) for job, c in counters.items()}),
            )

    def on_revoked(self, partitions: Collection[Partition]) -> None:
        gone = [job for job, p in self.job_partition.items() if p in partitions]
        self.detector.drop(gone)
        self.series.drop(gone)
        for job in gone:
            del self.job_partition[job]
