"""Bad input on every input topic, against the running processor and sink (real broker, real processes).

Hypothesis generates garbage, truncated Arrow, wrong versions, wrong records and absurd field values;
an explicit list adds the cases that need context (steps and clocks from the future, NaN through
MessagePack, wrong-shaped step-report tables).  Every record must land in the dead-letter topic with
the reason its stage gives, and neither process may stop: afterwards a good window is still diagnosed.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import msgspec
import pyarrow as pa
import pytest
from confluent_kafka import Consumer, TopicPartition
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from lockstep.app.runtime import Pipeline
from lockstep.config import Settings
from lockstep.kafka import (
    Publisher,
    Topics,
    consumer_config,
    ensure_topics,
    features_key,
    producer_config,
    window_features_key,
)
from lockstep.metrics import value
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    RECORD_TYPES,
    DeadLetter,
    DetectorTick,
    FeatureBatch,
    Finding,
    ProfileTrigger,
    RecordError,
    StepHeartbeat,
    StepReport,
    StepSlice,
    TriggerRequest,
    WindowFeatures,
    WindowReport,
    WindowTimeout,
    decode,
    encode,
)
from lockstep.sinks.http import query
from lockstep.streams.app import changelog_topics
from lockstep.streams.diagnosis import StepFrame, analyze_step, step_report, step_result
from lockstep.streams.policy import load_policy
from lockstep.streams.stages.shard import step_slices
from lockstep.streams.stages.step import read_slice
from lockstep.streams.windows import Handle, ShardAssembler

pytestmark = pytest.mark.integration

POLICY = load_policy(None)
SCENARIO = Scenario(
    job="good-job",
    topology=Topology(workers=8, gpus_per_host=8),
    faults=(Fault(type="gpu_slow", workers=(3,), severity=0.4),),
)
FLEET = FleetSimulator(SCENARIO)
WINDOW = Window(60, 2)
BATCHES = {s: FLEET.feature_batches(FLEET.step(s), FLEET.trigger(WINDOW), sent_at=time.time()) for s in WINDOW.range}
WINDOW_FEATURES = FLEET.window_features(
    [FLEET.step(s) for s in WINDOW.range], FLEET.trigger(WINDOW), sent_at=time.time()
)


def good_step_report(step: int) -> StepReport:
    recs = BATCHES[step]
    frame = StepFrame.from_tables(
        SCENARIO.job,
        WINDOW.name,
        step,
        [b.worker for b in recs],
        [b.step_time_us for b in recs],
        [ft.unpack(b.functions) for b in recs],
        POLICY.diagnosis.peer_group_keys,
        [b.hardware for b in recs],
    )
    return step_report(
        analyze_step(frame, POLICY.diagnosis),
        window_start=WINDOW.start_step,
        window_steps=WINDOW.steps,
        expected_workers=8,
        bytes_in=1,
        policy=POLICY.ref,
        tenant="",
        closed="complete",
    )


#: one valid record of what each input topic carries (the field mutations start from these)
VALID = {
    "heartbeats": StepHeartbeat(job="hb-job", worker=1, step=5, step_time_s=0.2, host="h", sent_at=time.time()),
    "features": BATCHES[60][0],
    "windowfeatures": WINDOW_FEATURES[0],
    "stepreports": good_step_report(60),
    "findings": None,  # filled below from the good window's diagnosis
    "windows": WindowReport(
        job="j",
        window="w1",
        start_step=1,
        steps=2,
        steps_seen=2,
        expected_workers=2,
        workers_seen=2,
        coverage=1.0,
        bytes_per_worker=1.0,
        findings=0,
        actionable=False,
        reached_device=False,
        closed="complete",
        closed_at=time.time(),
    ),
    "control": FLEET.trigger(WINDOW, created_at=time.time()),
}
STAGE = {
    "heartbeats": "heartbeats",
    "features": "steps",
    "windowfeatures": "shards",
    "stepreports": "windows",
    "findings": "sink",
    "windows": "sink",
    "control": "sink",
}


def _finding() -> Finding:
    from lockstep.app.evaluate import diagnose_one

    return diagnose_one(FLEET, POLICY, WINDOW).findings[0]


VALID["findings"] = _finding()


def expected_reason(kind: str, payload: bytes) -> str | None:
    """What the stage that reads this topic says about the record (None: it accepts it)."""
    try:
        if kind == "heartbeats":
            decode(payload, (StepHeartbeat, DetectorTick, TriggerRequest))
        elif kind == "features":
            b = decode(payload, (FeatureBatch, StepSlice))
            if isinstance(b, StepSlice):
                read_slice(b)
            else:
                ft.unpack(b.functions, b.functions_codec)
        elif (
            kind == "windowfeatures"
        ):  # the shard stage's read, then its check of the shard's records at the shard's close
            w = decode(payload, WindowFeatures)
            shards: ShardAssembler = ShardAssembler(0.0)
            shards.add(w, ft.read_compact(w.functions, w.functions_codec), len(payload), Handle(0, 0, None), 0.0)
            errors = [
                err
                for shard in shards.expire(1.0)
                for _, err in step_slices(shard.pending, POLICY.diagnosis.peer_group_keys)[1]
            ]
            if errors:
                return errors[0].reason
        elif kind == "stepreports":
            r = decode(payload, (StepReport, WindowTimeout))
            if isinstance(r, StepReport):
                step_result(r)
        else:
            try:
                decode(payload, (Finding, WindowReport, ProfileTrigger))
            except RecordError as err:
                if kind == "control" and err.reason == "wrong_record":
                    return None  # other control records are skipped, not dead letters
                raise
    except RecordError as err:
        return err.reason
    return None


# ------------------------------------------------------------------------------------- strategies

ABSURD = st.one_of(
    st.sampled_from(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            -1,
            -1e9,
            0,
            2**63 - 1,
            2**64 - 1,
            -(2**63),
            "",
            "x" * 300,
            None,
            [],
            {},
            True,
        ]
    ),
    st.floats(allow_nan=True),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=8),
)
KINDS = st.sampled_from(sorted(STAGE))


@st.composite
def field_mutation(draw, kind: str) -> bytes:
    """A valid record of the topic with one field (or one WorkerMeta field) set to an absurd value;
    MessagePack keeps NaN and infinities, JSON cannot carry them (they become null)."""
    d = msgspec.to_builtins(VALID[kind])
    target = d
    if kind in ("features", "windowfeatures") and draw(st.booleans()):
        target = d["worker"]
    key = draw(st.sampled_from(sorted(k for k in target if k != "schema")))
    target[key] = draw(ABSURD)
    if draw(st.booleans()) or kind in ("features", "windowfeatures", "stepreports"):
        return msgspec.msgpack.encode(d)
    return msgspec.json.encode(d)


@st.composite
def table_mutation(draw, kind: str = "features") -> bytes:
    """A feature batch (or a worker's window features) whose function table has one column broken: absurd values,
    a wrong type, or gone."""
    b = BATCHES[60][draw(st.integers(0, 7))] if kind == "features" else WINDOW_FEATURES[draw(st.integers(0, 7))]
    t = ft.unpack(b.functions) if kind == "features" else ft.read_compact(b.functions)
    name = draw(st.sampled_from(t.column_names))
    how = draw(st.sampled_from(["value", "type", "drop"]))
    if how == "drop":
        t = t.drop_columns([name])
    elif how == "type":
        t = t.set_column(t.column_names.index(name), name, pa.array([draw(st.text(max_size=4))] * t.num_rows))
    else:
        typ = t.schema.field(name).type
        v = draw(
            st.sampled_from([float("nan"), float("inf"), -1.0, -1e30])
            if pa.types.is_floating(typ)
            else st.sampled_from([-1, -(2**31)])
            if pa.types.is_signed_integer(typ)
            else st.sampled_from(["", "gpu!", None])
        )
        col = t.column(name).to_pylist()
        col[draw(st.integers(0, len(col) - 1))] = v
        t = t.set_column(
            t.column_names.index(name),
            name,
            pa.array(col, type=typ if not pa.types.is_dictionary(typ) else pa.string()),
        )
    return encode(msgspec.structs.replace(b, functions=ft.pack(t)))


@st.composite
def truncated_arrow(draw) -> bytes:
    """A feature batch whose Arrow payload is cut short: inside the zstd frame, or inside the IPC stream."""
    b = BATCHES[60][draw(st.integers(0, 7))]
    if draw(st.booleans()):
        return encode(msgspec.structs.replace(b, functions=b.functions[: draw(st.integers(0, len(b.functions) - 1))]))
    raw = ft.pack(ft.unpack(b.functions), codec="none")
    return encode(
        msgspec.structs.replace(b, functions=raw[: draw(st.integers(0, len(raw) - 1))], functions_codec="none")
    )


@st.composite
def wrong_version(draw) -> bytes:
    name = draw(st.sampled_from(sorted(RECORD_TYPES)))
    v = draw(st.integers(-(2**31), 2**31).filter(lambda v: v != 1))
    return msgspec.json.encode({"schema": name, "v": v, "job": "j"})


@st.composite
def bad_record(draw) -> tuple[str, bytes]:
    kind = draw(KINDS)
    payload = draw(
        st.one_of(
            st.binary(max_size=64),  # garbage
            st.from_type(bool)
            .map(lambda _: b"{")
            .flatmap(lambda p: st.text(max_size=40).map(lambda s: p + s.encode())),  # broken JSON
            st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=4).map(
                msgspec.json.encode
            ),  # objects without a record header
            wrong_version(),
            st.sampled_from([encode(r) for r in VALID.values()]),  # a valid record, on a topic that may not carry it
            field_mutation(kind),
            table_mutation(kind) if kind in ("features", "windowfeatures") else field_mutation(kind),
            truncated_arrow() if kind == "features" else wrong_version(),
        )
    )
    return kind, payload


# ------------------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    settings: Settings
    topics: Topics
    pipeline: Pipeline
    publisher: Publisher
    dead: list[tuple[bytes, DeadLetter]]

    def send(self, records: list[tuple[str, bytes, bytes]]) -> None:
        for kind, key, payload in records:
            self.publisher.send_raw(getattr(self.topics, kind), key, payload)
        self.publisher.flush()

    def wait_dead(self, keys: set[bytes], timeout_s: float = 60.0) -> dict[bytes, DeadLetter]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = {k: d for k, d in list(self.dead) if k in keys}
            if len(got) == len(keys):
                return got
            self.pipeline.children["processor"].healthy()  # raises if it died
            self.pipeline.children["sink"].healthy()
            time.sleep(0.1)
        missing = keys - {k for k, _ in self.dead}
        raise AssertionError(f"no dead letter for {len(missing)} record(s): {sorted(missing)[:5]}")


@pytest.fixture(scope="module")
def rig(kafka_bootstrap, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    tag = uuid.uuid4().hex[:8]
    s = Settings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"b{tag}",
        processor_id=f"proc-{tag}",
        sink_group=f"sink-{tag}",
        partitions=3,
        db=tmp / "findings.duckdb",
        step_timeout_s=5.0,
        window_timeout_s=10.0,
    )
    topics = ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
    pipeline = Pipeline(s, tmp)
    dead: list[tuple[bytes, DeadLetter]] = []
    halt = threading.Event()

    def follow() -> None:
        c = Consumer(consumer_config(s, None))
        c.assign([TopicPartition(topics.deadletter, p, 0) for p in range(s.partitions)])
        try:
            while not halt.is_set():
                for msg in c.consume(500, timeout=0.2):
                    if not msg.error():
                        dead.append((msg.key(), decode(msg.value(), DeadLetter)))
        finally:
            c.close()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        pipeline.start("sink")
        pipeline.start("processor")
        yield Rig(s, topics, pipeline, Publisher(producer_config(s)), dead)
    finally:
        halt.set()
        reader.join(5)
        pipeline.stop()


_serial = itertools.count()


def _own_step(kind: str, payload: bytes, key: bytes) -> bytes:
    """A feature batch (or a worker's window features) that decodes is moved to a job of its own.  Its table's
    values are checked when its step (shard) closes; a second record of a step that already closed (an earlier
    example's, or the same example replayed while hypothesis shrinks) is a late record, dropped as a replay, not a
    dead letter."""
    if kind not in ("features", "windowfeatures"):
        return payload
    try:
        b = decode(payload, (FeatureBatch, StepSlice) if kind == "features" else WindowFeatures)
    except RecordError:
        return payload
    return encode(msgspec.structs.replace(b, job=key.decode()))


@hsettings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(batch=st.lists(bad_record().filter(lambda kp: expected_reason(*kp) is not None), min_size=4, max_size=16))
def test_generated_bad_records_on_every_input_topic_become_dead_letters(rig, batch):
    records = [
        (kind, key, _own_step(kind, payload, key))
        for kind, payload in batch
        for key in [f"bad-{next(_serial)}".encode()]
    ]
    rig.send(records)
    got = rig.wait_dead({key for _, key, _ in records})
    for kind, key, payload in records:
        d = got[key]
        assert (d.topic, d.stage, d.reason) == (
            getattr(rig.topics, kind),
            STAGE[kind],
            expected_reason(kind, payload),
        ), (kind, payload[:80], d)
        assert d.detail and d.payload == payload[:65536]


def _replace_table(b: FeatureBatch, **columns) -> bytes:
    t = ft.unpack(b.functions)
    for name, v in columns.items():
        col = t.column(name).to_pylist()
        col[0] = v
        t = t.set_column(t.column_names.index(name), name, pa.array(col, type=t.schema.field(name).type))
    return encode(msgspec.structs.replace(b, functions=ft.pack(t)))


def _window_table(w: WindowFeatures, job: str, **columns) -> bytes:
    t = ft.read_compact(w.functions)
    for name, v in columns.items():
        col = t.column(name).to_pylist()
        col[-1] = v
        typ = t.schema.field(name).type
        t = t.set_column(
            t.column_names.index(name), name, pa.array(col, type=pa.string() if pa.types.is_dictionary(typ) else typ)
        )
    return encode(msgspec.structs.replace(w, job=job, functions=ft.pack(t)))


def _slice() -> StepSlice:
    """A good StepSlice (what the shard stage sends into the features topic), for cases against the step stage."""
    shards: ShardAssembler = ShardAssembler(60.0)
    closed = [
        shards.add(
            msgspec.structs.replace(w, job="slice-job"), ft.read_compact(w.functions), 1, Handle(0, i, None), 0.0
        )[0]
        for i, w in enumerate(WINDOW_FEATURES)
    ]
    shard = closed[-1]  # the last member's record completes the shard
    assert shard is not None and shard.reason == "complete"
    return decode(step_slices(shard.pending, POLICY.diagnosis.peer_group_keys)[0][0][1], StepSlice)


VALID_SLICE = _slice()


def _mp(record, **fields) -> bytes:
    """MessagePack of a record with fields replaced without validation (NaN and infinities survive)."""
    return msgspec.msgpack.encode(msgspec.to_builtins(record, builtin_types=(bytes,)) | fields)


#: records nested 100,000 deep (600 KB): once a RecursionError that killed the sink on every restart
DEEP = {"json": b'{"a":' * 100_000, "msgpack": b"\x81\xa1a" * 100_000 + b"\xc0"}


def test_absurd_values_become_dead_letters_and_good_input_still_flows(rig):
    hb = VALID["heartbeats"]
    job = [
        StepHeartbeat(job="fj", worker=w, step=s, step_time_s=0.1, host="h", sent_at=time.time() - 30 + 0.1 * s)
        for s in range(40)
        for w in range(4)
    ]
    rig.send([("heartbeats", b"fj", encode(h)) for h in job])  # a job the detector has seen reach step 39
    fb, rep, wf = BATCHES[60][1], VALID["stepreports"], WINDOW_FEATURES[1]
    wrong = ft.pack(pa.table({"a": [1, 2]}))
    cases = (
        [  # (topic, key, payload, reason)
            (
                "heartbeats",
                b"a1",
                encode(msgspec.structs.replace(hb, step_time_s=-0.5)),
                "invalid",
            ),  # negative duration
            ("heartbeats", b"a2", _mp(hb, step_time_s=float("nan")), "invalid"),
            ("heartbeats", b"a3", _mp(hb, sent_at=float("inf")), "invalid"),
            ("heartbeats", b"a4", _mp(hb, step=2**63), "invalid"),  # beyond any step a store can keep
            ("heartbeats", b"fj", encode(msgspec.structs.replace(job[-1], step=39 + 1_000_000)), "from_the_future"),
            (
                "heartbeats",
                b"fj",
                encode(msgspec.structs.replace(job[-1], step=40, sent_at=time.time() + 7 * 86400)),
                "from_the_future",
            ),
            ("features", b"a5", encode(msgspec.structs.replace(fb, step_time_us=-3.0)), "invalid"),
            ("features", b"a6", _mp(fb, step=2**64 - 1, window_start=2**64 - 1), "invalid"),
            ("features", b"a7", _mp(fb, sent_at=float("nan")), "invalid"),
            ("features", b"a8", _replace_table(fb, critical_us=-5.0), "bad_function_table"),
            ("features", b"a9", _replace_table(fb, total_us=float("nan")), "bad_function_table"),
            ("features", b"a10", _replace_table(fb, kind="quantum"), "bad_function_table"),
            (
                "features",
                b"a11",
                encode(msgspec.structs.replace(fb, functions=fb.functions[: len(fb.functions) // 2])),
                "bad_function_table",
            ),
            (
                "windowfeatures",
                b"w1",
                encode(msgspec.structs.replace(wf, job="w1", steps=[61, 60])),
                "invalid",
            ),  # steps out of order
            ("windowfeatures", b"w2", _mp(wf, job="w2", step_time_us=[float("nan"), 1.0]), "invalid"),
            (
                "windowfeatures",
                b"w3",
                encode(msgspec.structs.replace(wf, job="w3", shard=7)),
                "invalid",
            ),  # not the worker's shard
            (
                "windowfeatures",
                b"w4",
                encode(msgspec.structs.replace(wf, job="w4", steps=[60], step_time_us=[1.0])),
                "bad_function_table",
            ),  # rows of step 61
            ("windowfeatures", b"w5", _window_table(wf, job="w5", critical_us=-5.0), "bad_function_table"),
            ("windowfeatures", b"w6", _window_table(wf, job="w6", kind="quantum"), "bad_function_table"),
            (
                "windowfeatures",
                b"w7",
                encode(msgspec.structs.replace(wf, job="w7", functions=wf.functions[: len(wf.functions) // 2])),
                "bad_function_table",
            ),
            (
                "features",
                b"w8",
                encode(msgspec.structs.replace(VALID_SLICE, workers=ft.pack(pa.table({"rank": [1]})))),
                "bad_function_table",
            ),
            ("features", b"w9", _mp(VALID_SLICE, missing=list(range(200_000))), "invalid"),
            (
                "features",
                b"w10",
                encode(msgspec.structs.replace(VALID_SLICE, functions_size=0)),
                "bad_function_table",
            ),  # lz4 without its size
            ("features", b"w11", _mp(VALID_SLICE, functions_size=2**40), "invalid"),  # an lz4 block declaring 1 TiB
            ("stepreports", b"a12", encode(msgspec.structs.replace(rep, outliers=wrong)), "bad_function_table"),
            ("stepreports", b"a13", encode(msgspec.structs.replace(rep, groups=wrong)), "bad_function_table"),
            ("stepreports", b"a14", _mp(rep, step=2**64 - 1, window_start=2**64 - 1), "invalid"),
            ("findings", b"a15", _mp(VALID["findings"], created_at=3.5e16), "invalid"),  # a timestamp no store can keep
            (
                "findings",
                b"a16",
                _mp(VALID["findings"], impact={"step_time_share": float("nan"), "gpu_hours_per_day": 1.0}),
                "invalid",
            ),
            ("findings", b"a17", _mp(VALID["findings"], window_steps=2**63 - 1), "invalid"),
            ("windows", b"a18", _mp(VALID["windows"], workers_seen=9_288_557_845), "invalid"),
            ("windows", b"a19", _mp(VALID["windows"], closed_at=-9.2e18), "invalid"),
            ("control", b"a20", _mp(VALID["control"], created_at=float("nan")), "invalid"),
            ("control", b"a21", _mp(VALID["control"], expected_workers=2**63 - 1), "invalid"),
        ]
        + [
            (
                kind,
                f"v-{kind}".encode(),
                msgspec.json.encode(msgspec.to_builtins(VALID[kind]) | {"v": 2}),
                "unsupported_version",
            )
            for kind in STAGE
        ]
        + [
            (kind, f"deep-{form}-{kind}".encode(), payload, "malformed")
            for kind in STAGE
            for form, payload in DEEP.items()
        ]
    )
    rig.send([(kind, key, payload) for kind, key, payload, _ in cases])
    deadline = time.monotonic() + 60
    want = Counter((key, payload[:65536], reason) for _, key, payload, reason in cases)
    while time.monotonic() < deadline:
        have = Counter((k, d.payload, d.reason) for k, d in list(rig.dead))
        if not want - have:
            break
        rig.pipeline.children["processor"].healthy()
        rig.pipeline.children["sink"].healthy()
        time.sleep(0.2)
    assert not want - have, f"missing dead letters: {[(k, r) for k, _, r in want - have]}"

    # both processes still work: a good window is diagnosed and stored, its findings once; so is the same window
    # of another job from WindowFeatures
    rig.send([("features", features_key(SCENARIO.job, s), encode(b)) for s in WINDOW.range for b in BATCHES[s]])
    rig.send(
        [
            (
                "windowfeatures",
                window_features_key("good-job-w", w.window, w.shard),
                encode(msgspec.structs.replace(w, job="good-job-w")),
            )
            for w in WINDOW_FEATURES
        ]
    )
    rows = until_rows(rig.settings, "SELECT workers, cause FROM findings WHERE job = 'good-job'")
    assert rows == [[[3], "gpu_slow"]]
    assert until_rows(rig.settings, "SELECT workers, cause FROM findings WHERE job = 'good-job-w'") == [
        [[3], "gpu_slow"]
    ]
    m = rig.pipeline.metrics("processor")
    assert value(m, "lockstep_dead_letters_total", reason="from_the_future", stage="heartbeats") == 2


def until_rows(settings, sql: str, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = query(settings.db, sql)[1]
        if rows:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"nothing from {sql!r} after {timeout_s:.0f}s")
