"""The broker goes away while a real PyTorch training loop runs with the real host agent, then comes back.

The agent spools to disk (bounded: the oldest records go first and are counted), the training step
does not wait for it, and what was not dropped arrives once Kafka answers again; the drops are reported
to the pipeline in the heartbeats' ``agent`` counters.  RELIABILITY.md quotes the figures it prints.

No wall-clock duration is compared here (on a shared machine one flakes): ``agent.step()`` is held to
the training thread's own CPU time and to how often it slept (waited for anything), both unaffected by
other processes.  The step-time ratio before/during the outage is ``python benchmarks/bench_agent.py outage``'s figure.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from lockstep.broker import EmbeddedBroker, free_port
from lockstep.config import Settings
from lockstep.kafka import ensure_topics, read_all
from lockstep.producers.agent import attach
from lockstep.schemas.records import HeartbeatBatch, StepHeartbeat, decode
from lockstep.sinks.http import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

SPOOL_MAX = 256 << 10  # about 1,200 heartbeats one per record: the outage below overflows it
SPOOL_MAX_BATCHES = 64 << 10  # batches are denser (the outage below spools about 160 KiB of them)


class Training:
    """A small model's training step (about a millisecond of CPU) plus a 4 ms wait, as for a GPU."""

    def __init__(self, agent):
        import torch  # here, not at the top: collecting the quick tier needs no torch

        self.agent = agent
        self.model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.step_s: list[float] = []  # the whole iteration, agent included (wall clock: printed, never compared)
        self.agent_cpu_s: list[float] = []  # agent.step() alone: the training thread's own CPU time
        self.agent_waits: list[int] = []  # agent.step() alone: how often the training thread slept in it

    def run(self, steps: int, during=None, waits=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import torch

        first = len(self.step_s)
        for i in range(steps):
            t0 = time.perf_counter()
            self.model(torch.randn(32, 128)).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            time.sleep(0.004)
            w1, c1 = waits(), time.thread_time()
            self.agent.step()
            self.agent_cpu_s.append(time.thread_time() - c1)
            self.agent_waits.append(waits() - w1)
            self.step_s.append(time.perf_counter() - t0)
            if during and i % 50 == 0:
                during()
        return tuple(np.array(x[first:]) for x in (self.step_s, self.agent_cpu_s, self.agent_waits))  # type: ignore[return-value]


def spool_bytes(path) -> int:
    total = 0
    for p in path.rglob("*.spool"):  # SPOOL_DIR/run-RUN/rankN
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # sent and removed by the agent between the listing and the stat
            pass
    return total


@pytest.mark.parametrize(
    ("shard_workers", "spool_max"),
    [(0, SPOOL_MAX), (256, SPOOL_MAX_BATCHES)],
    ids=["one-record-per-heartbeat", "heartbeat-batches"],
)
def test_broker_outage_spools_without_blocking_training_and_reports_what_the_bound_dropped(
    tmp_path, thread_waits, shard_workers, spool_max
):
    pytest.importorskip("torch", reason="the agent is tested in a real PyTorch training loop")
    port = free_port()
    settings = Settings(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="outage", partitions=1)
    broker = EmbeddedBroker(port=port).start()
    spool = tmp_path / "spool"
    try:
        ensure_topics(settings)
        agent = attach(
            job="outage-job",
            bootstrap_servers=settings.bootstrap_servers,
            topic_prefix="outage",
            rank=0,
            world_size=1,
            host="h0",
            spool_dir=spool,
            spool_max_bytes=spool_max,
            delivery_timeout_s=1.0,
            flush_interval_s=0.05,
            heartbeat_shard_workers=shard_workers,  # 0: one StepHeartbeat per record; else a HeartbeatBatch per flush
        )
        train = Training(agent)
        before, _, _ = train.run(300, waits=thread_waits)
        broker.stop()  # Kafka is gone (memory storage: its topics and records with it)
        down_at = agent.current_step
        sizes: list[int] = []  # the spool's bytes on disk, every 50 steps
        during, agent_cpu, agent_waits = train.run(
            2500, during=lambda: sizes.append(spool_bytes(spool)), waits=thread_waits
        )
        assert agent.report().kafka_down
        broker = EmbeddedBroker(port=port).start()  # Kafka is back, empty
        ensure_topics(settings)
        back_at, t_back = agent.current_step, time.monotonic()
        train.run(300, waits=thread_waits)
        assert wait_for(lambda: agent.report().spooled_now == 0 and not agent.report().kafka_down, 60), agent.report()
        drain_s = time.monotonic() - t_back
        dropped = (
            agent.report().counters.dropped_records
        )  # records still in flight at the outage's end are counted by now
        last = agent.current_step
        agent.close()
        records = [
            decode(v, (StepHeartbeat, HeartbeatBatch))
            for _, v in read_all(settings, ["outage.heartbeats"])["outage.heartbeats"]
        ]
        beats = [hb for r in records for hb in (r.heartbeats() if isinstance(r, HeartbeatBatch) else [r])]
    finally:
        broker.stop()

    # agent.step() never waited for Kafka while it was away: the training thread hardly ever slept in it (a GIL
    # hand-over to the agent's own thread can make it sleep once in a while), and its own CPU time stayed small
    slept = int(np.count_nonzero(agent_waits))
    assert slept <= 0.05 * agent_waits.size, f"agent.step() slept in {slept} of {agent_waits.size} steps"
    assert np.percentile(agent_cpu, 99) < 0.002 and agent_cpu.max() < 0.1, (
        np.percentile(agent_cpu, 99),
        agent_cpu.max(),
    )
    # the spool stayed within its bound and dropped its oldest records, and said how many
    assert max(sizes) <= spool_max and dropped > 0
    steps = {b.step for b in beats if not b.final}
    lost = sorted(set(range(down_at, back_at)) - steps)
    # the spool counts records: one heartbeat each, or a flush's heartbeats as one batch
    # (a record the agent gave up on may still have been written: librdkafka reports _MSG_TIMED_OUT for a message
    # whose fate it does not know, STACK-NOTES; a loaded CI run saw 1,338 steps lost for 1,490 records dropped)
    assert 0 < len(lost) <= dropped if shard_workers == 0 else len(lost) >= dropped, (len(lost), dropped)
    assert lost == list(range(lost[0], lost[0] + len(lost)))  # the oldest of the outage, in one run
    assert set(range(down_at, last)) - steps == set(
        lost
    )  # everything else since arrived (the broker lost what it had before)
    reported = [b.agent.dropped_records for b in beats if b.agent]
    assert reported and max(reported) == dropped  # the pipeline hears of the drops
    print(
        f"\nRELIABILITY outage: {back_at - down_at} steps without Kafka; step time p50 {np.median(before) * 1e3:.2f} ms before, "
        f"{np.median(during) * 1e3:.2f} ms during (wall clock; the benchmark measures the ratio); agent.step() CPU p50 {np.median(agent_cpu) * 1e6:.0f} us, "
        f"p99 {np.percentile(agent_cpu, 99) * 1e6:.0f} us, max {agent_cpu.max() * 1e3:.2f} ms, slept in {slept} of {agent_waits.size} steps; "
        f"spool at most {max(sizes)} bytes on disk, bound {spool_max}; "
        f"{len(lost)} oldest heartbeats lost in {dropped} records dropped and reported, "
        f"{back_at - down_at - len(lost)} delivered after the return, spool empty "
        f"{drain_s:.1f} s after it"
    )
