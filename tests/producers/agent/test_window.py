"""From summaries to the window's feature record: clock alignment, window bounds, the agent's own threads."""

import numpy as np
import pyarrow as pa

from lockstep.producers.agent.window import (
    clock_offset_us,
    to_trace_clock,
    window_features,
    without_thread_events,
    without_threads,
)
from lockstep.schemas import functions as ft
from lockstep.schemas.events import OP_EVENT_SCHEMA, SAMPLE_SCHEMA
from lockstep.schemas.records import ProfileTrigger, Sampling, WorkerMeta


class Summary:  # the shape issue 4's summarise() returns
    def __init__(self, step, functions, step_time_us=1000.0):
        self.worker, self.step, self.step_time_us, self.functions = 1, step, step_time_us, functions


def table(names):
    return ft.make_table(
        {
            "function": names,
            "kind": ["python"] * len(names),
            "calls": [1] * len(names),
            "total_us": [10.0] * len(names),
            "critical_us": [10.0] * len(names),
        }
    )


def test_samples_move_onto_the_traces_clock():
    bounds = {5: (1000.0, 2000.0), 6: (2000.0, 3000.0)}
    unix = {5: 1.7e15 + 10.0, 6: 1.7e15 + 1012.0, 7: 1.7e15 + 2000.0}
    off = clock_offset_us(bounds, unix)
    assert off == np.median([1000.0 - unix[5], 2000.0 - unix[6]])
    samples = pa.table(
        {"worker": [1], "t_us": [1.7e15 + 500.0], "metric": ["cpu_self"], "value": [1.0]}, schema=SAMPLE_SCHEMA
    )
    assert to_trace_clock(samples, off).column("t_us").to_pylist() == [1.7e15 + 500.0 + off]
    assert (
        to_trace_clock(samples, clock_offset_us(bounds, {})).num_rows == 0
    )  # no common step: no samples rather than wrong ones


def test_one_record_with_every_step_of_the_window():
    trig = ProfileTrigger(
        job="j",
        window="w",
        start_step=5,
        steps=2,
        expected_workers=4,
        sampling=Sampling(),
        policy="p",
        policy_hash="h",
        shard_workers=2,
    )
    meta = WorkerMeta(rank=3, host="h1")
    summaries = [
        Summary(4, table(["a"])),
        Summary(6, table(["a"])),
        Summary(5, table(["train.py(3): f", "aten::mm"])),
        Summary(7, table(["a"])),
    ]
    r = window_features(summaries, trig, meta, "host", now=1.0)
    assert (r.job, r.window, r.window_start, r.window_steps, r.expected_workers, r.policy, r.hardware) == (
        "j",
        "w",
        5,
        2,
        4,
        "p@h",
        "host",
    )
    assert (r.steps, r.step_time_us, r.shard, r.shard_workers) == ([5, 6], [1000.0, 1000.0], 1, 2)
    t = ft.read_compact(r.functions)
    assert t.column("step").to_pylist() == [5, 5, 6] and t.column("function").to_pylist() == [
        "train.py(3): f",
        "aten::mm",
        "a",
    ]
    assert t.schema.field("function").type == ft.DICTIONARY  # names once per record
    # what the diagnosis never reads is not sent; optional columns without a value neither
    assert (
        "p50_us" not in t.column_names and "sm_clock_mhz_sd" not in t.column_names and "nic_gbps" not in t.column_names
    )
    assert window_features([Summary(9, table(["a"]))], trig, meta, "host") is None


def test_the_agents_own_threads_leave_the_trace():
    trace = {
        "traceEvents": [{"tid": 1, "name": "train"}, {"tid": 2, "name": "lockstep sampler"}, {"tid": 3, "name": "x"}]
    }
    assert [e["tid"] for e in without_threads(trace, frozenset({2}))["traceEvents"]] == [1, 3]
    n = 4
    events = pa.table(
        {
            "worker": [0] * n,
            "step": [1] * n,
            "function": ["a", "b", "c", "d"],
            "kind": ["python"] * n,
            "start_us": [0.0] * n,
            "duration_us": [1.0] * n,
            "stream": ["7/1", "7/2", None, "7/12"],
        }
    ).cast(
        pa.schema(
            [
                OP_EVENT_SCHEMA.field(c)
                for c in ("worker", "step", "function", "kind", "start_us", "duration_us", "stream")
            ]
        )
    )
    assert without_thread_events(events, frozenset({2})).column("function").to_pylist() == ["a", "c", "d"]


def test_the_workers_tcp_connections_ride_with_its_window_the_busiest_when_too_many():
    from lockstep.schemas.events import CONNECTION_SCHEMA, connection_table
    from lockstep.schemas.records import MAX_CONNECTIONS, WindowFeatures, decode, encode

    trig = ProfileTrigger(job="j", window="w", start_step=5, steps=1, expected_workers=4, sampling=Sampling())
    meta = WorkerMeta(rank=3, host="h1")
    n = MAX_CONNECTIONS + 10
    conns = pa.Table.from_pylist(
        [
            dict(worker=3, local=f"10.0.0.4:{1000 + i}", peer=f"10.0.0.1:{2000 + i}", segs_out=i, retrans=i // 100)
            for i in range(n)
        ],
        schema=CONNECTION_SCHEMA,
    )
    r = decode(
        encode(window_features([Summary(5, table(["a"]))], trig, meta, "host", connections=conns)), WindowFeatures
    )
    assert len(r.connections) == MAX_CONNECTIONS
    assert min(c.segs_out for c in r.connections) == n - MAX_CONNECTIONS  # the ones that sent least left out
    back = connection_table([3], [r.connections])
    assert back.schema == CONNECTION_SCHEMA and back.column("worker").unique().to_pylist() == [3]
    assert window_features([Summary(5, table(["a"]))], trig, meta, "host").connections == []
