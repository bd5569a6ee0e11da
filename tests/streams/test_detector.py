import re

import numpy as np

from lockstep.schemas.records import ProfileTrigger, StepHeartbeat, StepPartial, TriggerRefused, TriggerRequest
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.policy import DetectorPolicy, JobSelector, Policy


def hb(job, w, step, st, sent, **kw):
    return StepHeartbeat(
        job=job, worker=w, step=step, step_time_s=float(st) * (1 + 0.001 * w), host=f"h{w // 8}", sent_at=sent, **kw
    )


def feed(det, job, step_times, workers=8, t0=1000.0, interval=0.2, start=0, lag=0.05, tenant="", missing=()):
    """Heartbeats of every worker for each step; returns the triggers.  ``missing``: (step, worker) not sent."""
    triggers = []
    for i, st in enumerate(step_times):
        step = start + i
        sent = t0 + step * interval
        for w in range(workers):
            if (step, w) not in missing:
                triggers += det.observe(hb(job, w, step, st, sent, tenant=tenant), now=sent + lag)
    return triggers


def policy(**detector) -> Policy:
    return Policy(detector=DetectorPolicy(**detector))


def req(job, **kw) -> TriggerRequest:
    return TriggerRequest(job=job, request=kw.pop("request", "r1"), **kw)


def test_slowdown_triggers_once_within_the_cooldown():
    det = SlowdownDetector(Policy())
    rng = np.random.default_rng(1)
    healthy = 0.2 * rng.normal(1, 0.01, 40)
    slow = 0.26 * rng.normal(1, 0.01, 100)
    trig = feed(det, "j", np.concatenate([healthy, slow]))
    assert len(trig) == 1
    t = trig[0]
    assert t.job == "j" and t.steps == Policy().detector.small_job_window_steps and t.kind == "slowdown"  # 8 workers
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
    det = SlowdownDetector(policy(control_latency_s=1.0))
    times = np.concatenate([np.full(40, 0.1), np.full(20, 0.15)])
    trig = feed(det, "j", times, interval=0.1, lag=0.5)[0]
    seen = trig.start_step - det.margin_steps(det.jobs["j"])
    # (0.5 s lag + 1.0 s latency) x 2 = 3 s = 30 steps of 0.1 s, plus one
    assert det.margin_steps(det.jobs["j"]) == 31
    assert seen >= 40


def test_a_processor_catching_up_on_a_backlog_keeps_the_pace_and_measures_the_lag_of_its_newest_heartbeat():
    # a processor started 60 s after its job: it reads the shard's heartbeats up to now (highest step 900) first, and
    # closes the steps from 0 on after; before, the pace was pruned by the highest step (a step interval of NaN, a
    # window 5 steps ahead, past before the trigger reached the workers) and the lag was that of each closed step
    det = SlowdownDetector(policy(control_latency_s=1.0))
    t0, interval, now = 1000.0, 0.065, 1000.0 + 899 * 0.065 + 0.2
    triggers = []
    for step in range(900):
        st = 0.03 if step < 120 else 0.06
        p = StepPartial(
            job="j",
            step=step,
            shard=0,
            partition=0,
            workers=3,
            slowest_s=st,
            median_s=st,
            clock_worker=0,
            clock_sent_at=t0 + step * interval,
            newest_sent_at=t0 + step * interval,
            highest=899,
            highest_sent_at=t0 + 899 * interval,
            members=3,
        )
        triggers += det.observe_partial(p, now)
    st = det.jobs["j"]
    assert abs(det.step_interval_s(st) - interval) < 1e-9
    # (0.2 s lag + 1.0 s latency) x 2 = 2.4 s = 37 steps of 0.065 s, plus one; not the 2 x 58 s of the closed steps'
    assert det.margin_steps(st) == 38
    assert triggers and all(t.start_step >= 899 + 38 for t in triggers), triggers


