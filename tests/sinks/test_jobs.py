"""``lockstep jobs``' SQL on a real findings file: one row per job seen (in its series, findings, windows or
incidents), its last step and workers, its recent step time, open incidents, cost; costliest first; ended jobs marked."""

from __future__ import annotations

import msgspec

from lockstep.schemas.records import JobChange, StepSeries
from lockstep.sinks.http import query
from lockstep.sinks.jobs import RECENT_STEPS, fetch_jobs
from lockstep.sinks.store import Batch, FindingsStore
from tests.sinks.test_store import fnd, win

T0 = 1_800_000_000.0


def series(job: str, steps: range, step_us, workers: int = 8) -> StepSeries:
    n = len(steps)
    times = [float(step_us(s)) for s in steps]
    return StepSeries(
        job=job, tenant="acme", steps=list(steps), step_time_us=times, median_us=times, workers=[workers] * n
    )


def test_jobs_are_listed_once_with_their_state_and_costliest_first(tmp_path):
    path = tmp_path / "f.duckdb"
    store = FindingsStore(path)
    # a: 500 steps, slow (200 ms) only in its last RECENT_STEPS; the last step reported by 7 workers
    store.write(Batch.of([series("a", range(400), lambda s: 100_000)], {}))
    store.write(
        Batch.of(
            [series("a", range(400, 499), lambda s: 200_000), series("a", range(499, 500), lambda s: 200_000, 7)], {}
        )
    )
    # b: cheap open problem, 2 findings in 2 windows; c: costly open problem, no series; d: ended, nothing wrong
    store.write(
        Batch(
            [fnd("b1", job="b", gpu_hours=2.0), fnd("b2", job="b", window_="w2", steps=(200, 201), gpu_hours=2.0)],
            [win("b", "w1", 100, findings=1)],
            {},
        )
    )
    store.write(Batch([fnd("c1", job="c", gpu_hours=50.0, cause="nic")], [], {}))
    # e: a CPU-only job (its agents found no accelerator): its hours are CPU-hours
    store.write(
        Batch([msgspec.structs.replace(fnd("e1", job="e", gpu_hours=1.0, devices=("vm",)), device_kind="cpu")], [], {})
    )
    store.write(Batch.of([series("d", range(30), lambda s: 50_000)], {}))
    store.write(Batch.of([JobChange(job="d", tenant="acme", change="ended", step=29, at=T0)], {}))
    store.close()

    jobs = fetch_jobs(lambda sql, params=None: query(path, sql, params))
    assert [j.job for j in jobs][:3] == ["c", "b", "e"]  # then a and d, which cost nothing, the latest seen first
    by = {j.job: j for j in jobs}
    assert len(jobs) == 5
    assert [by[j].hours_unit for j in "abcde"] == ["GPU", "GPU", "GPU", "GPU", "CPU"]  # a finding-less job: as before
    assert (by["a"].last_step, by["a"].workers, by["a"].step_time_us) == (499, 7, 200_000.0)
    assert RECENT_STEPS == 100  # the step time is the recent one, not the job's whole history (median 100 ms)
    assert (by["b"].open_incidents, by["b"].findings, by["b"].windows, by["b"].gpu_hours_per_day) == (1, 2, 1, 2.0)
    assert (by["c"].open_incidents, by["c"].gpu_hours_per_day, by["c"].last_step) == (1, 50.0, None)
    assert by["d"].ended and not by["a"].ended and by["d"].open_incidents == 0
    assert [j.job for j in fetch_jobs(lambda sql, params=None: query(path, sql, params), job="b")] == ["b"]
    assert len(fetch_jobs(lambda sql, params=None: query(path, sql, params), limit=2)) == 2
    # a job with a finding from before device_kind (or a GPU worker's) keeps GPU-hours
    store = FindingsStore(path)
    store.write(Batch([fnd("e2", job="e", window_="w9", steps=(300, 301), gpu_hours=1.0)], [], {}))
    store.close()
    (e,) = fetch_jobs(lambda sql, params=None: query(path, sql, params), job="e")
    assert e.hours_unit == "GPU"
