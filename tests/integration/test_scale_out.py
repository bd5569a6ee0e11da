"""Scale-out (issue 13): two processors in one consumer group share one large job, and one of them is SIGKILLed
halfway through a profiling window.

A 4,096-worker job (16 heartbeat shards and 16 feature shards over 6 partitions, so both processors hold some of
the job's heartbeats and some of its feature records) runs live against the embedded broker, a real DuckDB sink
and two ``lockstep processor`` children; an operator asks for a window as soon as the last one ended.  The second
processor is killed in the middle of the second window and not restarted: the first takes its partitions over
(the group's session timeout, then a rebalance) and replays what it had not committed.  Every window the fleet
delivered must reach DuckDB with exactly the findings the one-process diagnosis gives for it (``diagnose_one``,
what ``lockstep evaluate`` runs), each stored once.  The fleet stops three steps after the killed window ended (the
windows after it would be the survivor's alone, which the takeover's assertions do not need; the run used to go on to
75 steps and a third window), or at 100 steps when a loaded machine delays the windows.  The run is
``benchmarks/load.py --workers 4096 --processors 2 --kill 1 --stop-after-windows 2 --minutes 1.67``; RELIABILITY.md
quotes what it prints.
"""

import dataclasses
import json

import pytest

from lockstep.app.evaluate import diagnose_one
from lockstep.app.load import POLICY, run_load, scenario
from lockstep.producers.simulator.fleet import FleetSimulator, Window
from lockstep.streams.policy import load_policy

pytestmark = pytest.mark.integration

WORKERS, SECONDS, STEPS_PER_S, WINDOW_STEPS = 4096, 100, 1.0, 8  # SECONDS: at most; the run ends after the kill


def test_two_processors_share_a_4096_worker_job_and_one_killed_mid_window_loses_and_duplicates_nothing(
    settings, tmp_path
):
    settings.partitions = 6
    settings.step_timeout_s, settings.window_timeout_s = 60.0, 120.0  # nothing may close by timeout during the takeover
    res = run_load(
        settings,
        workers=WORKERS,
        duration_s=SECONDS,
        steps_per_s=STEPS_PER_S,
        log_dir=tmp_path,
        processors=2,
        kill=1,
        stop_after_windows=2,  # the first window, then the killed one: the run ends once the kill is tested
    )
    print("\nRELIABILITY scale-out:", json.dumps(res.summary()), "findings:", json.dumps(res.findings))
    assert res.killed, "the second processor was not killed: fewer than two windows opened"
    assert len(res.windows) >= 2
    assert sorted(res.windows) == res.stored  # every window reached DuckDB, the killed one's included ...
    (policy_file,) = [tmp_path / "load-policy.yaml"]
    assert policy_file.read_text() == POLICY
    policy = load_policy(policy_file)
    sc = scenario(WORKERS)
    fleet = FleetSimulator(dataclasses.replace(sc, hardware_hz=policy.detector.hardware_hz))
    for window in res.windows:  # ... with the one-process diagnosis's findings, no more, no fewer
        start = int(window.removeprefix("w"))
        expected = sorted(f.id for f in diagnose_one(fleet, policy, Window(start, WINDOW_STEPS)).findings)
        assert res.findings[window] == expected, window
    assert res.finding_rows == len({f for ids in res.findings.values() for f in ids})  # each stored once
    assert res.dead_letters == 0
    assert all(v <= 0 for v in res.unconsumed.values()), res.unconsumed  # every record consumed (replays count twice)
