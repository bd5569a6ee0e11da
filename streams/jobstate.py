"""What the detector keeps of each job it follows: its steps, shards, windows and what the sink's incidents need.

Plain data; the detector (:mod:`~lockstep.streams.detector`) changes it, window admission
(:mod:`~lockstep.streams.admission`) reads it and records the windows it opens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..schemas.records import AgentCounters
from .change import Alarm, StepTimeChange


@dataclass(slots=True)
class StepAgg:
    opened_at: float  # processor clock at its first partial
    slowest_s: float = 0.0
    workers: int = 0
    shards: set[tuple[int, int]] = field(default_factory=set)  # (shard, partition) of the partials counted


@dataclass(slots=True)
class ShardView:
    """What the detector last heard from one shard (one worker's, through ``observe``)."""

    step: int = -1  # the last step it reported ...
    workers: int = 0  # ... how many workers reported it ...
    missing: list[int] = field(default_factory=list)  # ... and which of its workers were behind it (the first)
    missing_total: int = 0
    highest: int = -1  # the highest step it has seen
    members: int = 0  # the workers it expects (its membership, as its last partial said)
    heard_at: float = 0.0  # processor clock at its last partial


@dataclass
class OpenedWindow:
    name: str
    start: int
    end: int  # first step after the window
    expires_at: float  # processor clock
    expected: int = 0  # the workers its trigger expects (0: restored from the table, not known)
    kind: str = ""  # what opened it (ProfileTrigger.kind)
    refusals: dict[int, str] = field(default_factory=dict)  # worker -> why its agent refused the trigger (echoed)
    refused: bool = False  # every expected worker refused: closed at once (WindowRefused)


@dataclass(slots=True)
class IncidentWatch:
    """What the detector follows of a job for the sink's incidents (:class:`JobChange`): the slowdown a window was opened
    for, until its step time is back at the level before it, and the final heartbeats, until the job has ended."""

    window: str = ""  # the window opened for the slowdown watched ("" none) ...
    onset_step: int = -1  # ... where it began ...
    onset_at: float = 0.0
    before_s: float = 0.0  # ... the median step time before it ...
    during_s: float = 0.0  # ... and its level
    from_step: int = -1  # the highest step when the window was opened: the steps after it are judged
    since: deque[float] = field(default_factory=deque)  # step times completed since the window was opened (the latest)
    finals: int = 0  # final heartbeats heard since the job's highest step last advanced ...
    finals_step: int = -1  # ... that step ...
    final_at: float = 0.0  # ... and when the first of them came (processor clock)
    ended_step: int = -1  # the highest step when the job's end was last reported
    retries: int = 0  # windows every worker refused, asked again for this slowdown without the cool-down ...
    widen: int = 0  # ... and how many of them were refused as ``past``: the margin doubles for each
    refused_start: int = -1  # the first step of the last of them: the next window starts after it (its own name)
    asking_again: bool = False  # the next window for it is such a retry: the sink heard of this slowdown already


@dataclass(slots=True)
class JobState:
    job: str
    tenant: str = ""
    selected: bool = True  # by the policy's job selectors
    steps: dict[int, StepAgg] = field(default_factory=dict)  # steps not yet complete
    history: deque[float] = field(
        default_factory=lambda: deque(maxlen=512)
    )  # synchronised step times (s) of complete steps
    change: StepTimeChange = field(default_factory=StepTimeChange)  # the cusum rule's state
    alarm: Alarm | None = None  # what the cusum rule said after the last complete step
    profiled: tuple[int, float, int] | None = (
        None  # the slowdown a window was opened for: (excursion, level, step its cool-down ends)
    )
    world_size: int = 0  # workers in the job as its agents report it (0: not reported)
    born: float = 0.0  # processor clock when the detector first heard of the job (or of its restart)
    live_shards: int = 0  # shards heard from lately, when a step last opened
    expected: int = 0  # workers a step waits for before it is complete: the job's membership (:meth:`SlowdownDetector.members <lockstep.streams.detector.SlowdownDetector.members>`)
    shards: dict[tuple[int, int], ShardView] = field(default_factory=dict)  # (shard, partition) -> what it last said
    sent_at: dict[int, float] = field(default_factory=dict)  # step -> clock worker's sent_at (one host's clock)
    clock_key: tuple[int, int] | None = None  # the shard whose clock worker keeps the job's pace ...
    clock_worker: int | None = None  # ... and that worker
    newest_sent_at: float = 0.0
    max_step: int = -1
    first_step: int = -1  # the first step judged: a job that never had a window counts from here
    baseline_after: int = -1  # no baseline window is asked for before this step (backs off after a refusal)
    last_complete: int = -1
    lag_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=64)
    )  # heartbeat arrival lag, processor clock - worker clock
    last_progress_at: float = 0.0  # processor clock when max_step last advanced
    last_seen_at: float = 0.0
    ended: bool = False  # a worker sent its final heartbeat and nothing progressed since
    hang_step: int = -1  # max_step at which a hang window was triggered
    tick_at: float = 0.0  # last hang check requested
    tick_step: int = -1  # the open step a tick was last requested for (it waited the lateness bound)
    windows: list[OpenedWindow] = field(default_factory=list)  # open ones and the last closed one
    trigger_latency_s: dict[str, float] = field(default_factory=dict)  # window -> slowest echoed receipt
    agents: dict[tuple[int, int], AgentCounters] = field(
        default_factory=dict
    )  # shard -> its agents' last counters (sent on change)
    watch: IncidentWatch = field(default_factory=IncidentWatch)  # what the sink's incidents need to hear
