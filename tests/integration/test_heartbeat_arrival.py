"""Heartbeats as real agents send them, through a real broker and `lockstep processor`: a 2-rank and a 3-rank job,
one real host agent per rank (each its own Kafka producer, batching its own heartbeats every flush interval, the
flushes of different ranks out of phase), stepped in lockstep at about 11 steps per second.  No heartbeat is
counted late, and a trigger expects every rank of the job (not the workers of its newest step)."""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.request
import uuid

import pytest

from lockstep.app.operator import request_window
from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.config import Settings
from lockstep.kafka import ensure_topics
from lockstep.producers.agent import settings as agent_settings
from lockstep.producers.agent.agent import Agent
from lockstep.producers.agent.meta import Identity
from lockstep.schemas.records import ProfileTrigger, WorkerMeta
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

STEP_S = 0.09  # about 11 steps per second, as the real 4-rank job of issue 20


def metric(text: str, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^lockstep_{name}{{{re.escape(sel)}}} (\S+)$" if sel else rf"^lockstep_{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class RankJob(threading.Thread):
    """One job: a real agent per rank, every rank stepping at once (the job's collective makes them wait)."""

    def __init__(self, settings: Settings, job: str, ranks: int, spool, seed: int):
        super().__init__(daemon=True)
        self.job, self.ranks = job, ranks
        rng = random.Random(seed)
        self.agents = []
        for rank in range(ranks):
            cfg = agent_settings.load(
                {
                    "job": job,
                    "bootstrap_servers": settings.bootstrap_servers,
                    "topic_prefix": settings.topic_prefix,
                    "spool_dir": spool,
                },
                env={},
            )
            ident = Identity(meta=WorkerMeta(rank=rank, host=f"{job}-h{rank}"), world_size=ranks, world_known=True)
            self.agents.append(Agent(cfg, identity=ident))
            time.sleep(rng.uniform(0.0, cfg.flush_interval_s))  # hosts flush out of phase
        self.halt = threading.Event()

    def run(self) -> None:
        next_t = time.monotonic()
        while not self.halt.is_set():
            for agent in self.agents:
                agent.step()
            next_t += STEP_S
            time.sleep(max(0.0, next_t - time.monotonic()))

    @property
    def step(self) -> int:
        return min(a.current_step for a in self.agents)

    def close(self) -> None:
        self.halt.set()
        self.join(10)
        for agent in self.agents:
            agent.close()


@pytest.fixture(scope="module")
def processor(kafka_bootstrap, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arrival")
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"a{tag}",
        processor_id=f"proc-{tag}",
        partitions=3,
        step_timeout_s=2.0,
        window_timeout_s=4.0,
    )
    ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    port = free_port()
    proc = Child(
        "processor",
        ["processor", *settings_flags(settings, "processor"), "--http-port", str(port)],
        tmp,
        f"http://127.0.0.1:{port}/healthz",
    )
    try:
        proc.wait_healthy(60)
        yield settings, port, tmp
    finally:
        proc.kill()


def test_real_agents_per_rank_batches_arrive_without_late_heartbeats_and_triggers_expect_every_rank(processor):
    settings, port, tmp = processor
    jobs = [RankJob(settings, f"ranks{n}-{uuid.uuid4().hex[:4]}", n, tmp / "spool", seed=n) for n in (2, 3)]
    for job in jobs:
        job.start()
    try:
        deadline = time.monotonic() + 60
        while min(job.step for job in jobs) < 150:  # ~14 s: hundreds of batches per job
            assert time.monotonic() < deadline, [job.step for job in jobs]
            time.sleep(0.1)
        triggers = {
            job.ranks: request_window(settings, job.job, steps=4, reason="arrival", timeout_s=20) for job in jobs
        }
    finally:
        for job in jobs:
            job.close()
    time.sleep(1.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    beats = metric(text, "heartbeats_total")
    late = metric(text, "late_records_total", stage="heartbeats")
    print(
        f"heartbeats {beats:.0f}, late {late:.0f}; expected workers {[t.expected_workers for t in triggers.values()]}"
    )
    assert beats >= 0.9 * sum(job.ranks * 150 for job in jobs)
    assert late <= 0.002 * beats  # ~0 (a quarter of a real job's before issue 20)
    for ranks, t in triggers.items():
        assert isinstance(t, ProfileTrigger), t
        assert t.expected_workers == ranks  # the job's membership, not the newest step's workers
    # each rank's spool is its own, per run, in the one directory every rank was given
    assert len({a._outbox.spool.dir for job in jobs for a in job.agents}) == 5
