import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from lockstep.schemas import export
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    DEAD_LETTER_REASONS,
    RECORD_TYPES,
    Evidence,
    FeatureBatch,
    Finding,
    Impact,
    ProfileTrigger,
    RecordError,
    StepHeartbeat,
    WindowReport,
    WorkerMeta,
    decode,
    encode,
    finding_id,
)
from tests.tiers import examples


def _table():
    return ft.make_table(
        {
            "function": ["fwd", "nccl:all_reduce"],
            "kind": ["compute", "collective"],
            "calls": [3, 1],
            "total_us": [100.0, 50.0],
            "critical_us": [100.0, 50.0],
        }
    )


def _batch(**kw):
    args = dict(
        job="j",
        window="w10",
        step=11,
        window_start=10,
        window_steps=4,
        expected_workers=2,
        worker=WorkerMeta(rank=1, host="h1", labels={"pp": "0"}),
        step_time_us=1000.0,
        functions=ft.pack(_table()),
    )
    args.update(kw)
    return FeatureBatch(**args)


def _finding():
    return Finding(
        id="x",
        job="j",
        window="w1",
        steps=[1, 2],
        scope="worker",
        workers=[3],
        hosts=["h"],
        devices=["h/gpu3"],
        function="fwd",
        function_kind="compute",
        cause="gpu_slow",
        confidence=0.9,
        evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=2.4),
        policy="p@h",
        created_at=1.0,
    )


@pytest.mark.parametrize(
    "record",
    [
        StepHeartbeat(job="j", worker=3, step=7, step_time_s=0.25, host="h", sent_at=1.5),
        ProfileTrigger(
            job="j", window="w9", start_step=9, steps=8, expected_workers=64, policy="default", policy_hash="abc"
        ),
        _batch(),
        _finding(),
        WindowReport(
            job="j",
            window="w",
            start_step=1,
            steps=8,
            steps_seen=8,
            expected_workers=4,
            workers_seen=4,
            coverage=1.0,
            bytes_per_worker=10.0,
            findings=1,
            actionable=True,
            reached_device=True,
            closed="complete",
            closed_at=2.0,
        ),
    ],
)
def test_round_trip(record):
    data = encode(record)
    assert decode(data) == record
    # binary-carrying records are MessagePack, the rest JSON
    assert (data[:1] == b"{") == (type(record).__name__ not in ("FeatureBatch", "StepReport"))


def test_feature_batch_carries_a_readable_function_table():
    back = decode(encode(_batch()))
    t = ft.unpack(back.functions, back.functions_codec)
    assert t.column("function").to_pylist() == ["fwd", "nccl:all_reduce"]
    assert t.column("resource").to_pylist() == ["gpu", "nic"]  # defaulted from the kind
    assert math.isnan(t.column("sm_clock_mhz")[0].as_py())  # optional hardware columns are null-filled


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "malformed"),
        (b"\x00\x01garbage", "malformed"),
        (b"{not json", "malformed"),
        (b'{"schema": "Nope", "v": 1}', "unknown_schema"),
        (b'{"schema": "StepHeartbeat", "v": 99}', "unsupported_version"),
        (b'{"schema": "StepHeartbeat", "v": 1, "job": "j"}', "invalid"),
        (
            b'{"schema":"StepHeartbeat","v":1,"job":"j","worker":1,"step":2,"step_time_s":-1,"host":"h","sent_at":0}',
            "invalid",
        ),
        (
            b'{"schema":"StepHeartbeat","v":1,"job":"j","worker":-1,"step":2,"step_time_s":1,"host":"h","sent_at":0}',
            "invalid",
        ),
    ],
)
def test_bad_records_are_rejected_with_a_reason(data, reason):
    with pytest.raises(RecordError) as exc:
        decode(data)
    assert exc.value.reason == reason
    assert exc.value.reason in DEAD_LETTER_REASONS


def test_wrong_record_for_the_topic():
    with pytest.raises(RecordError) as exc:
        decode(encode(_finding()), FeatureBatch)
    assert exc.value.reason == "wrong_record"


