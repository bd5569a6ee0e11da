"""The detector in a real `lockstep processor` against the broker, fed simulated heartbeats.

One processor serves every test of this module (it takes seconds to start); each test drives
its own jobs through a heartbeat thread at 40 steps per second.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from lockstep.app.operator import TriggerError, request_window
from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.config import Settings
from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, features_key, producer_config, read_all
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    AgentCounters,
    FeatureBatch,
    ProfileTrigger,
    StepHeartbeat,
    WindowReport,
    WorkerMeta,
    decode,
)
from lockstep.streams.app import changelog_topics
from lockstep.streams.policy import load_policy

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

STEPS_PER_S = 40.0
POLICY = """id: itest
detector:
  baseline_steps: 10
  recent_steps: 3
  slowdown_threshold: {threshold}
  hang_factor: 10
  hang_min_s: 3
  window_steps: 4
  small_job_window_steps: 4
  cooldown_steps: 300
  control_latency_s: 0.2
"""


@dataclass
class Job:
    name: str
    workers: int = 4
    factor: float = 1.0  # step time multiplier (a slowdown)
    hiccups: bool = False  # one step in 17 takes 1.8x
    step: int = 0
    stop: str = ""  # "final": send final heartbeats and stop; "hang": stop, the laggard one step early
    laggard: int = 2
    refuse: ProfileTrigger | None = None  # every worker echoes its refusal of this trigger (past) on its next heartbeat
    done: bool = False
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


class Driver(threading.Thread):
    """Publishes every running job's heartbeats, one step per 1/STEPS_PER_S seconds."""

    def __init__(self, settings: Settings):
        super().__init__(daemon=True)
        self.pub = Publisher(producer_config(settings, **{"linger.ms": 2}))
        self.topic = f"{settings.topic_prefix}.heartbeats"
        self.jobs: dict[str, Job] = {}
        self.halt = threading.Event()

    def add(self, name: str, **kw) -> Job:
        job = self.jobs[name] = Job(name, **kw)
        return job

    def run(self) -> None:
        period = 1.0 / STEPS_PER_S
        next_t = time.monotonic()
        while not self.halt.is_set():
            now = time.time()
            for job in list(self.jobs.values()):
                if not job.done:
                    self._step(job, now)
            self.pub.poll(0)
            next_t += period
            time.sleep(max(0.0, next_t - time.monotonic()))
        self.pub.flush()

    def _step(self, job: Job, now: float) -> None:
        base = 0.02 * job.factor * (1.8 if job.hiccups and job.step % 17 == 5 else 1.0)
        times = base * job.rng.normal(1.0, 0.02, job.workers)
        refused, job.refuse = job.refuse, None
        echo = (
            {
                "trigger_window": refused.window,
                "trigger_latency_s": max(0.0, now - refused.created_at),
                "trigger_refused": "past",
            }
            if refused is not None
            else {}
        )
        for w in range(job.workers):
            if job.stop == "hang" and w == job.laggard:
                continue  # never finishes this step
            hb = StepHeartbeat(
                job=job.name,
                worker=w,
                step=job.step,
                step_time_s=float(times[w]),
                host=f"h{w}",
                sent_at=now,
                final=job.stop == "final",
                world_size=job.workers,  # as agents report it: the job's steps go as soon as every worker is in
                **echo,
            )
            self.pub.send(self.topic, job.name, hb)
        if job.stop:
            job.done = True
        else:
            job.step += 1


class ControlLog:
    """Every trigger published on the control topic since the test module started."""

    def __init__(self, settings: Settings):
        self.tail = Tail(consumer_config(settings, None), f"{settings.topic_prefix}.control", from_start=True).open()
        self.records: list[ProfileTrigger] = []

    def triggers(self, job: str) -> list[ProfileTrigger]:
        self.records += self.tail.records(ProfileTrigger, timeout_s=0.2)
        return [r for r in self.records if r.job == job]

    def wait(self, job: str, n: int = 1, timeout_s: float = 20.0) -> list[ProfileTrigger]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.triggers(job)
            if len(found) >= n:
                return found
        return self.triggers(job)


