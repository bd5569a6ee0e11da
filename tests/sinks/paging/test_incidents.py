"""Incident identity: which findings are one incident."""

from lockstep.schemas.records import Evidence, Finding, Impact
from lockstep.sinks.paging.incidents import incident_key


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


# --------------------------------------------------------------------------- incidents that end (issue 20)


def opened(window="w100", steps=(100, 101), created_at=1000.0, job="j", tenant="t", trigger_at=None):
    from dataclasses import replace

    from lockstep.sinks.paging.incidents import on_finding

    g = f(window=window, job=job, tenant=tenant)
    g = Finding(**{**{k: getattr(g, k) for k in g.__struct_fields__}, "steps": list(steps), "created_at": created_at})
    inc, ev = on_finding(None, g)
    assert ev is not None and ev.action == "trigger"
    return replace(inc, first_trigger_at=trigger_at)


def news(change, step, at, onset_step=0, job="j", tenant="t", after_s=0.2):
    from lockstep.sinks.paging.incidents import JobNews

    return JobNews(tenant=tenant, job=job, change=change, step=step, onset_step=onset_step, at=at, after_s=after_s)


def test_an_incident_keeps_its_first_window_and_step():
    inc = opened(window="w100", steps=(101, 103))
    assert (inc.first_window, inc.first_step, inc.resolved_reason) == ("w100", 101, None)


def test_a_job_that_ended_resolves_its_open_incidents_as_job_ended():
    from lockstep.sinks.paging.incidents import on_job_news

    inc = opened(trigger_at=990.0)
    ((done, ev),) = on_job_news([inc], [news("ended", 400, 2000.0)])
    assert (done.status, done.resolved_reason, done.resolved_by, done.resolved_at) == (
        "resolved",
        "job_ended",
        "job_ended",
        2000.0,
    )
    assert done.resolved_step == 401 and done.after_s is None
    assert (ev.action, ev.reason, ev.incident_id, ev.finding_id, ev.occurred_at) == (
        "resolve",
        "job_ended",
        inc.id,
        inc.last_finding,
        2000.0,
    )
    assert on_job_news([done], [news("ended", 400, 2000.0)]) == []  # applied again: nothing (idempotent)
    # another job's end, or another tenant's job of the same name, resolves nothing
    assert on_job_news([inc], [news("ended", 400, 2000.0, job="k"), news("ended", 400, 2000.0, tenant="u")]) == []


def test_an_end_before_the_incidents_window_was_triggered_is_another_run():
    from lockstep.sinks.paging.incidents import on_job_news

    # the job of the same name ran before and ended at 900; this incident's window was triggered at 990
    assert on_job_news([opened(trigger_at=990.0)], [news("ended", 400, 900.0)]) == []
    # without a stored trigger, steps decide: an end at step 50 is not this run's (first seen at step 100)
    assert on_job_news([opened()], [news("ended", 50, 2000.0)]) == []
    assert len(on_job_news([opened()], [news("ended", 150, 2000.0)])) == 1
    # a finding that arrives after the end (the last window's): its window was triggered before the end
    late = opened(created_at=2100.0, trigger_at=1990.0)
    ((done, _),) = on_job_news([late], [news("ended", 400, 2000.0)])
    assert done.resolved_reason == "job_ended"


def test_a_recovery_resolves_the_incidents_first_seen_since_the_onset_only():
    from lockstep.sinks.paging.incidents import on_job_news

    since_onset = opened(window="w100", steps=(100, 101), trigger_at=990.0)
    before_onset = opened(window="w20", steps=(20, 21), trigger_at=900.0)  # e.g. a baseline window's standing problem
    later_fault = opened(window="w500", steps=(500, 501), trigger_at=3000.0)  # a new fault after the recovery
    out = on_job_news([since_onset, before_onset, later_fault], [news("recovered", 300, 2000.0, onset_step=90)])
    ((done, ev),) = out
    assert done.first_window == "w100" and done.resolved_reason == "recovered" and done.after_s == 0.2
    assert done.resolved_step == 301 and ev.reason == "recovered"


def test_the_earliest_news_that_applies_resolves_an_incident():
    from lockstep.sinks.paging.incidents import on_job_news

    ((done, _),) = on_job_news(
        [opened(trigger_at=990.0)],
        [news("ended", 400, 3000.0), news("recovered", 300, 2000.0, onset_step=90)],
    )
    assert (done.resolved_reason, done.resolved_at) == ("recovered", 2000.0)
