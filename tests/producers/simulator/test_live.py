"""The live simulated fleet in memory (MemoryKafka): it ends like a job, every worker's last heartbeat ``final``.
Against the real broker, processor and sink: tests/integration/test_incidents.py and test_compose.py."""

from __future__ import annotations

import pytest

from lockstep.kafka import MemoryKafka, Publisher, Tail, Topics
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.live import run_live
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import HeartbeatBatch, StepHeartbeat, decode

TOPICS = Topics.named("t")


@pytest.mark.parametrize("shard_workers", [4, 0])
def test_the_fleet_sends_every_workers_final_heartbeat_when_it_stops(shard_workers):
    kafka = MemoryKafka(dict.fromkeys(TOPICS.all(), 1))
    fleet = FleetSimulator(Scenario(job="j", topology=Topology(workers=8, gpus_per_host=4)))
    with Tail({}, TOPICS.control, clients=kafka.clients()).open() as control:
        res = run_live(
            fleet,
            Publisher({}, clients=kafka.clients()),
            control,
            TOPICS,
            steps_per_s=1e6,
            max_steps=5,
            shard_workers=shard_workers,
        )
    assert res.steps == 5
    beats = []
    for m in kafka.messages(TOPICS.heartbeats):
        rec = decode(m.value(), (HeartbeatBatch, StepHeartbeat))
        beats += rec.heartbeats() if isinstance(rec, HeartbeatBatch) else [rec]
    final = [hb for hb in beats if hb.final is True]
    assert sorted(hb.worker for hb in final) == list(range(8))  # each worker once ...
    assert {hb.step for hb in final} == {4}  # ... its last step again, as an agent's close sends it
    assert beats[-len(final) :] == final  # and last
    assert len(beats) == 5 * 8 + 8
