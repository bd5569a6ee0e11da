"""Run a simulated fleet live against Kafka, behaving like the real agents.

Every step it publishes the workers' heartbeats, as hosts with a relay do: one ``HeartbeatBatch`` per host
(its workers of one shard), keyed ``job/shard`` (``shard_workers=0``: one ``StepHeartbeat`` per worker, keyed
``job``, as older agents did); it follows the control topic
like an agent does (a :class:`~lockstep.kafka.Tail` opened at the topic's end),
accepts triggers for future steps (refuses those for steps already past), and
when a window ends publishes each worker's ``WindowFeatures`` keyed ``job:window:shard``,
as the agents do (``features="step"``: a ``FeatureBatch`` per worker and step, keyed
``job:step``, during the window, as older agents did).  When it stops, every
worker sends its final heartbeat, as an agent does when it closes: the job ended (the
detector does not take the silence for a hang, and the job's incidents resolve).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ...kafka import Publisher, Tail, Topics, features_key, heartbeat_key, window_features_key
from ...schemas.records import SHARD_WORKERS, ProfileTrigger
from .fleet import FleetSimulator
from .hang import SimulatedHang
from .model import SimulatedStep

log = logging.getLogger("lockstep.simulator")


@dataclass
class LiveResult:
    steps: int = 0
    triggers: list[ProfileTrigger] = field(default_factory=list)
    refused: list[ProfileTrigger] = field(default_factory=list)
    windows_done: list[str] = field(default_factory=list)


def run_live(
    fleet: FleetSimulator,
    publisher: Publisher,
    control: Tail,
    topics: Topics,
    *,
    steps_per_s: float = 25.0,
    max_steps: int = 2000,
    start_step: int = 0,
    stop_after_windows: int = 1,
    tail_steps: int = 3,
    progress=None,
    features: Literal["window", "step"] = "window",
    shard_workers: int = SHARD_WORKERS,
    end_job: bool = True,
    hang: SimulatedHang | None = None,
) -> LiveResult:
    """Step the fleet in (compressed) real time until ``stop_after_windows`` windows were delivered (0: never) or
    ``max_steps``, then (``end_job``) send every worker's final heartbeat: the job ended.

    ``control`` is the control topic, open (from its end as it was when the fleet started)."""
    res = LiveResult()
    active: list[ProfileTrigger] = []
    period = 1.0 / steps_per_s
    next_t = time.monotonic()
    stop_at: int | None = None
    job = fleet.scenario.job
    echo: dict = {}  # the last trigger received, echoed in the next heartbeats (control latency)
    profiled: dict[str, list] = {}  # window -> its steps simulated so far (features="window")
    sim: SimulatedStep | None = None  # the last step simulated
    for step in range(start_step, start_step + max_steps):
        if hang is not None and step >= hang.at_step:
            publisher.flush()
            _answer_hang(fleet, publisher, control, topics, hang, res, step, progress)
            return res
        for trig in control.records(ProfileTrigger, where=lambda t: t.job == job):  # refusals are for operators
            echo = {"trigger_window": trig.window, "trigger_latency_s": time.time() - trig.created_at}
            if trig.start_step <= step:
                log.warning(
                    "refusing trigger %s: start step %d is not in the future (now at %d)",
                    trig.window,
                    trig.start_step,
                    step,
                )
                res.refused.append(trig)
            elif all(t.window != trig.window for t in active):
                log.info(
                    "accepted trigger %s: steps %d..%d (%s)",
                    trig.window,
                    trig.start_step,
                    trig.start_step + trig.steps - 1,
                    trig.reason,
                )
                res.triggers.append(trig)
                active.append(trig)
        # the workers' samplers run at the rate the window's trigger asks for, as agents do
        rates = [t.sampling.hardware_hz for t in active if t.start_step <= step < t.start_step + t.steps]
        sim = fleet.step(step, hardware_hz=rates[0] if rates else None)
        now = time.time()
        if shard_workers:
            for batch in fleet.heartbeat_batches(
                sim, now, shard_workers, echo=(echo["trigger_window"], echo["trigger_latency_s"]) if echo else None
            ):
                publisher.send(topics.heartbeats, heartbeat_key(job, batch.shard), batch)
        else:
            for hb in fleet.heartbeats(sim, now):
                publisher.send(topics.heartbeats, job, msgspec.structs.replace(hb, **echo) if echo else hb)
        echo = {}
        for trig in list(active):
            if trig.start_step <= step < trig.start_step + trig.steps:
                if features == "step":
                    key = features_key(job, step)
                    for fb in fleet.feature_batches(sim, trig, now):
                        publisher.send(topics.features, key, fb)
                else:
                    profiled.setdefault(trig.window, []).append(sim)
            if step == trig.start_step + trig.steps - 1:
                sims = profiled.pop(trig.window, [])
                for wf in fleet.window_features(sims, trig, now) if sims else ():
                    publisher.send(topics.windowfeatures, window_features_key(job, trig.window, wf.shard), wf)
                active.remove(trig)
                res.windows_done.append(trig.window)
                if stop_after_windows and len(res.windows_done) >= stop_after_windows:
                    stop_at = step + tail_steps
        res.steps = step - start_step + 1
        publisher.poll(0)
        if progress:
            progress(step, res)
        if stop_at is not None and step >= stop_at:
            break
        next_t += period
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    if end_job and sim is not None:
        send_final_heartbeats(fleet, sim, publisher, topics, shard_workers)
    publisher.flush()
    return res


def _answer_hang(
    fleet: FleetSimulator,
    publisher: Publisher,
    control: Tail,
    topics: Topics,
    hang: SimulatedHang,
    res: LiveResult,
    step: int,
    progress,
) -> None:
    """A hung job: no heartbeat, until the hang trigger comes; every worker answers it (as an agent does, from a
    thread of its own)."""
    job = fleet.scenario.job
    log.info("the job hangs at step %d: worker %d stopped in its data loading", step, hang.culprit)
    while True:
        for trig in control.records(ProfileTrigger, where=lambda t: t.job == job):
            if trig.kind != "hang":
                continue
            log.info("hang trigger %s: every worker answers where it is", trig.window)
            for rep in hang.reports(fleet.meta, trig, fleet.scenario.tenant):
                publisher.send(topics.hangs, job, rep)
            publisher.flush()
            res.triggers.append(trig)
            res.windows_done.append(trig.window)
            return
        if progress:
            progress(step, res)
        time.sleep(0.2)


def send_final_heartbeats(
    fleet: FleetSimulator, sim: SimulatedStep, publisher: Publisher, topics: Topics, shard_workers: int
) -> None:
    """Every live worker's last heartbeat (its last step again, ``final``), as an agent sends it when it closes."""
    job, now = fleet.scenario.job, time.time()
    if shard_workers:
        for batch in fleet.heartbeat_batches(sim, now, shard_workers, final=True):
            publisher.send(topics.heartbeats, heartbeat_key(job, batch.shard), batch)
    else:
        for hb in fleet.heartbeats(sim, now):
            publisher.send(topics.heartbeats, job, msgspec.structs.replace(hb, final=True))
