"""Bad input through the processor's stages, in memory: steps and clocks from the future (the detector's
rule), and the property that every stage raises nothing but RecordError on what it is fed."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.kafka import Topics
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import Finding, RecordError, StepHeartbeat, decode, encode
from lockstep.streams.detector import FUTURE_CLOCK_S, FUTURE_PACE, FUTURE_STEPS, SlowdownDetector
from lockstep.streams.diagnosis import step_result
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Processor, Tables
from tests.tiers import examples

# ------------------------------------------------------------------------------ from the future


def beat(step, worker=0, sent=None, job="j"):
    return StepHeartbeat(
        job=job,
        worker=worker,
        step=step,
        step_time_s=0.2,
        host="h",
        sent_at=1000.0 + 0.2 * step if sent is None else sent,
    )


def running(steps=50) -> SlowdownDetector:
    """A job at step ``steps - 1``, 0.2 s per step, last heard at its last heartbeat's time."""
    det = SlowdownDetector(Policy())
    for s in range(steps):
        for w in range(4):
            det.observe(beat(s, w), now=1000.0 + 0.2 * s)
    return det


def test_a_step_far_beyond_the_job_is_from_the_future_and_changes_nothing():
    det = running()
    now = 1000.0 + 0.2 * 50
    before = (
        det.jobs["j"].max_step,
        det.jobs["j"].last_complete,
        {k: (v.step, v.highest) for k, v in det.jobs["j"].shards.items()},
    )
    with pytest.raises(RecordError) as err:
        det.observe(beat(49 + 10**9, sent=now), now=now)
    assert err.value.reason == "from_the_future" and "beyond the highest it has shown (49)" in err.value.detail
    assert (
        det.jobs["j"].max_step,
        det.jobs["j"].last_complete,
        {k: (v.step, v.highest) for k, v in det.jobs["j"].shards.items()},
    ) == before
    det.observe(beat(50), now=now)  # the real next step is still taken
    assert det.jobs["j"].max_step == 50


def test_the_allowance_grows_with_the_silence_at_the_jobs_own_pace():
    det = running()
    heard = 1000.0 + 0.2 * 49
    assert det.observe(beat(49 + FUTURE_STEPS), now=heard + 0.1) is not None  # a jump of FUTURE_STEPS is taken
    det = running()
    silence = 600.0  # ten minutes unheard (a broker outage, say): the job may be 3,000 steps on, 30,000 are allowed
    det.observe(beat(49 + FUTURE_STEPS + int(FUTURE_PACE * silence / 0.2) - 10), now=heard + silence)
    det = running()
    with pytest.raises(RecordError):
        det.observe(beat(49 + FUTURE_STEPS + int(FUTURE_PACE * silence / 0.2) + 10), now=heard + silence)


def test_any_step_of_a_job_not_seen_yet_is_taken():
    det = SlowdownDetector(Policy())
    det.observe(beat(10**9, sent=1000.0), now=1000.0)
    assert det.jobs["j"].max_step == 10**9


def test_a_clock_a_day_ahead_is_from_the_future_a_skewed_one_is_not():
    det = running()
    now = 1000.0 + 0.2 * 50
    det.observe(beat(50, sent=now + 3600.0), now=now)  # an hour off: a bad clock, its step time still counts
    with pytest.raises(RecordError) as err:
        det.observe(beat(51, sent=now + FUTURE_CLOCK_S + 60), now=now)
    assert err.value.reason == "from_the_future" and "clock of host 'h' is broken" in err.value.detail


# ------------------------------------------------------------------------------ the stages are total

POLICY = Policy()
TOPICS = Topics.named("t")
FLEET = FleetSimulator(
    Scenario(
        job="j",
        topology=Topology(workers=8, gpus_per_host=8),
        faults=(Fault(type="gpu_slow", workers=(3,), severity=0.4),),
    )
)
WINDOW = Window(60, 2)
BATCHES = {s: FLEET.feature_batches(FLEET.step(s), FLEET.trigger(WINDOW), sent_at=1.8e9) for s in WINDOW.range}
ABSURD = st.one_of(
    st.sampled_from([math.nan, math.inf, -1.0, 0.0, 5e-324, 1e308, 3e38, -(2**31), 2**31 - 1, "", None]),
    st.floats(allow_nan=True),
)


def _processor() -> tuple[Processor, MemoryOutput]:
    out = MemoryOutput()
    return Processor(POLICY, TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=5.0, clock=lambda: 1.8e9), out


def _no_bug(out: MemoryOutput) -> None:
    """Bad input is refused with its reason; ``processing_failed`` would be a bug the stage's guard caught."""
    assert [d.detail for d in out.decoded(TOPICS.deadletter) if d.reason == "processing_failed"] == []


def steps_stage(payloads: list[bytes]) -> list[bytes]:
    """The processor's step stage (:class:`StepStage`) without Kafka: the step reports it publishes."""
    proc, out = _processor()

    async def run() -> None:
        for raw in payloads:
            await proc.steps.on_record(out.append(TOPICS.features, b"j", raw))

    asyncio.run(run())
    _no_bug(out)
    return [r.value for r in out.records(TOPICS.stepreports)]