def test_echoed_trigger_receipts_replace_the_assumed_control_latency():
    det = SlowdownDetector(policy(control_latency_s=1.0))
    feed(det, "j", np.full(20, 0.1), interval=0.1, lag=0.0)
    feed(det, "k", np.full(20, 0.1), interval=0.1, lag=0.0)
    assert det.control_latency_s(det.jobs["j"]) == 1.0  # nothing measured yet: the policy's value
    for w, lat in enumerate([0.10, 0.25, 0.15]):  # each worker echoes when it received window w9
        det.observe(hb("j", w, 20, 0.1, 1002.0, trigger_window="w9", trigger_latency_s=lat), now=1002.0)
    det.observe(
        hb("j", 3, 20, 0.1, 1002.0, trigger_window="w9", trigger_latency_s=3600.0), now=1002.0
    )  # a broken clock
    assert det.control_latency_s(det.jobs["j"]) == 0.25  # the slowest worker's receipt
    assert det.control_latency_s(det.jobs["k"]) == 0.25  # a job without echoes: what this processor measured
    # (0 lag + 0.25 s) x 2 = 0.5 s = 5 steps of 0.1 s, plus one
    assert det.margin_steps(det.jobs["j"]) == 6


def test_cooldown_survives_a_restart_through_restore():
    det = SlowdownDetector(Policy())
    det.restore("j", last_trigger_step=30, last_trigger_end=38, now=1000.0)
    times = np.concatenate([np.full(25, 0.2), np.full(30, 0.3)])
    assert feed(det, "j", times) == []  # within cool-down of the restored window
    assert det.suppressed["cooldown"] > 0


def test_hang_triggers_once_at_the_first_step_no_worker_can_have_begun():
    det = SlowdownDetector(policy(hang_factor=10, hang_min_s=1.0))
    feed(det, "j", np.full(30, 0.2), interval=0.2, missing={(29, 5)})  # worker 5 never finished step 29
    last = 1000.0 + 29 * 0.2 + 0.05
    assert det.due_ticks(last + 1.5) == []  # 10 x 0.2 s = 2 s of silence needed
    assert det.tick("j", last + 1.5) == []
    assert det.due_ticks(last + 2.5) == ["j"]
    assert det.due_ticks(last + 2.6) == []  # one tick per hang interval
    (t,) = det.tick("j", last + 2.5)
    assert t.kind == "hang" and t.start_step == 29 + 2  # workers may be inside step 30 already
    assert "no progress" in t.reason and "1 worker(s) behind step 29: 5" in t.reason
    assert t.expected_workers == 8
    assert det.tick("j", last + 10) == []  # reported once
    assert all(det.tick(job, last + 10) == [] for job in det.due_ticks(last + 10))


def test_a_hang_right_after_a_slowdown_window_is_not_held_back_by_its_cooldown():
    det = SlowdownDetector(policy(hang_factor=10, hang_min_s=1.0, cooldown_steps=200))
    times = np.concatenate([np.full(40, 0.2), np.full(30, 0.3)])
    (slow,) = feed(det, "j", times, interval=0.2)
    assert slow.kind == "slowdown"
    last = 1000.0 + 69 * 0.2 + 0.05  # the job stops after step 69, inside the cool-down (and the window)
    (t,) = det.tick("j", last + 100.0)
    assert t.kind == "hang" and t.start_step == 69 + 2
    assert det.request(req("j"), now=last + 100.5).code in ("cooldown", "job_limit")  # operators' windows still wait


def test_a_job_that_ends_cleanly_is_not_hung():
    det = SlowdownDetector(policy(hang_min_s=1.0))
    feed(det, "j", np.full(30, 0.2))
    for w in range(8):
        det.observe(hb("j", w, 29, 0.2, 1006.0, final=True), now=1006.0)
    assert det.due_ticks(1100.0) == [] and det.tick("j", 1100.0) == []
    assert det.request(req("j"), now=1100.0).code == "ended"


def test_job_selectors_include_exclude_and_tenant():
    det = SlowdownDetector(Policy(jobs=JobSelector(include=("train-*",), exclude=("*-test",), tenants=("acme",))))
    times = np.concatenate([np.full(40, 0.2), np.full(20, 0.3)])
    assert len(feed(det, "train-a", times, tenant="acme")) == 1
    assert feed(det, "train-a-test", times, tenant="acme") == []
    assert feed(det, "eval-b", times, tenant="acme") == []
    assert feed(det, "train-c", times, tenant="other") == []
    refused = det.request(req("train-c"), now=2000.0)
    assert refused.code == "excluded" and "not selected" in refused.reason


