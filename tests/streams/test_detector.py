import numpy as np

from lockstep.schemas.records import StepHeartbeat
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import DetectorPolicy, Policy


def feed(det, job, step_times, workers=8, t0=1000.0, interval=0.2, start=0, lag=0.05):
    triggers = []
    for i, st in enumerate(step_times):
        step = start + i
        sent = t0 + step * interval
        for w in range(workers):
            hb = StepHeartbeat(job=job, worker=w, step=step, step_time_s=float(st) * (1 + 0.001 * w), host=f"h{w // 8}", sent_at=sent)
            triggers += det.observe(hb, now=sent + lag)
    return triggers


def test_slowdown_triggers_once_within_the_cooldown():
    det = SlowdownDetector(Policy())
    rng = np.random.default_rng(1)
    healthy = 0.2 * rng.normal(1, 0.01, 40)
    slow = 0.26 * rng.normal(1, 0.01, 100)
    trig = feed(det, "j", np.concatenate([healthy, slow]))
    assert len(trig) == 1
    t = trig[0]
    assert t.job == "j" and t.steps == Policy().detector.window_steps
    assert t.expected_workers == 8
    assert t.start_step > 40  # in the future of what the detector had seen
    assert t.policy == "default" and t.policy_hash == Policy().hash
    assert "slowdown" in t.reason


def test_noise_and_hiccups_do_not_trigger():
    det = SlowdownDetector(Policy())
    rng = np.random.default_rng(2)
    times = 0.2 * rng.normal(1, 0.02, 300)
    times[rng.choice(300, 6, replace=False)] *= 1.8  # single-step hiccups
    assert feed(det, "j", times) == []


def test_margin_covers_lag_and_control_latency_in_steps():
    det = SlowdownDetector(Policy(detector=DetectorPolicy(control_latency_s=1.0)))
    times = np.concatenate([np.full(40, 0.1), np.full(20, 0.15)])
    trig = feed(det, "j", times, interval=0.1, lag=0.5)[0]
    seen = trig.start_step - det.margin_steps(det.jobs["j"])
    # (0.5 s lag + 1.0 s latency) x 2 = 3 s = 30 steps of 0.1 s, plus one
    assert det.margin_steps(det.jobs["j"]) == 31
    assert seen >= 40


def test_cooldown_survives_a_restart_through_restore():
    det = SlowdownDetector(Policy())
    det.restore("j", last_trigger_step=30, last_trigger_end=38)
    times = np.concatenate([np.full(25, 0.2), np.full(30, 0.3)])
    assert feed(det, "j", times) == []  # within cool-down of the restored window
