"""The detector's news for the sink's incidents (``JobChange``): a slowdown it opened a window for, with its onset and
step times; its recovery once the step time is back at its level before the onset for ``recovery_steps`` steps; the
job's end, from every worker's final heartbeat or from a final heartbeat and then silence past the hang bound."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import PolicyError, load_policy
from tests.streams.test_detector import feed, hb, policy

HEALTHY, SLOW = 0.2, 0.26
#: the slowest of the 8 workers ``feed`` sends (worker 7 is 0.7% slower than worker 0)
SLOWEST = 1.007


def noisy(level: float, n: int, seed: int) -> np.ndarray:
    return level * np.random.default_rng(seed).normal(1, 0.005, n)


def slowed(det: SlowdownDetector, job: str = "j"):
    """60 healthy steps, then 60 slow ones: one window, and the news of its slowdown."""
    (trigger,) = feed(det, job, np.concatenate([noisy(HEALTHY, 60, 1), noisy(SLOW, 60, 2)]))
    changes = det.take_changes()
    return trigger, changes


def test_a_profiled_slowdown_is_announced_with_its_window_onset_and_step_times():
    det = SlowdownDetector(policy())
    trigger, changes = slowed(det)
    (ch,) = changes
    assert ch.change == "slowdown" and ch.job == "j" and ch.window == trigger.window
    assert 55 <= ch.onset_step <= 65  # the slowdown began at step 60
    assert ch.before_s == pytest.approx(HEALTHY * SLOWEST, rel=0.01)
    assert ch.during_s == pytest.approx(SLOW * SLOWEST, rel=0.01)
    assert ch.step < trigger.start_step
    # the onset's time from the job's pace (0.2 s a step): as many steps before the trigger as it is
    assert ch.onset_at == pytest.approx(trigger.created_at - (ch.step - ch.onset_step) * 0.2, abs=0.05)
    assert det.take_changes() == []  # taken once


def test_a_fault_removed_mid_run_is_recovered_after_recovery_steps_back_at_the_level_before():
    det = SlowdownDetector(policy(recovery_steps=30))
    trigger, _ = slowed(det)
    # the fault is still there: no recovery however long it lasts
    feed(det, "j", noisy(SLOW, 100, 3), start=120)
    assert [c.change for c in det.take_changes()] == []
    # removed at step 220: the median of the last 30 steps is back once more than half of them are healthy
    feed(det, "j", noisy(HEALTHY, 14, 4), start=220)
    assert det.take_changes() == []
    feed(det, "j", noisy(HEALTHY, 30, 5), start=234)
    (ch,) = det.take_changes()
    assert ch.change == "recovered" and ch.window == trigger.window and ch.steps == 30
    assert 234 <= ch.step <= 240
    assert ch.after_s == pytest.approx(HEALTHY * SLOWEST, rel=0.02)
    assert ch.before_s == pytest.approx(HEALTHY * SLOWEST, rel=0.01) and 55 <= ch.onset_step <= 65
    # said once: later healthy steps say nothing more
    feed(det, "j", noisy(HEALTHY, 60, 6), start=264)
    assert det.take_changes() == []


def test_a_level_short_of_the_one_before_is_not_a_recovery_and_zero_steps_switches_it_off():
    det = SlowdownDetector(policy(recovery_steps=30))
    slowed(det)
    feed(
        det, "j", noisy(HEALTHY * 1.05, 100, 3), start=120
    )  # better, not back: 5% above, beyond half the 1.5% threshold
    assert [c.change for c in det.take_changes()] == []
    off = SlowdownDetector(policy(recovery_steps=0))
    slowed(off)
    feed(off, "j", noisy(HEALTHY, 100, 3), start=120)
    assert off.take_changes() == []


def test_every_workers_final_heartbeat_ends_the_job_once():
    det = SlowdownDetector(policy())
    feed(det, "j", np.full(30, HEALTHY))
    for w in range(7):
        det.observe(hb("j", w, 29, HEALTHY, 1006.0, final=True), now=1006.0)
    assert det.take_changes() == []  # one worker is still to say it
    det.observe(hb("j", 7, 29, HEALTHY, 1006.0, final=True), now=1006.1)
    (ch,) = det.take_changes()
    assert (ch.change, ch.end, ch.step, ch.at) == ("ended", "final", 29, 1006.1)
    assert ch.after_s == pytest.approx(HEALTHY * SLOWEST)
    assert det.due_endings(1006.1 + 3600) == []  # said once
    det.observe(hb("j", 0, 29, HEALTHY, 1006.0, final=True), now=1007.0)  # a final heartbeat again (a replay)
    assert det.take_changes() == []


def test_a_final_heartbeat_then_silence_past_the_hang_bound_ends_the_job():
    det = SlowdownDetector(policy(hang_min_s=30.0))
    feed(det, "j", np.full(30, HEALTHY))  # the last step heard at 1005.85
    det.observe(hb("j", 0, 29, HEALTHY, 1006.0, final=True), now=1006.0)
    assert det.take_changes() == [] and det.due_endings(1006.0 + 29.0) == []
    (ch,) = det.due_endings(1006.0 + 30.0)
    assert (ch.change, ch.end, ch.step) == ("ended", "silent", 29)
    assert det.due_endings(1006.0 + 90.0) == []
    assert det.tick("j", now=1006.0 + 90.0) == []  # and it was never a hang


def test_progress_after_a_final_heartbeat_is_not_an_end_and_a_silent_job_without_one_is_a_hang():
    det = SlowdownDetector(policy(hang_min_s=30.0))
    feed(det, "j", np.full(30, HEALTHY))
    det.observe(hb("j", 0, 29, HEALTHY, 1006.0, final=True), now=1006.0)
    feed(det, "j", np.full(10, HEALTHY), start=30)  # the others went on (the first was only restarted)
    assert det.due_endings(1008.0 + 60.0) == []
    other = SlowdownDetector(policy(hang_min_s=30.0))
    feed(other, "k", np.full(30, HEALTHY))
    assert other.due_endings(1006.0 + 60.0) == []  # no final heartbeat: a hang (tick), not an end
    assert [t.kind for t in other.tick("k", now=1006.0 + 60.0)] == ["hang"]


def test_an_open_slowdown_is_not_recovered_after_the_job_ended():
    det = SlowdownDetector(policy(recovery_steps=10))
    slowed(det)
    for w in range(8):
        det.observe(hb("j", w, 119, SLOW, 1024.0, final=True), now=1024.0)
    (ch,) = det.take_changes()
    assert ch.change == "ended" and ch.window  # the slowdown it ended with
    assert det.jobs["j"].watch.window == ""  # nothing left to recover


def test_recovery_steps_is_a_validated_policy_key(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("detector: {recovery_steps: 50}\n")
    assert load_policy(f).detector.recovery_steps == 50
    f.write_text("detector: {recovery_steps: -1}\n")
    with pytest.raises(PolicyError, match="recovery_steps"):
        load_policy(f)