def test_manual_request_gets_the_same_checks():
    det = SlowdownDetector(policy(cooldown_steps=50, window_steps=4, max_window_steps=16, small_job_workers=0))
    feed(det, "j", np.full(30, 0.2), interval=0.2)
    t = det.request(req("j", request="abc", steps=6, reason="checking", requested_by="ops@h"), now=1006.1)
    assert isinstance(t, ProfileTrigger)
    assert t.kind == "manual" and t.request == "abc" and t.steps == 6 and t.start_step > 29
    assert "manual: checking (by ops@h)" in t.reason
    r = det.request(req("j", request="def"), now=1006.2)
    assert isinstance(r, TriggerRefused) and r.code == "job_limit" and r.request == "def" and t.window in r.reason
    end = t.start_step + t.steps
    feed(det, "j", np.full(end + 10 - 30, 0.2), start=30)  # past the window's end, inside the cool-down
    r = det.request(req("j"), now=2000.0)
    assert r.code == "cooldown" and f"until step {end + 50}" in r.reason
    feed(det, "j", np.full(50, 0.2), start=end + 10)
    assert isinstance(det.request(req("j"), now=3000.0), ProfileTrigger)
    assert det.request(req("j", steps=17), now=3000.0).code == "too_long"
    assert det.request(req("nobody"), now=3000.0).code == "unknown_job"


def test_fleet_limit_counts_open_windows_of_every_job():
    det = SlowdownDetector(policy(max_windows_fleet=2))
    for job in "abc":
        feed(det, job, np.full(10, 0.2))
    assert isinstance(det.request(req("a"), now=1002.0), ProfileTrigger)
    assert isinstance(det.request(req("b"), now=1002.0), ProfileTrigger)
    r = det.request(req("c"), now=1002.0)
    assert r.code == "fleet_limit" and det.open_windows(1002.0) == 2
    assert isinstance(
        det.request(req("c"), now=1002.0 + 3600), ProfileTrigger
    )  # expired: never-finished windows free their slot


def test_windows_of_one_job_queue_without_overlapping():
    det = SlowdownDetector(policy(max_windows_per_job=2, window_steps=4))
    feed(det, "j", np.full(10, 0.2))
    a, b = det.request(req("j"), now=1002.0), det.request(req("j"), now=1002.0)
    assert b.start_step == a.start_step + a.steps and a.window != b.window
    assert det.request(req("j"), now=1002.0).code == "job_limit"


def test_policy_change_applies_to_a_running_job():
    det = SlowdownDetector(policy(slowdown_threshold=0.5))
    times = np.full(40, 0.2)
    assert feed(det, "j", times) == []
    assert feed(det, "j", np.full(10, 0.25), start=40) == []  # +25%: below 50%
    strict = policy(slowdown_threshold=0.1)
    det.set_policy(strict)
    (t,) = feed(det, "j", np.full(3, 0.25), start=50)
    assert t.policy_hash == strict.hash


def test_expected_workers_are_the_active_ones():
    det = SlowdownDetector(Policy())
    missing = {(s, 7) for s in range(10, 60)}  # worker 7 died at step 10
    (t,) = feed(det, "j", np.concatenate([np.full(40, 0.2), np.full(20, 0.3)]), missing=missing)
    assert t.expected_workers == 7


def test_a_restart_from_a_checkpoint_resets_the_job_but_a_late_heartbeat_does_not():
    det = SlowdownDetector(Policy())
    feed(det, "j", np.full(100, 0.2))
    det.observe(hb("j", 3, 50, 0.2, 1000.0 + 50 * 0.2), now=1030.0)  # spooled: old sent_at
    assert det.jobs["j"].max_step == 99
    det.observe(hb("j", 3, 50, 0.2, 1030.0), now=1030.0)  # new: the job runs step 50 again
    assert det.jobs["j"].max_step == 50 and len(det.jobs["j"].history) == 0


def test_duplicate_heartbeats_count_once():
    det = SlowdownDetector(Policy())
    feed(det, "j", np.full(5, 0.2))
    for _ in range(3):
        det.observe(hb("j", 0, 5, 0.2, 1001.0), now=1001.0)
    assert 5 in det.jobs["j"].steps  # one worker of eight, however often: not complete


