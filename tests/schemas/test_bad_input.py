"""Properties of the contracts under bad input: decoding is total (a record or a RecordError with a
reason, nothing else), and whatever decoding accepts the findings store can keep."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    DEAD_LETTER_REASONS,
    RECORD_TYPES,
    Evidence,
    Finding,
    Impact,
    ProfileTrigger,
    RecordError,
    StepHeartbeat,
    WindowReport,
    decode,
    encode,
    finding_id,
)
from lockstep.sinks.store import Batch, FindingsStore
from tests.tiers import examples

ABSURD = st.one_of(
    st.sampled_from(
        [
            math.nan,
            math.inf,
            -math.inf,
            -1,
            0,
            2**31,
            2**63 - 1,
            2**64 - 1,
            -(2**63),
            3.5e16,
            -9.2e18,
            "",
            None,
            [],
            {},
            True,
        ]
    ),
    st.floats(allow_nan=True),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=6),
)


def _accepts(data: bytes) -> object | None:
    try:
        return decode(data)
    except RecordError as err:
        assert err.reason in DEAD_LETTER_REASONS and err.detail
        return None


@given(st.binary(max_size=512))
def test_decode_of_any_bytes_is_a_record_or_a_record_error(data):
    _accepts(data)  # anything else raised fails the test


@given(
    schema=st.sampled_from(sorted(RECORD_TYPES)),
    fields=st.dictionaries(st.text(max_size=12), ABSURD, max_size=6),
    v=st.one_of(st.just(1), st.integers(-(2**63), 2**64 - 1)),
    msgpack=st.booleans(),
)
def test_decode_of_any_object_with_a_record_header_is_a_record_or_a_record_error(schema, fields, v, msgpack):
    obj = {**fields, "schema": schema, "v": v}
    _accepts(msgspec.msgpack.encode(obj) if msgpack else msgspec.json.encode(obj))


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":' * 100_000,  # JSON nested 100,000 deep: msgspec's recursion guard raised RecursionError
        b'{"schema": "StepHeartbeat", "v": 1, "x": ' + b"[" * 100_000,
        b"\x81\xa1a" * 100_000 + b"\xc0",  # the same in MessagePack
        msgspec.msgpack.encode({"schema": "FeatureBatch", "v": 1})[:-1] + b"\x91" * 100_000,
    ],
    ids=["json", "json-in-record", "msgpack", "msgpack-in-record"],
)
def test_a_record_nested_too_deeply_is_malformed_not_a_recursion_error(data):
    with pytest.raises(RecordError) as err:
        decode(data)
    assert err.value.reason == "malformed"


def test_a_record_larger_than_any_record_is_refused_before_parsing():
    from lockstep.schemas.records import MAX_RECORD_BYTES

    with pytest.raises(RecordError, match="over the"):
        decode(b'{"schema": "StepHeartbeat", "pad": "' + b"x" * MAX_RECORD_BYTES + b'"}')


FINDING = Finding(
    id=finding_id("j", "w1", "worker", [3], "fwd.gemm", "gpu_slow", None),
    job="j",
    window="w1",
    steps=[10, 11],
    scope="worker",
    workers=[3],
    hosts=["h"],
    devices=["h/gpu3"],
    function="fwd.gemm",
    function_kind="compute",
    cause="gpu_slow",
    confidence=0.9,
    evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=9.0)],
    impact=Impact(step_time_share=0.1, gpu_hours_per_day=2.0),
    policy="p@h",
    created_at=1.8e9,
    window_steps=2,
)
WINDOW = WindowReport(
    job="j",
    window="w1",
    start_step=10,
    steps=2,
    steps_seen=2,
    expected_workers=8,
    workers_seen=8,
    coverage=1.0,
    bytes_per_worker=10.0,
    findings=1,
    actionable=True,
    reached_device=True,
    closed="complete",
    closed_at=1.8e9,
)
TRIGGER = ProfileTrigger(job="j", window="w1", start_step=10, steps=2, expected_workers=8, created_at=1.8e9)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = FindingsStore(tmp_path_factory.mktemp("store") / "f.duckdb")
    yield s
    s.close()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=st.sampled_from([FINDING, WINDOW, TRIGGER]), data=st.data())
def test_what_the_sink_decodes_the_store_keeps(store, record, data):
    """A record the sink accepts with a field (or a nested one) set to an absurd value: the DuckDB write succeeds."""
    d = msgspec.to_builtins(record)
    target = d["impact"] if isinstance(record, Finding) and data.draw(st.booleans()) else d
    key = data.draw(st.sampled_from(sorted(k for k in target if k != "schema")))
    target[key] = data.draw(st.one_of(ABSURD, st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3)))
    rec = _accepts(msgspec.msgpack.encode(d))
    if rec is None:
        return
    store.write(
        Batch(
            findings=[rec] if isinstance(rec, Finding) else [],
            windows=[rec] if isinstance(rec, WindowReport) else [],
            offsets={},
            triggers=[rec] if isinstance(rec, ProfileTrigger) else [],
        )
    )


TABLE = ft.make_table(
    {
        "function": ["a", "b", "c"],
        "kind": ["compute", "collective", "python"],
        "calls": [1, 2, 3],
        "total_us": [10.0, 20.0, 5.0],
        "critical_us": [10.0, 15.0, 5.0],
        "wait_us": [0.0, 5.0, float("nan")],
    }
)


@given(cut=st.integers(0, 10_000), codec=st.sampled_from(["zstd", "none"]))
def test_a_truncated_function_table_is_a_bad_function_table(cut, codec):
    data = ft.pack(TABLE, codec)
    with pytest.raises(RecordError) as err:
        ft.unpack(data[: cut % len(data)], codec)
    assert err.value.reason == "bad_function_table"


@given(
    column=st.sampled_from(ft.REQUIRED + ("wait_us", "mean_us", "bytes", "resource")),
    row=st.integers(0, 2),
    v=st.sampled_from([-1.0, math.inf, -math.inf, "", None, "warp-drive"]),
)
def test_a_function_table_with_an_absurd_value_is_a_table_or_a_bad_function_table(column, row, v):
    col = TABLE.column(column).to_pylist()
    col[row] = v
    try:
        arr = pa.array(col, type=TABLE.schema.field(column).type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        arr = pa.array([str(x) for x in col])  # the wrong type altogether
    try:
        out = ft.unpack(ft.pack(TABLE.set_column(TABLE.column_names.index(column), column, arr)))
    except RecordError as err:
        assert err.reason == "bad_function_table"
        return
    for name in ("total_us", "critical_us"):  # what passes is what the diagnosis may rely on
        assert np.all(np.isfinite(out.column(name).to_numpy())) and np.all(out.column(name).to_numpy() >= 0)


def test_out_of_range_steps_and_timestamps_are_invalid():
    hb = StepHeartbeat(job="j", worker=0, step=1, step_time_s=0.1, host="h", sent_at=1.8e9)
    for field, bad in [
        ("step", 2**31),
        ("step", -1),
        ("sent_at", math.nan),
        ("sent_at", 5e9),
        ("sent_at", -1.0),
        ("worker", 10**8),
    ]:
        with pytest.raises(RecordError) as err:
            decode(msgspec.msgpack.encode(msgspec.to_builtins(hb) | {field: bad}))
        assert err.value.reason == "invalid", field


def test_numpy_scalars_left_in_a_record_encode_as_their_values():
    """The diagnosis is numpy: a np.str_ or np.int64 that reaches a record must not stop the stage that encodes it."""
    f = msgspec.structs.replace(
        FINDING, function=np.str_("fwd.gemm"), function_kind=np.str_("compute"), workers=[np.int64(3)]
    )
    assert decode(encode(f)) == FINDING


@settings(max_examples=examples(60), deadline=None)
@given(
    spoilt=st.lists(
        st.tuples(
            st.integers(0, 7),
            st.sampled_from(["total_us", "critical_us", "wait_us", "bytes", "calls", "kind", "resource", "function"]),
            st.integers(0, 2),
            st.sampled_from([-1.0, math.inf, math.nan, None, "quantum", "a"]),
        ),
        max_size=4,
    )
)
def test_the_whole_step_check_finds_exactly_the_tables_the_single_check_refuses(spoilt):
    """ft.check_tables (one pass over a step's tables) agrees with ft.conform (one table) on every table."""
    tables = [TABLE] * 8
    for i, column, row, v in spoilt:
        col = tables[i].column(column).to_pylist()
        col[row] = v
        try:
            arr = pa.array(col, type=TABLE.schema.field(column).type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            continue
        tables[i] = pa.Table.from_arrays(
            tables[i].set_column(TABLE.column_names.index(column), column, arr).columns, schema=ft.SCHEMA
        )
    got = ft.check_tables(tables)
    for table, err in zip(tables, got):
        try:
            ft.conform(table)
            assert err is None
        except RecordError as want:
            assert err is not None and (err.reason, err.detail) == (want.reason, want.detail)
