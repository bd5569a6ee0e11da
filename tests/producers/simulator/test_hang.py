"""The simulated hang in memory: the fleet stops at the hang's step, and every worker answers the hang trigger as an
agent does; the diagnosis of those answers names the culprit in its data loading."""

from __future__ import annotations

import threading
import time

from lockstep.kafka import MemoryKafka, Publisher, Tail, Topics
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario
from lockstep.producers.simulator.hang import SimulatedHang
from lockstep.producers.simulator.live import run_live
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import HangReport, HeartbeatBatch, ProfileTrigger, decode
from lockstep.streams.diagnosis.hang import diagnose_hang

TOPICS = Topics.named("t")


def test_the_hung_fleet_answers_the_hang_trigger_and_the_culprit_is_named():
    kafka = MemoryKafka(dict.fromkeys(TOPICS.all(), 1))
    fleet = FleetSimulator(Scenario(job="j", topology=Topology(workers=8, gpus_per_host=4)))
    trig = ProfileTrigger(job="j", window="w9", start_step=9, steps=4, expected_workers=8, kind="hang")

    def detector() -> None:  # the hang trigger, once the fleet has stopped
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(kafka.messages(TOPICS.heartbeats)) < 5 * 2:
            time.sleep(0.01)
        Publisher({}, clients=kafka.clients()).send(TOPICS.control, "j", trig)

    with Tail({}, TOPICS.control, clients=kafka.clients()).open() as control:
        t = threading.Thread(target=detector)
        t.start()
        res = run_live(
            fleet,
            Publisher({}, clients=kafka.clients()),
            control,
            TOPICS,
            steps_per_s=1e6,
            max_steps=50,
            hang=SimulatedHang(culprit=6, at_step=5),
        )
        t.join()
    assert res.steps == 5 and res.windows_done == ["w9"]
    beats = [hb for m in kafka.messages(TOPICS.heartbeats) for hb in decode(m.value(), HeartbeatBatch).heartbeats()]
    assert {hb.step for hb in beats} == set(range(5))  # no progress from the hang's step on ...
    assert not any(hb.final is True for hb in beats)  # ... and the job did not end
    reports = [decode(m.value(), HangReport) for m in kafka.messages(TOPICS.hangs)]
    assert sorted(r.worker for r in reports) == list(range(8))
    (f,) = diagnose_hang("j", "w9", reports, 8, now=1.0)
    assert f.workers == [6] and f.cause == "hang" and f.function_kind == "dataloader"
    assert f.devices == [fleet.meta[6].device]