def test_the_optional_heartbeat_fields_cost_nothing_when_unset():
    from lockstep.schemas.records import decode, encode

    plain = encode(hb("j", 0, 1, 0.2, 1000.0))
    assert b"trigger" not in plain and b"final" not in plain  # the always-on signal stays as small as before
    echo = decode(encode(hb("j", 0, 1, 0.2, 1000.0, trigger_window="w9", trigger_latency_s=0.0, final=True)))
    assert (echo.trigger_window, echo.trigger_latency_s, echo.final) == ("w9", 0.0, True)


def test_agents_counters_are_summed_per_job_from_each_workers_latest_report():
    from lockstep.schemas.records import AgentCounters

    det = SlowdownDetector(Policy())
    feed(det, "j", np.full(3, 0.2))
    assert det.agent_counters() == {}  # no agent reported trouble
    det.observe(hb("j", 1, 3, 0.2, 1000.6, agent=AgentCounters(dropped_records=3, spooled_records=40)), now=1000.6)
    det.observe(hb("j", 2, 3, 0.2, 1000.6, agent=AgentCounters(spooled_records=10, failed_windows=1)), now=1000.6)
    det.observe(
        hb("j", 1, 4, 0.2, 1000.8, agent=AgentCounters(dropped_records=5)), now=1000.8
    )  # worker 1's spool drained
    det.observe(hb("j", 2, 4, 0.2, 1000.8), now=1000.8)  # unchanged counters are not re-sent: the last report stands
    assert det.agent_counters() == {"j": AgentCounters(dropped_records=5, spooled_records=10, failed_windows=1)}
    det.drop(["j"])
    assert det.agent_counters() == {}


def test_a_healthy_job_gets_a_baseline_window_every_so_many_steps_after_its_last_window():
    det = SlowdownDetector(
        policy(
            baseline_steps=10,
            recent_steps=3,
            baseline_every_steps=100,
            cooldown_steps=20,
            window_steps=4,
            small_job_window_steps=4,
        )
    )
    step_times = np.full(400, 0.2)
    step_times[150:180] = 0.3  # a slowdown in between: its window resets the count
    triggers = feed(det, "j", step_times)
    kinds = [(t.kind, t.start_step) for t in triggers]
    first = det.jobs["j"].first_step
    assert [k for k, _ in kinds] == ["baseline", "slowdown", "baseline", "baseline"], kinds
    (b1, _), (s1, _), (b2, _), (b3, _) = [(t, t.start_step) for t in triggers]
    assert b1.start_step >= first + 100 and "since the detector first saw the job" in b1.reason
    assert 150 < s1.start_step < 180  # the slowdown, a margin ahead
    assert (
        b2.start_step >= s1.start_step + s1.steps + 100 and "since the last window" in b2.reason
    )  # counted from the slowdown window's end
    assert b3.start_step >= b2.start_step + b2.steps + 100


def test_no_baseline_window_while_the_job_is_slow_or_when_switched_off():
    off = SlowdownDetector(policy(baseline_steps=10, recent_steps=3, baseline_every_steps=0))
    assert feed(off, "j", np.full(400, 0.2)) == []
    slow = SlowdownDetector(policy(baseline_steps=10, recent_steps=3, baseline_every_steps=50, cooldown_steps=1000))
    times = np.full(300, 0.2)
    times[40:] = 0.3  # slow from step 40 on, and the cool-down keeps its window the only one
    triggers = feed(slow, "j", times)
    assert [t.kind for t in triggers] == ["slowdown"]


def test_a_refused_baseline_window_backs_off_instead_of_asking_at_every_step():
    det = SlowdownDetector(
        policy(baseline_steps=10, recent_steps=3, baseline_every_steps=100, max_windows_fleet=1, window_steps=4)
    )
    feed(det, "busy", np.full(20, 0.2))  # another job holds the fleet's only window
    assert det.request(req("busy"), now=1004.0).kind == "manual"
    calls = []
    decide = det._decide
    det._decide = lambda *a, **k: calls.append(a[2]) or decide(*a, **k)  # count the checks (a[2]: the kind)
    assert feed(det, "j", np.full(160, 0.2)) == []  # due from step ~100 on, refused by the fleet limit
    assert 1 <= calls.count("baseline") <= 6  # once per tenth of the interval, not at each of ~60 steps