def windows_stage(payloads: list[bytes]) -> list[bytes]:
    """The processor's window stage (:class:`WindowStage`) without Kafka; open windows close by timeout.
    Returns the findings and window reports it publishes."""
    proc, out = _processor()

    async def run() -> None:
        for raw in payloads:
            await proc.windows.on_record(out.append(TOPICS.stepreports, b"j", raw))
        await proc.windows.on_timer(1e12)
        for timeout in out.records(TOPICS.stepreports):
            await proc.windows.on_record(timeout)

    asyncio.run(run())
    _no_bug(out)
    return [s.record.value for s in out.sent if s.record.topic in (TOPICS.findings, TOPICS.windows)]


def test_the_stages_diagnose_the_unspoilt_window():
    out = [decode(v) for v in windows_stage(steps_stage([encode(b) for s in WINDOW.range for b in BATCHES[s]]))]
    assert [(f.workers, f.cause) for f in out if f.__struct_config__.tag == "Finding"] == [([3], "gpu_slow")]


@pytest.mark.parametrize(
    "which, column, value",
    [
        ("groups", "step_time_us", 0.0),
        ("groups", "step_time_us", 1e-300),
        ("outliers", "work_us", math.nan),
        ("outliers", "excess_us", math.inf),
        ("outliers", "calls", 9e307),
        ("groups", "work_us", -1.0),
    ],
)
def test_a_step_report_whose_table_holds_no_time_is_refused_with_the_column(which, column, value):
    """Found by the property test below: such values overflowed the window stage's shares."""
    reports = [decode(r) for r in steps_stage([encode(b) for s in WINDOW.range for b in BATCHES[s]])]
    r = next(r for r in reports if ft.unpack_ipc(getattr(r, which)).num_rows)
    t = ft.unpack_ipc(getattr(r, which))
    col = t.column(column).to_numpy(zero_copy_only=False).copy()
    col[0] = value
    spoilt = msgspec.structs.replace(
        r, **{which: ft.pack(t.set_column(t.column_names.index(column), column, ft.pa.array(col)))}
    )
    step_result(r)  # the unspoilt report reads
    with pytest.raises(RecordError, match=f"StepReport.{which}.{column} ") as e:
        step_result(spoilt)
    assert e.value.reason == "invalid"


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_stage_raises_nothing_but_record_errors(data):
    """One feature batch spoilt (a field, a worker field, a function-table value), then one step report
    spoilt (a field, a value of its outlier or group table): the stages go on, whatever passes encodes."""
    payloads = [encode(b) for s in WINDOW.range for b in BATCHES[s]]
    i = data.draw(st.integers(0, len(payloads) - 1))
    b = decode(payloads[i])
    how = data.draw(st.sampled_from(["field", "worker", "table"]))
    if how == "table":
        t = ft.unpack(b.functions)
        name = data.draw(st.sampled_from([n for n in t.column_names if n not in ("function", "kind", "resource")]))
        col = t.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        col[data.draw(st.integers(0, len(col) - 1))] = data.draw(st.floats(allow_nan=True))
        try:
            t = t.set_column(
                t.column_names.index(name), name, ft.pa.array(col).cast(t.schema.field(name).type, safe=False)
            )
        except ft.pa.ArrowInvalid:
            return
        payloads[i] = encode(msgspec.structs.replace(b, functions=ft.pack(t)))
    else:
        d = msgspec.to_builtins(b, builtin_types=(bytes,))
        target = d["worker"] if how == "worker" else d
        target[data.draw(st.sampled_from(sorted(k for k in target if k != "schema")))] = data.draw(ABSURD)
        payloads[i] = msgspec.msgpack.encode(d)
    with np.errstate(over="raise"):  # no overflow on the way: absurd values are refused or bounded, not divided blindly
        reports = steps_stage(payloads)
    if reports:
        j = data.draw(st.integers(0, len(reports) - 1))
        r = decode(reports[j])
        which = data.draw(st.sampled_from(["outliers", "groups", "field"]))
        if which == "field":
            d = msgspec.to_builtins(r, builtin_types=(bytes,))
            d[
                data.draw(
                    st.sampled_from(
                        ["step_time_us", "step_time_median_us", "work_max_us", "healthy_work_max_us", "workers_seen"]
                    )
                )
            ] = data.draw(ABSURD)
            reports[j] = msgspec.msgpack.encode(d)
        else:
            t = ft.unpack_ipc(getattr(r, which))
            if t.num_rows:
                name = data.draw(st.sampled_from([f.name for f in t.schema if ft.pa.types.is_floating(f.type)]))
                col = t.column(name).to_numpy(zero_copy_only=False).copy()
                col[data.draw(st.integers(0, len(col) - 1))] = data.draw(st.floats(allow_nan=True))
                reports[j] = encode(
                    msgspec.structs.replace(
                        r, **{which: ft.pack(t.set_column(t.column_names.index(name), name, ft.pa.array(col)))}
                    )
                )
    with np.errstate(over="raise"):
        findings = [f for f in map(decode, windows_stage(reports)) if isinstance(f, Finding)]
    assert all(0.0 <= f.impact.step_time_share <= 1.0 for f in findings)  # a fix cannot save more than the step
