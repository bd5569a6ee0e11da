"""The cause rules on a worker that got less of a core than its peers (``causes._own_code``): a wait to run only where
the function is CPU work on the peers.  The live 3-rank job's numbers: rank 2 sleeps 34 ms in ``preprocess``, its
peers 4 ms; every rank runs it at a few hundredths of a core, on a host the machine's other tenants keep busy."""

from __future__ import annotations

import pytest

from lockstep.streams.diagnosis.causes import Suspect, classify
from lockstep.streams.policy import Policy


def suspect(work_us: float, peer_work_us: float, cpu_self: float, peer_cpu_self: float) -> Suspect:
    return Suspect(
        function="preprocess",
        kind="python",
        resource="cpu",
        workers=[2],
        hosts=["vm"],
        devices=[],
        nics=[],
        switches=[],
        peers=3,
        z=9.0,
        work_us=work_us,
        peer_work_us=peer_work_us,
        excess_us=work_us - peer_work_us,
        has_hardware=True,
        clock_events=0,
        peer_clock_events=0,
        values={"cpu_self": cpu_self, "cpu_other": 0.9713, "mem_used_frac": 0.3, "calls": 1.0},
        peer_values={"cpu_self": peer_cpu_self, "cpu_other": 0.9391, "mem_used_frac": 0.3, "calls": 1.0},
        present=3,
        signal="ratio",
    )


def test_a_longer_sleep_in_the_workers_own_code_is_its_code_not_cpu_contention():
    att = classify(suspect(34_300.0, 4_275.0, cpu_self=0.0148, peer_cpu_self=0.0545), Policy().diagnosis)
    assert att.cause == "rank_specific_code", att
    assert {e.feature for e in att.evidence} >= {"work_us", "cpu_other"}  # its evidence: the time, a normal host


@pytest.mark.parametrize(("cpu_self", "peer_cpu_self"), [(0.25, 0.62), (0.25, 0.88), (0.032, 0.19)])
def test_cpu_work_that_got_far_less_of_a_core_is_still_a_wait_to_run(cpu_self, peer_cpu_self):
    # the real corpus's cgroup-quota culprits: forward at 0.36-0.40 of a core, their peers at 0.62-0.88; four ranks
    # and a busy loop on two loaded cores (tests/data/real/contention.parquet): 0.032 against 0.19
    att = classify(suspect(1_300.0, 900.0, cpu_self=cpu_self, peer_cpu_self=peer_cpu_self), Policy().diagnosis)
    assert att.cause == "host_cpu_contention", att
    assert {e.feature for e in att.evidence} >= {"cpu_self", "cpu_other"}