# ---------------------------------------------------------------- the cusum rule (issue 15)


def one_worker(det, job, step_times, start=0, t0=1000.0):
    """One heartbeat per step (a one-worker job: its step time is the synchronised one); returns (step, trigger)."""
    out, sent = [], t0
    for i, st in enumerate(step_times):
        sent += float(st)
        out += [
            (start + i, t)
            for t in det.observe(
                StepHeartbeat(job=job, worker=0, step=start + i, step_time_s=float(st), host="h0", sent_at=sent),
                now=sent,
            )
        ]
    return out


def test_a_five_percent_slowdown_on_a_two_percent_spread_is_found_within_a_hundred_steps():
    rng = np.random.default_rng(5)
    delays = []
    for run in range(20):
        times = np.exp(rng.normal(0.0, 0.02, 900))  # 1 s steps, spread 2%
        times[600:] *= 1.05
        fired = one_worker(SlowdownDetector(Policy()), f"j{run}", times)
        assert all(step >= 600 for step, _ in fired), fired  # nothing before the onset
        delays.append(fired[0][0] - 600 if fired else None)
        if fired:
            assert fired[0][1].kind == "slowdown" and re.search(r"step-to-step spread [12]\.\d%", fired[0][1].reason)
    assert all(d is not None and d <= 100 for d in delays), delays


def test_the_old_rule_is_kept_and_misses_what_the_new_one_finds():
    times = np.exp(np.random.default_rng(6).normal(0.0, 0.01, 600))
    times[300:] *= 1.08  # +8%: below the median rule's 15%
    median = policy(rule="median", slowdown_threshold=0.15)
    assert one_worker(SlowdownDetector(median), "j", times) == []
    ((step, t),) = one_worker(SlowdownDetector(Policy()), "j", times)
    assert 300 <= step <= 330 and re.search(r"since step 30\d: median of its last \d+ steps .* \(\+[78]\.\d%", t.reason)
    times[300:] *= 1.10  # +19%: the median rule fires too, with its own reason
    ((step, t),) = one_worker(SlowdownDetector(median), "j", times)
    assert 300 <= step <= 310 and t.reason.startswith("slowdown: median of last 5 steps")


def test_hiccups_and_periodic_steps_do_not_trigger_and_periodic_ones_are_recognised():
    rng = np.random.default_rng(7)
    times = np.exp(rng.normal(0.0, 0.01, 3000))
    times[::100] *= 8.0  # a checkpoint every 100 steps
    times[37::50] *= 2.5  # an evaluation step every 50 steps
    times[41::50] *= 2.5  # ... and a second one right after: two slow steps close together
    hiccups = rng.choice(3000, 10, replace=False)
    times[hiccups] *= rng.uniform(1.5, 3.0, 10)
    det = SlowdownDetector(policy(baseline_every_steps=0))
    assert one_worker(det, "j", times) == []
    assert det.jobs["j"].change.ignored >= 3 * 3000 // 100 - 10  # from their third occurrence on
    times[2000:] *= 1.05  # a slowdown is still found among them
    fired = one_worker(SlowdownDetector(policy(baseline_every_steps=0)), "j", times)
    assert fired and 2000 <= fired[0][0] <= 2100


def test_a_skewed_job_is_judged_on_its_own_spread():
    """The slowest of 64 workers: skewed to the right, as the synchronised step time of a big job is."""
    rng = np.random.default_rng(8)
    times = np.exp(rng.normal(0.0, 0.03, (20_000, 64))).max(axis=1) * np.exp(rng.gamma(1.0, 0.01, 20_000))
    det = SlowdownDetector(policy(baseline_every_steps=0))
    assert one_worker(det, "j", times) == []
    assert 0.01 < det.jobs["j"].change.sigma < 0.03  # its own spread, not the workers'


