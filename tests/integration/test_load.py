"""Sustained load (the CI variant): a 1,024-worker job through the real pipeline, profiled nearly all the
time, for 60 s.  Lag must stay bounded and every window must reach DuckDB with its finding.  The full run
is ``python benchmarks/load.py --minutes 10 --steps-per-s 2`` (RELIABILITY.md)."""

import json

import pytest

from lockstep.app.load import run_load

pytestmark = pytest.mark.integration

WORKERS, SECONDS, STEPS_PER_S = 1024, 60, 1.0


def test_a_1024_worker_job_for_a_minute_keeps_lag_bounded_and_loses_no_window(settings, tmp_path):
    settings.partitions = 6
    res = run_load(settings, workers=WORKERS, duration_s=SECONDS, steps_per_s=STEPS_PER_S, log_dir=tmp_path)
    summary = res.summary()
    print("\nRELIABILITY load:", json.dumps(summary))
    # how many windows fit in the minute depends on the machine's speed (each starts a margin ahead that grows with
    # the measured lag): two at least, whatever the load; the count is printed above and measured by benchmarks/load.py
    assert len(res.windows) >= 2
    assert sorted(res.windows) == res.stored  # every window's findings reached DuckDB ...
    assert all(13 in res.culprits[w] for w in res.windows)  # ... naming the throttled GPU's worker
    assert res.dead_letters == 0
    per_step = 2 * WORKERS  # a heartbeat and a feature batch per worker
    assert max(max(res.lag(t)) for t in res.published) <= 10 * per_step  # never ten steps behind
    # lag in seconds and the drain time are wall-clock durations: printed above, measured by benchmarks/load.py