def test_step_outside_its_window_is_invalid():
    with pytest.raises(RecordError) as exc:
        decode(encode(_batch(step=20)))
    assert exc.value.reason == "invalid" and "outside window" in str(exc.value)


@pytest.mark.parametrize(
    "columns,needle",
    [
        ({"function": ["a"], "kind": ["compute"], "calls": [1], "total_us": [1.0]}, "lacks required"),
        (
            {"function": ["a"], "kind": ["warp"], "calls": [1], "total_us": [1.0], "critical_us": [1.0]},
            "unknown function kind",
        ),
        ({"function": ["a"], "kind": ["compute"], "calls": [1], "total_us": [-1.0], "critical_us": [1.0]}, "total_us"),
        (
            {"function": ["a"], "kind": ["compute"], "calls": [1], "total_us": [float("nan")], "critical_us": [1.0]},
            "total_us",
        ),
        (
            {
                "function": ["a", "a"],
                "kind": ["compute"] * 2,
                "calls": [1, 1],
                "total_us": [1.0, 1.0],
                "critical_us": [1.0, 1.0],
            },
            "unique",
        ),
    ],
)
def test_function_table_contract(columns, needle):
    import pyarrow as pa

    with pytest.raises(RecordError) as exc:
        ft.unpack(ft.pack(pa.table(columns)))
    assert exc.value.reason == "bad_function_table"
    assert needle in str(exc.value)


def test_truncated_arrow_payload_is_a_bad_function_table():
    packed = ft.pack(_table(), codec="none")
    with pytest.raises(RecordError) as exc:
        ft.unpack(packed[: len(packed) // 2], codec="none")
    assert exc.value.reason == "bad_function_table"


@hsettings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=512))
def test_garbage_never_escapes_as_another_exception(data):
    try:
        decode(data)
    except RecordError:
        pass


@hsettings(max_examples=examples(150), deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["schema", "v", "job", "worker", "step", "step_time_s", "host", "sent_at", "functions"]),
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.floats(),
            st.text(max_size=8),
            st.none(),
            st.sampled_from(list(RECORD_TYPES)),
        ),
    )
)
def test_structured_garbage_is_rejected_cleanly(obj):
    for data in (msgspec.json.encode(obj), msgspec.msgpack.encode(obj)):
        try:
            decode(data)
        except RecordError:
            pass


def test_finding_ids_are_deterministic_and_distinguish_culprits():
    a = finding_id("j", "w1", "worker", [3, 1], "fwd", "gpu_slow", None)
    assert a == finding_id("j", "w1", "worker", [1, 3], "fwd", "gpu_slow", None)
    assert a != finding_id("j", "w1", "worker", [1, 4], "fwd", "gpu_slow", None)
    assert a != finding_id("j", "w2", "worker", [1, 3], "fwd", "gpu_slow", None)


def test_published_schemas_match_the_code():
    for rel, content in export.expected_files().items():
        path = export.HERE / rel
        want = content.encode() if isinstance(content, str) else content
        assert path.read_bytes() == want, f"{rel} is stale: run `lockstep schemas`"


def test_json_schema_describes_required_finding_fields():
    import json

    schema = json.loads((export.HERE / "json" / "Finding.json").read_text())
    props = schema["$defs"]["Finding"]["properties"]
    for field in (
        "id",
        "job",
        "window",
        "steps",
        "scope",
        "workers",
        "hosts",
        "devices",
        "group",
        "function",
        "function_kind",
        "cause",
        "confidence",
        "evidence",
        "impact",
        "policy",
        "created_at",
    ):
        assert field in props, field


def test_hardware_and_device_causes_are_causes():
    from lockstep.schemas.records import CAUSES, DEVICE_CAUSES, HARDWARE_CAUSES

    assert DEVICE_CAUSES < HARDWARE_CAUSES < set(CAUSES)
    assert {"dataloader", "regression", "unknown"}.isdisjoint(HARDWARE_CAUSES)


