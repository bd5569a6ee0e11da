"""Incident identity: which findings are one incident."""

from lockstep.schemas.records import Evidence, Finding, Impact
from lockstep.sinks.incidents import incident_key


def f(
    function="fwd.gemm",
    cause="gpu_throttle_thermal",
    workers=(3,),
    window="w1",
    job="j",
    tenant="t",
    conf=0.9,
    share=0.1,
):
    return Finding(
        id=window,
        job=job,
        window=window,
        steps=[1],
        scope="worker",
        workers=list(workers),
        hosts=["h"],
        devices=["h/gpu3"],
        function=function,
        function_kind="compute",
        cause=cause,
        confidence=conf,
        evidence=[Evidence(feature=f"work_us[{function}]", value=1.0, peer_value=0.5, deviation=4.0)],
        impact=Impact(step_time_share=share, gpu_hours_per_day=1.0),
        policy="p",
        created_at=0.0,
        tenant=tenant,
        summary=f"worker 3: {function} slower",
    )


def test_incident_key_leaves_out_the_window_and_for_device_causes_the_function():
    assert incident_key(f(window="w1")) == incident_key(f(window="w9"))
    assert incident_key(f(function="fwd.gemm")) == incident_key(
        f(function="bwd.gemm")
    )  # a throttled GPU slows every kernel
    assert incident_key(f(cause="dataloader", function="a")) != incident_key(f(cause="dataloader", function="b"))
    assert incident_key(f(workers=(3,))) != incident_key(f(workers=(4,)))
    assert incident_key(f(tenant="a")) != incident_key(f(tenant="b"))
