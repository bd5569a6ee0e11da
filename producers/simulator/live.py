"""Run a simulated fleet live against Kafka, behaving like the real agents.

Every step it publishes the workers' heartbeats; it follows the control topic
like an agent does, accepts triggers for future steps (refuses those for
steps already past), and during a window publishes each worker's feature
batch keyed ``job:step``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
from confluent_kafka import Consumer, TopicPartition

from ...kafka import Topics, features_key
from ...schemas.records import ProfileTrigger, RecordError, decode
from ..publisher import Publisher
from .fleet import FleetSimulator

log = logging.getLogger("lockstep.simulator")


@dataclass
class LiveResult:
    steps: int = 0
    triggers: list[ProfileTrigger] = field(default_factory=list)
    refused: list[ProfileTrigger] = field(default_factory=list)
    windows_done: list[str] = field(default_factory=list)


class ControlFollower:
    """Reads the control topic from its end at creation, like an agent that just started."""

    def __init__(self, consumer_config: dict, topic: str, job: str):
        self.job = job
        self.consumer = Consumer(consumer_config)
        meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
        tps = []
        for p in meta.partitions:
            _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            tps.append(TopicPartition(topic, p, high))
        self.consumer.assign(tps)

    def poll(self) -> list[ProfileTrigger]:
        out = []
        for msg in self.consumer.consume(100, timeout=0):
            if msg.error():
                continue
            try:
                trig = decode(msg.value())
            except RecordError as err:
                log.warning("ignoring bad control record: %s", err)
                continue
            if isinstance(trig, ProfileTrigger) and trig.job == self.job:  # refusals are for operators
                out.append(trig)
        return out

    def close(self) -> None:
        self.consumer.close()


def run_live(
    fleet: FleetSimulator,
    publisher: Publisher,
    control: ControlFollower,
    topics: Topics,
    *,
    steps_per_s: float = 25.0,
    max_steps: int = 2000,
    start_step: int = 0,
    stop_after_windows: int = 1,
    tail_steps: int = 3,
    progress=None,
) -> LiveResult:
    """Step the fleet in (compressed) real time until ``stop_after_windows`` windows were delivered."""
    res = LiveResult()
    active: list[ProfileTrigger] = []
    period = 1.0 / steps_per_s
    next_t = time.monotonic()
    stop_at: int | None = None
    job = fleet.scenario.job
    echo: dict = {}  # the last trigger received, echoed in the next heartbeats (control latency)
    for step in range(start_step, start_step + max_steps):
        for trig in control.poll():
            echo = {"trigger_window": trig.window, "trigger_latency_s": time.time() - trig.created_at}
            if trig.start_step <= step:
                log.warning("refusing trigger %s: start step %d is not in the future (now at %d)", trig.window, trig.start_step, step)
                res.refused.append(trig)
            elif all(t.window != trig.window for t in active):
                log.info("accepted trigger %s: steps %d..%d (%s)", trig.window, trig.start_step, trig.start_step + trig.steps - 1, trig.reason)
                res.triggers.append(trig)
                active.append(trig)
        # the workers' samplers run at the rate the window's trigger asks for, as agents do
        rates = [t.sampling.hardware_hz for t in active if t.start_step <= step < t.start_step + t.steps]
        sim = fleet.step(step, hardware_hz=rates[0] if rates else None)
        now = time.time()
        for hb in fleet.heartbeats(sim, now):
            publisher.send(topics.heartbeats, job, msgspec.structs.replace(hb, **echo) if echo else hb)
        echo = {}
        for trig in list(active):
            if trig.start_step <= step < trig.start_step + trig.steps:
                key = features_key(job, step)
                for fb in fleet.feature_batches(sim, trig, now):
                    publisher.send(topics.features, key, fb)
            if step == trig.start_step + trig.steps - 1:
                active.remove(trig)
                res.windows_done.append(trig.window)
                if len(res.windows_done) >= stop_after_windows:
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
    publisher.flush()
    return res