def test_a_heartbeat_echoes_its_trigger_only_with_both_fields():
    from lockstep.schemas.records import Echo, StepHeartbeat

    base = dict(job="j", worker=3, step=1, step_time_s=0.1, host="h", sent_at=1.0)
    assert StepHeartbeat(**base).echo() is None
    assert StepHeartbeat(**base, trigger_window="w1").echo() is None
    assert StepHeartbeat(**base, trigger_window="w1", trigger_latency_s=0.5).echo() == Echo(
        worker=3, window="w1", latency_s=0.5
    )


def test_every_deprecated_path_is_in_the_contracts_doc_with_its_removal():
    """docs/contracts.md (the README links it) lists every deprecated path with the version that removes it."""
    from lockstep.schemas.records import DEPRECATED
    from tests.paths import ROOT

    contracts = (ROOT / "docs" / "contracts.md").read_text()
    section = contracts[contracts.index("**Deprecated, removed in") :].split("\n## ")[0]
    assert {version for version, _ in DEPRECATED.values()} == {"0.2"}
    for name in ("`StepHeartbeat` keyed by job", "`FeatureBatch`", "`DetectorTick`", "rule: median"):
        assert name in section
    assert len(DEPRECATED) == section.count("| 0.2 |")


def test_device_kind_of_workers_and_findings_without_it():
    from lockstep.schemas.records import device_kind_of

    assert device_kind_of(["vm/cpu", "vm/cpu", "cpu"]) == "cpu"
    assert device_kind_of(["vm/cpu", "vm/gpu0"]) == device_kind_of(["host3/gpu5"]) == "gpu"
    assert device_kind_of(["", ""]) == device_kind_of([]) == ""
    # a finding written before the field reads as not known (the page then judges by the devices named)
    old = msgspec.json.encode({k: v for k, v in msgspec.to_builtins(_finding()).items() if k != "device_kind"})
    assert decode(old).device_kind == ""


def test_a_refusal_echo_survives_batching_and_an_accepted_echo_stays_small():
    from lockstep.schemas.records import StepHeartbeat, batch_heartbeats

    beats = [
        StepHeartbeat(job="j", worker=w, step=5, step_time_s=0.1, host="h", sent_at=1.0, **extra)
        for w, extra in enumerate(
            [
                {"trigger_window": "w9", "trigger_latency_s": 2.0, "trigger_refused": "past"},
                {"trigger_window": "w9", "trigger_latency_s": 0.5},
            ]
        )
    ]
    ((_, batch),) = batch_heartbeats(beats, 256)
    again = decode(encode(batch)).heartbeats()
    assert [(hb.trigger_refused, hb.echo().refused) for hb in again] == [("past", "past"), (msgspec.UNSET, "")]
    assert b"trigger_refused" not in msgspec.json.encode(again[1])


def test_a_workers_echoes_in_one_batch_come_back_on_its_own_heartbeats_in_order():
    """An agent echoes one trigger a heartbeat; two triggers (a refusal, then a receipt) in one flush are two echoes
    of the same worker in one batch, and reading the batch as heartbeats keeps both (it kept the last one)."""
    from lockstep.schemas.records import StepHeartbeat, batch_heartbeats

    echoes = [
        {"trigger_window": "w-past", "trigger_latency_s": 0.1, "trigger_refused": "past"},
        {},
        {"trigger_window": "w1", "trigger_latency_s": 0.2},
    ]
    beats = [
        StepHeartbeat(job="j", worker=3, step=s, step_time_s=0.1, host="h", sent_at=1.0 + s, **extra)
        for s, extra in enumerate(echoes)
    ]
    ((_, batch),) = batch_heartbeats(beats, 256)
    again = decode(encode(batch)).heartbeats()
    assert [(hb.trigger_window, hb.trigger_refused) for hb in again if isinstance(hb.trigger_window, str)] == [
        ("w-past", "past"),
        ("w1", msgspec.UNSET),
    ]