def test_autocorrelated_noise_widens_the_allowance():
    rng = np.random.default_rng(9)
    e = rng.normal(0.0, 0.01, 20_000)
    x = np.empty_like(e)
    x[0] = 0.0
    for i in range(1, len(e)):
        x[i] = 0.7 * x[i - 1] + e[i]  # slow wander: sums of steps spread wider than the steps do
    det = SlowdownDetector(policy(baseline_every_steps=0))
    assert one_worker(det, "j", np.exp(x)) == []
    assert det.jobs["j"].change.inflation > 1.5  # sqrt(1.7 / 0.3) = 2.4 for the true r = 0.7, less two standard errors
    iid = SlowdownDetector(policy(baseline_every_steps=0))
    one_worker(iid, "j", np.exp(e))
    assert iid.jobs["j"].change.inflation < 1.1  # independent steps: (almost) none


def test_a_small_lasting_change_becomes_the_new_normal_and_what_the_detector_saw_says_so():
    det = SlowdownDetector(policy(baseline_every_steps=0))
    times = np.exp(np.random.default_rng(10).normal(0.0, 0.002, 2000))
    times[500:] *= 1.01  # +1%: found by the evidence, too small for a window (threshold 2%)
    one_worker(det, "j", times[:700])
    ch = det.jobs["j"].change
    assert ch.s >= Policy().detector.cusum_h and abs(np.exp(ch.mu) - 1.0) < 0.002  # pending against the old level
    assert re.search(
        r"median step time 1010\.\d ms over the last 200 steps vs baseline 999\.\d ms \(\+1\.0%.*slowdown_threshold 1.5%",
        det.describe("j"),
    )
    assert one_worker(det, "j", times[700:], start=700) == []
    assert abs(np.exp(ch.mu) - 1.01) < 0.002  # after a reference's length: the new normal
    assert det.describe("nobody") == "no complete step of job 'nobody' yet"


def test_a_slowdown_that_starts_in_a_cooldown_is_profiled_when_it_ends():
    det = SlowdownDetector(policy(cooldown_steps=300, baseline_every_steps=0, small_job_workers=0))
    times = np.exp(np.random.default_rng(11).normal(0.0, 0.01, 1200))
    one_worker(det, "j", times[:400])
    assert isinstance(det.request(req("j"), now=2e9), ProfileTrigger)  # an operator's window: cool-down until ~step 710
    times[450:] *= 1.05
    fired = one_worker(det, "j", times[400:], start=400, t0=1400.0)
    assert [t.kind for _, t in fired] == ["slowdown"] and 700 <= fired[0][0] <= 720, [(s, t.reason) for s, t in fired]
    assert "since step 45" in fired[0][1].reason  # the excursion it found began at the onset
    assert det.suppressed["cooldown"] > 0


def test_a_slowdown_that_ended_on_its_own_does_not_hide_the_next_one():
    """Twenty steps 20% slower (below a 30% threshold: no window), then normal again: those steps must not
    become the baseline, or the same slowdown coming back would rank as ordinary."""
    det = SlowdownDetector(policy(slowdown_threshold=0.3, baseline_every_steps=0))
    times = np.exp(np.random.default_rng(12).normal(0.0, 0.01, 400))
    times[100:120] *= 1.2
    assert one_worker(det, "j", times[:160]) == []
    det.set_policy(policy(slowdown_threshold=0.1, baseline_every_steps=0))
    times[160:] *= 1.2
    fired = one_worker(det, "j", times[160:], start=160, t0=2000.0)
    assert fired and 160 <= fired[0][0] <= 175 and "since step 16" in fired[0][1].reason, fired


def test_a_small_job_gets_longer_windows():
    """Few peers need more steps (``small_job_window_steps``); a job of more than ``small_job_workers`` the usual."""
    rng = np.random.default_rng(1)
    times = np.concatenate([0.2 * rng.normal(1, 0.01, 40), 0.26 * rng.normal(1, 0.01, 100)])
    dp = dict(window_steps=8, small_job_workers=8, small_job_window_steps=24)
    (small,) = feed(SlowdownDetector(policy(**dp)), "j", times, workers=8)
    (big,) = feed(SlowdownDetector(policy(**dp)), "j", times, workers=9)
    assert (small.steps, big.steps) == (24, 8)
    det = SlowdownDetector(policy(**dp))
    feed(det, "j", np.full(30, 0.2), workers=4)
    assert det.request(req("j"), now=1006.1).steps == 24  # an operator's window, its length not given
    (off,) = feed(SlowdownDetector(policy(**{**dp, "small_job_workers": 0})), "j", times, workers=8)
    assert off.steps == 8
