"""Windows every worker refused (the trigger came after the window's first step): the detector closes them at once
and lets the same slowdown ask again without waiting out the cool-down, a bounded number of times, with a wider
margin when the refusals were ``past``.  Pure: heartbeats in, triggers and ``WindowRefused`` out."""

import numpy as np

from lockstep.schemas.records import StepHeartbeat, WindowRefused, decode, encode
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import DetectorPolicy, Policy

WORKERS = 8
T0, INTERVAL = 1000.0, 0.2


class Job:
    """One job's heartbeats, step by step; a worker's heartbeat may echo a trigger it refused."""

    def __init__(self, det: SlowdownDetector, seed: int = 1):
        self.det, self.step, self.rng = det, 0, np.random.default_rng(seed)
        self.refusals: dict[int, tuple[str, str]] = {}  # worker -> (window, reason) to echo on its next heartbeat

    def run(self, n: int, level: float) -> list:
        out = []
        for _ in range(n):
            sent = T0 + self.step * INTERVAL
            for w in range(WORKERS):
                extra = {}
                if w in self.refusals:
                    window, why = self.refusals.pop(w)
                    extra = {"trigger_window": window, "trigger_latency_s": 0.3, "trigger_refused": why}
                st = level * self.rng.normal(1, 0.01)
                hb = StepHeartbeat(job="j", worker=w, step=self.step, step_time_s=st, host="h", sent_at=sent, **extra)
                out += self.det.observe(hb, now=sent + 0.05)
            self.step += 1
        return out

    def refuse(self, window: str, why: str = "past", workers=range(WORKERS)) -> None:
        self.refusals.update(dict.fromkeys(workers, (window, why)))

    def until_trigger(self, level: float, limit: int = 100) -> list:
        for _ in range(limit):
            if out := self.run(1, level):
                return out
        return []


def slowed(det: SlowdownDetector) -> tuple[Job, list]:
    job = Job(det)
    assert job.run(40, 0.2) == []
    return job, job.until_trigger(0.26)


def test_a_window_every_worker_refused_closes_at_once_and_the_slowdown_asks_again_with_a_wider_margin():
    det = SlowdownDetector(Policy())
    job, first = slowed(det)
    assert len(first) == 1 and det.take_refused() == []
    st = det.jobs["j"]
    job.refuse(first[0].window, "past", range(WORKERS - 1))
    job.run(1, 0.26)
    assert det.take_refused() == []  # one worker has not refused: the window may still be profiled
    job.refuse(first[0].window, "past", range(WORKERS - 1))  # an echo again counts once
    job.run(1, 0.26)
    assert det.take_refused() == []
    job.refuse(first[0].window, "past", [WORKERS - 1])
    again = job.until_trigger(0.26, limit=3)  # the step its refusal came with, or the next: not after the cool-down
    refused = det.take_refused()
    assert refused == [
        WindowRefused(
            job="j",
            window=first[0].window,
            expected_workers=WORKERS,
            reasons={"past": WORKERS},
            start_step=first[0].start_step,
            retry=True,
            at=refused[0].at,
        )
    ]
    assert decode(encode(refused[0])) == refused[0]
    assert len(again) == 1 and again[0].window != first[0].window and again[0].kind == "slowdown"
    assert again[0].start_step < first[0].start_step + first[0].steps + Policy().detector.cooldown_steps
    # the margin doubled for the "past" refusals
    widened = det.margin_steps(st)
    st.watch.widen = 0
    assert widened == 2 * det.margin_steps(st)
    st.watch.widen = 1
    assert again[0].start_step - (job.step - 1) >= widened - 1


def test_immediate_retries_are_bounded_per_slowdown_then_the_cool_down_holds():
    det = SlowdownDetector(Policy(detector=DetectorPolicy(refused_retries=1)))
    job, first = slowed(det)
    job.refuse(first[0].window, "overlap")
    second = job.until_trigger(0.26, limit=3)
    assert [r.retry for r in det.take_refused()] == [True] and len(second) == 1
    assert det.jobs["j"].watch.widen == 0  # "overlap" is not lateness: the margin stays
    job.refuse(second[0].window, "past")
    assert job.run(60, 0.26) == []  # no third window at once: the cool-down after the refused one holds
    refused = det.take_refused()
    assert [(r.window, r.retry, r.reasons) for r in refused] == [(second[0].window, False, {"past": WORKERS})]


def test_without_refusal_echoes_a_window_closes_as_before():
    det = SlowdownDetector(Policy())
    job, first = slowed(det)
    for w in range(WORKERS):  # older agents echo the receipt only
        job.refusals[w] = (first[0].window, "")
    assert job.run(60, 0.26) == []
    assert det.take_refused() == []


def test_a_retried_window_is_the_same_slowdown_its_news_is_sent_once():
    det = SlowdownDetector(Policy())
    job, first = slowed(det)
    (news,) = det.take_changes()
    assert (news.change, news.window) == ("slowdown", first[0].window)
    job.refuse(first[0].window, "past")
    (again,) = job.until_trigger(0.26, limit=3)
    assert [r.retry for r in det.take_refused()] == [True]
    assert det.take_changes() == []  # the same slowdown: no second "slowdown" news (nor a second incident onset)
    assert det.jobs["j"].watch.window == again.window  # its recovery is watched from the window that runs
    assert det.jobs["j"].watch.onset_step == news.onset_step
