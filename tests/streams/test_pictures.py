"""What the processor publishes for the pictures: step-time series from heartbeats, deviation maps from step results."""

from types import SimpleNamespace

import pyarrow as pa

from lockstep.schemas.records import StepHeartbeat, decode, encode
from lockstep.sinks.report.page import significance
from lockstep.streams.diagnosis.step import OUTLIER_SCHEMA, WORKER_SCHEMA
from lockstep.streams.pictures import SeriesBuilder, deviation_map


def hb(job, worker, step, t, tenant=""):
    return StepHeartbeat(
        job=job, worker=worker, step=step, step_time_s=t, host="h", sent_at=1_800_000_000.0, tenant=tenant
    )


def test_a_step_is_emitted_once_complete_with_the_slowest_and_the_median_worker():
    b = SeriesBuilder(lag_steps=2, flush_s=0.0)
    for step in range(5):
        for w in range(4):
            b.add(hb("j", w, step, 0.1 + (0.05 if w == 3 and step >= 2 else 0.0), tenant="acme"), now=100.0)
    (rec,) = b.due(now=100.0)
    assert rec.steps == [0, 1, 2] and rec.tenant == "acme"  # steps 3 and 4 may still get heartbeats
    assert (
        rec.step_time_us == [100_000.0, 100_000.0, 150_000.0]
        and rec.median_us == [100_000.0] * 3
        and rec.workers == [4, 4, 4]
    )
    assert decode(encode(rec)) == rec
    b.add(hb("j", 0, 1, 9.9), now=101.0)  # a heartbeat for a step already emitted is late: counted, not re-emitted
    assert b.late == 1
    (rest,) = b.due(now=200.0)  # old enough: the last steps close even without later ones
    assert rest.steps == [3, 4] and rest.step_time_us == [150_000.0, 150_000.0]
    assert b.due(now=300.0) == []


def test_records_come_every_flush_interval_and_jobs_can_be_dropped():
    b = SeriesBuilder(lag_steps=0, flush_s=2.0)
    b.add(hb("a", 0, 0, 0.1), now=0.0)
    b.add(hb("b", 0, 0, 0.1), now=0.0)
    assert {r.job for r in b.due(now=0.0)} == {"a", "b"}
    b.add(hb("a", 0, 1, 0.1), now=0.5)
    assert b.due(now=1.0) == []  # within the interval: points wait
    b.drop(["a"])
    b.add(hb("b", 0, 1, 0.1), now=1.5)
    assert [r.job for r in b.due(now=2.5)] == ["b"]


def result(rows):
    cols = {f.name: [] for f in OUTLIER_SCHEMA}
    for worker, function, z in rows:
        for name in cols:
            cols[name].append({"worker": worker, "function": function, "z": z}.get(name))
    return SimpleNamespace(outliers=pa.Table.from_pydict(cols, schema=OUTLIER_SCHEMA))


def test_the_deviation_map_keeps_the_persistent_worst_cells_with_the_median_z():
    steps = [
        result([(13, "bwd.gemm", 10.0 + s), (13, "fwd.gemm", 6.0), (29, "fwd.loss", 119.0 if s == 0 else None)])
        for s in range(8)
    ]
    steps[3] = result([(13, "bwd.gemm", 12.0), (7, "fwd.gemm", -5.0)])
    m = deviation_map("j", "w1", "acme", 8, 8, steps, now=1.0, max_workers=2, max_functions=2)
    # worker 13 deviated in every step; worker 29's one spike outranks worker 7's single -5 but not worker 13
    assert m.workers == [13, 29] and m.functions == ["bwd.gemm", "fwd.gemm"]
    assert m.z[0] == [13.0, 6.0] and m.flagged[0] == [8, 7]  # median of 10..17 with step 3 at 12; fwd.gemm in 7 steps
    assert m.z[1] == [None, None]  # worker 29's fwd.loss did not make the two columns
    assert (m.workers_total, m.functions_total) == (3, 3)
    assert decode(encode(m)) == m
    assert deviation_map("j", "w1", "", 8, 8, [result([])], now=1.0).workers == []


def small_group_step(s: int) -> SimpleNamespace:
    """Step ``s`` of a 2-worker job (peers compared by ratio): worker 1 spends 30 ms more in ``preprocess`` in
    every step; worker 0's ``log_metrics`` spikes once, 3 ms over a peer's 0.3 µs (a rise of 10,000x); each worker's
    own work varies by about 2% from step to step."""
    jitter = [1.0, 1.02, 0.98, 1.01, 0.99, 1.02, 0.98, 1.0][s]
    own = {0: 100_000.0 * jitter, 1: 130_000.0 / jitter}
    rows = [(1, "preprocess", 0.3, 30_000.0)] + ([(0, "log_metrics", 10_000.0, 3_000.0)] if s == 3 else [])
    cols = {f.name: [] for f in OUTLIER_SCHEMA}
    for worker, function, rise, excess in rows:
        row = {"worker": worker, "function": function, "signal": "ratio", "z": rise, "excess_us": excess}
        row["step_time_us"] = 135_000.0
        for name in cols:
            cols[name].append(row.get(name))
    workers = pa.Table.from_pydict(
        {
            "worker": [0, 1],
            "host": ["h0", "h1"],
            "device": ["h0/gpu0", "h1/gpu0"],
            "group": ["", ""],
            "step_time_us": [135_000.0] * 2,
            "own_us": [own[0], own[1]],
            "peer_own_us": [own[1], own[0]],
            "wait_us": [30_000.0, 1_000.0],
            "peer_wait_us": [1_000.0, 30_000.0],
            "function": ["log_metrics", "preprocess"],
            "kind": ["python", "python"],
            "work_us": [10.0, 40_000.0],
            "peer_work_us": [10.0, 10_000.0],
        },
        schema=WORKER_SCHEMA,
    )
    return SimpleNamespace(
        outliers=pa.Table.from_pydict(cols, schema=OUTLIER_SCHEMA), workers=workers, groups=None, step=8 + s
    )


def test_small_groups_cells_read_in_standard_errors_so_a_held_rise_outranks_a_one_step_spike():
    m = deviation_map("j", "w1", "", 8, 8, [small_group_step(s) for s in range(8)], now=1.0)
    z = {(w, f): (m.z[i][j], m.flagged[i][j]) for i, w in enumerate(m.workers) for j, f in enumerate(m.functions)}
    rise, rise_held = z[(1, "preprocess")]
    spike, spike_held = z[(0, "log_metrics")]
    assert (rise_held, spike_held) == (8, 1)
    # 30 ms over a 100 ms peer, the job's noise a few % step to step, held in 8 steps: many standard errors ...
    assert rise > 10
    # ... and the 10,000x spike of 3 ms in one step a few: no longer the bare rise
    assert 0 < spike < rise and spike < 10
    assert significance(rise, rise_held, 8) > significance(spike, spike_held, 8)
