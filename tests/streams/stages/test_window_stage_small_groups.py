"""Small groups through the stages: jobs of 1 to 8 workers (in one or a few peer groups), functions that only some
workers ran, zero and sub-microsecond times, measured and estimated waits, workers missing from a step.  Every
step report the step stage publishes must be readable by the window stage, nothing may go to the dead letters,
and the window must end in a report with a terminal state (``complete`` when every worker sent every step,
``timeout`` otherwise; ``failed`` if the trigger announced it and no step came), with a finite score on every
deviation."""

from __future__ import annotations

import asyncio
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.kafka import Topics
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    DeviationMap,
    FeatureBatch,
    StepReport,
    WindowExpected,
    WindowReport,
    WorkerMeta,
)
from lockstep.streams.diagnosis import step_result
from lockstep.streams.diagnosis.handoff import MAX_VALUE
from tests.tiers import examples

from .conftest import Pair

TOPICS = Topics.named("t")
FUNCTIONS = {"fwd": "compute", "bwd": "compute", "allreduce": "collective", "send": "p2p", "load": "dataloader"}
START, STEPS = 10, 2
STEP_TIMEOUT_S, WINDOW_TIMEOUT_S = 5.0, 30.0

#: a function's time on a worker: absent (the worker did not run it), zero, below a microsecond, or a real time
times = st.one_of(
    st.none(),
    st.just(0.0),
    st.floats(min_value=1e-6, max_value=1.0),
    st.floats(min_value=1.0, max_value=200_000.0),
)


@st.composite
def job(draw):
    """(workers' peer-group labels, per step: per worker its function times or None if it sent nothing, waits)."""
    n = draw(st.integers(min_value=1, max_value=8))
    groups = draw(st.sampled_from(["one", "two", "each"]))
    labels = [{} if groups == "one" else {"pp": str(w % 2 if groups == "two" else w)} for w in range(n)]
    steps = []
    for _ in range(STEPS):
        workers = []
        for _ in range(n):
            if draw(st.integers(min_value=0, max_value=9)) == 0:  # one time in ten a worker sends nothing
                workers.append(None)
                continue
            fns = {f: draw(times) for f in FUNCTIONS}
            if all(t is None for t in fns.values()):  # a function table has at least one row (else: bad input)
                fns["fwd"] = draw(st.floats(min_value=0.0, max_value=200_000.0))
            waits = {f: draw(st.one_of(st.none(), st.floats(0.0, 100_000.0))) for f in ("allreduce", "send")}
            # the all-reduce's link samples (the links' shapes are compared, in small rings too): none, or a mean,
            # spread and peak, any of them zero
            gbps = st.one_of(st.just(0.0), st.floats(1e-6, 400.0))
            link = draw(st.one_of(st.none(), st.tuples(st.integers(0, 50), gbps, gbps, gbps)))
            workers.append(({f: t for f, t in fns.items() if t is not None}, waits, link))
        steps.append(workers)
    return labels, steps


def batch(step: int, rank: int, label: dict, fns: dict[str, float], waits: dict, link, n: int) -> FeatureBatch:
    names = list(fns)
    samples, mean, sd, peak = link or (0, math.nan, math.nan, math.nan)

    def on_allreduce(v, other):
        return [v if f == "allreduce" else other for f in names]

    table = ft.make_table(
        {
            "function": names,
            "kind": [FUNCTIONS[f] for f in names],
            "calls": [1] * len(names),
            "total_us": [fns[f] for f in names],
            "critical_us": [fns[f] for f in names],
            "wait_us": [math.nan if waits.get(f) is None else min(waits[f], fns[f]) for f in names],
            "samples": on_allreduce(samples, 0),
            "nic_gbps": on_allreduce(mean, math.nan),
            "nic_gbps_sd": on_allreduce(sd, math.nan),
            "nic_gbps_p95": on_allreduce(peak, math.nan),
        }
    )
    return FeatureBatch(
        job="j",
        window=f"w{START}",
        step=step,
        window_start=START,
        window_steps=STEPS,
        expected_workers=n,
        worker=WorkerMeta(rank=rank, host=f"h{rank}", labels=label),
        step_time_us=max(1.0, sum(fns.values())) * 1.05,
        functions=ft.pack(table),
    )


async def run(labels, steps, announced: bool) -> Pair:
    p = Pair(step_timeout_s=STEP_TIMEOUT_S, window_timeout_s=WINDOW_TIMEOUT_S)
    n = len(labels)
    t = p.clock.t
    if announced:  # as the detect stage does for every trigger
        notice = WindowExpected(
            job="j",
            window=f"w{START}",
            start_step=START,
            steps=STEPS,
            expected_workers=n,
            created_at=t,
            deadline=t + 10,
        )
        await p.stage_of[TOPICS.stepreports].on_record(p.produce(TOPICS.stepreports, "j", notice))
    for i, workers in enumerate(steps):
        for rank, sent in enumerate(workers):
            if sent is not None:
                b = batch(START + i, rank, labels[rank], *sent, n)
                await p.stage_of[TOPICS.features].on_record(p.produce(TOPICS.features, f"j:{START + i}", b))
    await p.pump()
    await p.proc.steps.on_timer(t + STEP_TIMEOUT_S)  # steps missing a worker close without it
    await p.pump()
    # a window missing a step times out; one that no step reached fails at its deadline (10 s) + the timeout
    await p.proc.windows.on_timer(t + 10 + STEP_TIMEOUT_S + WINDOW_TIMEOUT_S)
    await p.pump()
    return p


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job(), st.booleans())
def test_every_step_report_of_a_small_group_validates_and_its_window_ends(case, announced):
    labels, steps = case
    p = asyncio.run(run(labels, steps, announced))
    assert p.dead() == {}
    reports = [r for r in p.sent(TOPICS.stepreports) if isinstance(r, StepReport)]
    sent_steps = [i for i, workers in enumerate(steps) if any(w is not None for w in workers)]
    assert len(reports) == len(sent_steps)
    for r in reports:
        result = step_result(r)  # raises if a value is out of range
        z = result.outliers.column("z").to_numpy()
        assert np.isfinite(z).all() and (np.abs(z) <= MAX_VALUE).all()
    windows = [r for r in p.sent(TOPICS.windows) if isinstance(r, WindowReport)]
    if not reports and not announced:
        assert windows == []  # no step at all, and no trigger announced it: nothing to close
        return
    (w,) = windows
    everyone = all(w is not None for workers in steps for w in workers)
    # complete only when every worker sent every step (issue 20: a missing worker is named, never complete)
    assert w.closed == ("complete" if everyone else "timeout" if sent_steps else "failed")
    # the workers missing from the steps that reported (a step nobody sent is the window's timeout, not a worker's)
    missing = sorted({r for i in sent_steps for r, sent in enumerate(steps[i]) if sent is None})
    assert w.missing_workers == missing
    assert (w.closed_reason == "") == (w.closed == "complete")
    assert w.steps_seen == len(sent_steps) and (w.coverage == 1.0) == everyone
    assert len(p.proc.windows.assembler) == 0 and len(p.proc.steps.assembler) == 0
    # every window with steps gets its heatmap (small groups' cells on the noise scale), every value finite
    maps = [r for r in p.sent(TOPICS.series) if isinstance(r, DeviationMap)]
    assert len(maps) == (1 if reports else 0)
    assert all(math.isfinite(z) for m in maps for row in m.z for z in row if z is not None)
    offsets = len(p.out.records(TOPICS.stepreports)) + announced  # the notice was produced, the rest sent
    assert sorted(p.acked(TOPICS.stepreports)) == list(range(offsets))
