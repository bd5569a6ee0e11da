"""The processor without faust: its stages (heartbeats, detect, shards, steps, windows, hangs) and what they share
(metrics, policies, tables)."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from ...kafka import Topics
from ...metrics import Metrics
from ..heartbeats import LATENESS_S, LATENESS_STEPS
from ..policy import Policy
from .base import STAGE_BUDGET_BYTES, Clock, Output, Policies, Stage
from .detect import DetectStage
from .hang import HangStage
from .heartbeat import HeartbeatStage
from .shard import ShardStage
from .step import StepStage
from .window import WindowStage


@dataclass
class Tables:
    """The state that outlives a processor: faust tables (changelog-backed) in the adapter, dicts in memory."""

    closed_windows: MutableMapping[str, float] = field(default_factory=dict)  # "job:window" -> when it closed
    detector: MutableMapping[str, str] = field(default_factory=dict)  # job -> "start,end" of its last window
    job_history: MutableMapping[str, str] = field(default_factory=dict)  # job -> JobHistory JSON


class Processor:
    """The heartbeat, detect, shard, step, window and hang stages over one Output, and the process's health (set by the adapter)."""

    def __init__(
        self,
        policy: Policy,
        topics: Topics,
        out: Output,
        tables: Tables,
        *,
        step_timeout_s: float,
        window_timeout_s: float,
        heartbeat_lateness_s: float = LATENESS_S,
        heartbeat_lateness_steps: int = LATENESS_STEPS,
        stage_budget_bytes: int = STAGE_BUDGET_BYTES,
        metrics: Metrics | None = None,
        clock: Clock = time.time,
    ):
        self.metrics = metrics if metrics is not None else Metrics()
        self.policies = Policies(policy, self.metrics)
        self.heartbeats = HeartbeatStage(
            topics, out, self.metrics, clock, lateness_s=heartbeat_lateness_s, lateness_steps=heartbeat_lateness_steps
        )
        # a step's shards' partials may each have waited the heartbeat stage's bound: the detector waits twice as long
        self.detect = DetectStage(
            topics,
            out,
            tables.detector,
            policy,
            self.metrics,
            clock,
            lateness_s=2.0 * heartbeat_lateness_s,
            lateness_steps=heartbeat_lateness_steps,
        )
        self.shards = ShardStage(topics, out, self.policies, self.metrics, step_timeout_s, clock)
        self.steps = StepStage(topics, out, self.policies, self.metrics, step_timeout_s, clock)
        self.windows = WindowStage(
            topics, out, tables.closed_windows, tables.job_history, self.policies, self.metrics, window_timeout_s, clock
        )
        self.hangs = HangStage(topics, out, self.metrics, clock)  # agents' answers to hang triggers -> findings
        self.stages: tuple[Stage, ...] = (
            self.heartbeats,
            self.detect,
            self.shards,
            self.steps,
            self.windows,
            self.hangs,
        )
        # each stage that holds open units holds at most this many bytes of them (the ``stage_budget_mib`` setting)
        for stage in (self.heartbeats, self.shards, self.steps, self.windows):
            stage.budget_bytes = stage_budget_bytes
        self.assigned = False  # partitions were assigned once (/healthz: ok)
        self.crashed: dict[str, str] = {}  # agent -> why it died (/healthz: failed)

    def set_policy(self, policy: Policy) -> None:
        """The policy in force for new windows: the detector's and the diagnosis'."""
        self.policies.set(policy)
        self.detect.set_policy(policy)