@dataclass
class Rig:
    settings: Settings
    policy_path: Path
    processor: Child
    port: int
    driver: Driver
    control: ControlLog

    def wait_step(self, job: Job, step: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while job.step < step:
            assert time.monotonic() < deadline, f"{job.name} stuck at step {job.step}"
            time.sleep(0.02)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return r.read().decode()

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        flags = ["--bootstrap-servers", self.settings.bootstrap_servers, "--topic-prefix", self.settings.topic_prefix]
        return subprocess.run(
            [sys.executable, "-m", "lockstep", "trigger", *args, *flags], capture_output=True, text=True, timeout=60
        )


@pytest.fixture(scope="module")
def rig(kafka_bootstrap, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("detector")
    tag = uuid.uuid4().hex[:8]
    policy_path = tmp / "policy.yaml"
    policy_path.write_text(POLICY.format(threshold=0.3))
    settings = Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"d{tag}",
        processor_id=f"proc-{tag}",
        sink_group=f"sink-{tag}",
        partitions=3,
        db=tmp / "findings.duckdb",
        step_timeout_s=1.0,
        window_timeout_s=2.0,
        policy=policy_path,
    )
    ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    port = free_port()
    proc = Child(
        "processor",
        ["processor", *settings_flags(settings, "processor"), "--http-port", str(port)],
        tmp,
        f"http://127.0.0.1:{port}/healthz",
    )
    driver, control = Driver(settings), ControlLog(settings)
    try:
        proc.wait_healthy(60)
        driver.start()
        yield Rig(settings, policy_path, proc, port, driver, control)
    finally:
        driver.halt.set()
        if driver.is_alive():
            driver.join(10)
        control.tail.close()
        proc.kill()  # a graceful faust shutdown takes seconds and is not what this module tests


def test_a_slowdown_triggers_once_within_the_cooldown_and_noise_does_not(rig):
    slow, noisy = rig.driver.add("slow"), rig.driver.add("noisy", hiccups=True)
    rig.wait_step(slow, 30)
    slow.factor, slowed_at = 1.6, slow.step
    (t,) = rig.control.wait("slow")
    rig.wait_step(slow, t.start_step + t.steps + 30)  # well past the window, still slow, inside the cool-down
    slow.stop = noisy.stop = "final"
    time.sleep(1.0)
    assert len(rig.control.triggers("slow")) == 1
    assert t.kind == "slowdown" and t.start_step > slowed_at and t.expected_workers == 4
    assert (t.policy, t.policy_hash) == ("itest", load_policy(rig.policy_path).hash)
    assert rig.control.triggers("noisy") == []
    assert 'lockstep_triggers_suppressed{code="cooldown"}' in rig.metrics()  # the cool-down stopped a second window


def test_a_window_every_worker_refused_closes_failed_at_once_and_its_slowdown_gets_another(rig):
    """The trigger reaches the workers too late: each echoes its refusal (``past``) on its next heartbeat.  The real
    processor closes the window ``failed`` with the refusals (not "no step report by the trigger's deadline", which
    it said at its deadline before) and the slowdown gets a second window inside what was the cool-down."""
    job = rig.driver.add("refused")
    rig.wait_step(job, 30)
    job.factor = 1.6
    (first,) = rig.control.wait("refused")
    job.refuse = first
    triggers = rig.control.wait("refused", n=2, timeout_s=30)
    topic = f"{rig.settings.topic_prefix}.windows"
    reports: list[WindowReport] = []
    deadline = time.monotonic() + 30
    while not reports and time.monotonic() < deadline:
        reports = [decode(v, WindowReport) for _, v in read_all(rig.settings, [topic])[topic]]
        reports = [r for r in reports if r.job == "refused" and r.window == first.window]
        time.sleep(0.3)
    job.stop = "final"
    (r,) = reports
    assert (r.closed, r.steps_seen) == ("failed", 0)
    assert r.closed_reason.startswith("every one of the 4 expected workers refused the trigger: 4 past"), r
    assert len(triggers) == 2 and triggers[1].kind == "slowdown", triggers
    assert triggers[1].start_step < first.start_step + first.steps + 300  # cooldown_steps: not waited out
    assert 'lockstep_windows_refused_total{retry="yes"} 1' in rig.metrics()


def test_a_hang_triggers_once(rig):
    hung = rig.driver.add("hung")
    rig.wait_step(hung, 30)
    hung.stop = "hang"  # worker 2 never finishes the last step, nobody sends another heartbeat
    while not hung.done:
        time.sleep(0.01)
    last = hung.step
    (t,) = rig.control.wait("hung", timeout_s=20)
    assert t.kind == "hang" and t.start_step == last + 2
    assert f"1 worker(s) behind step {last}: 2" in t.reason
    time.sleep(1.0)
    assert len(rig.control.triggers("hung")) == 1


def test_a_manual_trigger_respects_the_limits(rig):
    job, other = rig.driver.add("manual"), rig.driver.add("manual-cli")
    rig.wait_step(job, 20)
    t = request_window(rig.settings, "manual", steps=64, reason="", timeout_s=20)
    assert isinstance(t, ProfileTrigger) and t.kind == "manual"
    again = request_window(rig.settings, "manual", steps=None, reason="", timeout_s=20)
    assert again.code == "job_limit" and t.window in again.reason  # the window is still open
    rig.wait_step(job, t.start_step + t.steps + 2)
    again = request_window(rig.settings, "manual", steps=None, reason="", timeout_s=20)
    assert again.code == "cooldown" and f"window {t.window} ended" in again.reason
    assert request_window(rig.settings, "manual", steps=65, reason="", timeout_s=20).code == "too_long"
    assert [x.window for x in rig.control.triggers("manual")] == [t.window]

    ok = rig.cli("manual-cli", "--steps", "4", "--reason", "operator check", "--json")
    assert ok.returncode == 0, ok.stderr
    cli = json.loads(ok.stdout)
    assert (cli["schema"], cli["kind"], cli["steps"], cli["expected_workers"]) == ("ProfileTrigger", "manual", 4, 4)
    assert "operator check" in cli["reason"] and cli["start_step"] > 20
    ghost = rig.cli("ghost")
    assert ghost.returncode == 1 and ghost.stdout == ""
    assert ghost.stderr.count("\n") == 1 and ghost.stderr.startswith(
        "lockstep trigger: error: refused (unknown_job): no heartbeats of job 'ghost'"
    )
    job.stop = other.stop = "final"


def test_no_processor_answering_is_an_error(rig):
    lonely = dataclasses.replace(rig.settings, topic_prefix=rig.settings.topic_prefix + "x")
    ensure_topics(lonely)
    with pytest.raises(
        TriggerError, match="no stream processor answered within 1s"
    ):  # it gives up (a hang would meet pytest's timeout)
        request_window(lonely, "manual", steps=None, reason="", timeout_s=1)


def test_coverage_is_the_share_of_the_active_workers_that_delivered_features(rig):
    job = rig.driver.add("covered")
    rig.wait_step(job, 20)
    t = request_window(rig.settings, "covered", steps=4, reason="coverage", timeout_s=20)
    assert isinstance(t, ProfileTrigger) and t.expected_workers == 4
    job.stop = "final"
    table = ft.pack(
        ft.make_table({"function": ["f"], "kind": ["compute"], "calls": [1], "total_us": [1.0], "critical_us": [1.0]})
    )
    pub = Publisher(producer_config(rig.settings))
    delivered = {0: 4, 1: 4, 2: 3, 3: 0}  # workers per step of the window: one missed step 2, nobody sent step 3
    for i, n in delivered.items():
        step = t.start_step + i
        for w in range(n):
            fb = FeatureBatch(
                job="covered",
                window=t.window,
                step=step,
                window_start=t.start_step,
                window_steps=t.steps,
                expected_workers=t.expected_workers,
                worker=WorkerMeta(rank=w, host=f"h{w}"),
                step_time_us=20_000.0,
                functions=table,
                policy=t.policy_ref,
            )
            pub.send(f"{rig.settings.topic_prefix}.features", features_key("covered", step), fb)
    pub.flush()
    topic = f"{rig.settings.topic_prefix}.windows"
    deadline = time.monotonic() + 30
    reports = []
    while not reports and time.monotonic() < deadline:
        reports = [decode(v, WindowReport) for _, v in read_all(rig.settings, [topic])[topic]]
        reports = [r for r in reports if r.job == "covered"]
        time.sleep(0.3)
    (r,) = reports
    assert (r.expected_workers, r.steps_seen, r.workers_seen, r.closed) == (4, 3, 4, "timeout")
    assert r.coverage == pytest.approx((4 + 4 + 3 + 0) / (4 * 4))  # worker-steps delivered of those expected


def test_a_policy_edit_takes_effect_without_a_restart(rig):
    mild = rig.driver.add("mild")
    rig.wait_step(mild, 30)
    mild.factor = 1.2  # +20%: below the threshold of 30%
    rig.wait_step(mild, mild.step + 20)
    assert rig.control.triggers("mild") == []
    mild.factor = 1.0

    rig.policy_path.write_text(POLICY.format(threshold=0.1).replace("hang_factor: 10", "hang_factor: 0.5"))  # broken
    deadline = time.monotonic() + 10
    while "hang_factor must be > 1" not in rig.processor.log_path.read_text():
        assert time.monotonic() < deadline, rig.processor.tail()
        time.sleep(0.2)
    assert rig.processor.healthy()

    rig.policy_path.write_text(POLICY.format(threshold=0.1))
    new = load_policy(rig.policy_path)
    deadline = time.monotonic() + 10
    while f'lockstep_policy_info{{policy="{new.ref}"}} 1' not in rig.metrics():
        assert time.monotonic() < deadline, rig.processor.tail()
        time.sleep(0.2)
    mild.factor = 1.2
    (t,) = rig.control.wait("mild")
    assert t.policy_hash == new.hash and t.kind == "slowdown"
    mild.stop = "final"


def test_the_agents_counters_are_exported_per_job(rig):
    job = rig.driver.add("spooling")
    rig.wait_step(job, 5)
    for w, dropped in ((1, 7), (3, 5)):  # two agents report what their bounded spools had to drop
        hb = StepHeartbeat(
            job="spooling",
            worker=w,
            step=job.step,
            step_time_s=0.02,
            host=f"h{w}",
            sent_at=time.time(),
            agent=AgentCounters(dropped_records=dropped, spooled_records=2),
        )
        rig.driver.pub.send(rig.driver.topic, "spooling", hb)
    want = ['lockstep_agent_dropped_records{job="spooling"} 12', 'lockstep_agent_spooled_records{job="spooling"} 4']
    deadline = time.monotonic() + 10
    while not all(line in rig.metrics() for line in want):
        assert time.monotonic() < deadline, [line for line in rig.metrics().splitlines() if "agent_" in line]
        time.sleep(0.2)
    job.stop = "final"
