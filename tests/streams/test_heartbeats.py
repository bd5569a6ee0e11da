"""The heartbeat shards (pure): a job's heartbeats aggregated per shard and step, in columns, and combined by the
detector, decide as the detector fed every heartbeat does; a replayed shard's partials are counted once."""

import numpy as np

from lockstep.schemas.records import StepHeartbeat
from lockstep.streams.detector import SlowdownDetector
from lockstep.streams.heartbeats import HeartbeatShards, Held, Rows
from lockstep.streams.policy import Policy

WORKERS, SHARD, INTERVAL, LAG = 64, 16, 0.2, 0.05


def step_times(n_healthy=40, n_slow=100, seed=1):
    rng = np.random.default_rng(seed)
    return np.r_[0.2 * rng.normal(1, 0.01, n_healthy), 0.26 * rng.normal(1, 0.01, n_slow)]


def rows(step: int, st: float, workers: np.ndarray, sent: float) -> Rows:
    n = workers.size
    return Rows(
        workers.astype(np.int64),
        np.full(n, step, dtype=np.int64),
        st * (1 + 0.001 * workers),
        np.full(n, sent),
        np.zeros(n, dtype=np.int64),
    )


def by_records(times) -> list[tuple[str, int, int]]:
    det = SlowdownDetector(Policy())
    out = []
    for step, st in enumerate(times):
        sent = 1000.0 + step * INTERVAL
        for w in range(WORKERS):
            hb = StepHeartbeat(
                job="j", worker=w, step=step, step_time_s=float(st) * (1 + 0.001 * w), host=f"h{w // 8}", sent_at=sent
            )
            out += det.observe(hb, now=sent + LAG)
    return [(t.window, t.start_step, t.steps) for t in out]


def by_shards(times, replay_every: int = 0) -> tuple[list[tuple[str, int, int]], int]:
    """Four shards of 16 on two partitions (two processors); ``replay_every``: every so many steps, a shard's
    partials of that step are delivered twice (a processor that crashed before its commit)."""
    det = SlowdownDetector(Policy())
    shards: HeartbeatShards[int] = HeartbeatShards()
    out, partials = [], 0
    for step, st in enumerate(times):
        sent = 1000.0 + step * INTERVAL
        now = sent + LAG
        keys = []
        for shard in range(WORKERS // SHARD):
            key = ("j", shard, shard % 2)
            keys.append(key)
            workers = np.arange(shard * SHARD, (shard + 1) * SHARD)
            shards.add(key, "", rows(step, float(st), workers, sent), [Held(step)], now)
        for partial, _ in shards.ready(keys, now):
            partials += 1
            out += det.observe_partial(partial, now)
            if replay_every and step % replay_every == 0:
                out += det.observe_partial(partial, now)
    return [(t.window, t.start_step, t.steps) for t in out], partials


def test_partials_of_four_shards_on_two_partitions_trigger_as_every_heartbeat_does():
    times = step_times()
    want = by_records(times)
    assert want, "the slowdown must trigger a window"
    got, partials = by_shards(times)
    assert got == want
    assert partials == len(times) * WORKERS // SHARD  # one per shard and step: 4 records per step instead of 64


def test_a_replayed_partial_counts_once():
    times = step_times(seed=2)
    assert by_shards(times, replay_every=3)[0] == by_records(times)


def test_a_shard_step_waits_for_its_members_not_for_a_later_step_and_goes_at_the_lateness_bound():
    shards: HeartbeatShards[int] = HeartbeatShards(lateness_s=2.0)
    key = ("j", 0, 0)
    workers = np.arange(16)
    for step in range(3):  # no world size: the shard learns its members during its first 2 s
        shards.add(key, "", rows(step, 0.2, workers, 1000.0 + step / 10), [Held(step)], 1000.0 + step / 10)
        assert shards.ready([key], 1000.0 + step / 10) == []
    assert [(p.step, p.closed) for p, _ in shards.expire(1002.0)] == [(s, "complete") for s in range(3)]
    for step in range(3, 8):  # worker 15 is behind: later steps do not close step 3
        now = 1002.0 + step / 10
        shards.add(key, "", rows(step, 0.2, workers[:15], 1000.0 + step / 10), [Held(step)], now)
        assert shards.ready([key], now) == []
    assert shards.expire(1004.2) == []
    out = shards.expire(1004.45)  # step 3 opened at 1002.3, step 4 at 1002.4: they waited 2 s
    assert [(p.step, p.workers, p.members, p.missing, p.closed) for p, _ in out] == [
        (3, 15, 16, [15], "timeout"),
        (4, 15, 16, [15], "timeout"),
    ]
    assert [done for _, done in out] == [[3], [4]]  # the record that fed a step is released with its partial
    assert shards.late == 0
    shards.add(key, "", rows(3, 0.2, workers[15:], 1000.3), [Held(99)], 1004.5)  # worker 15's step 3, too late
    assert shards.late == 1


def test_the_detector_waits_for_a_shard_whose_partials_wait_for_a_late_worker():
    """Two shards of two workers; shard 1's partials come 1.9 s after shard 0's (they waited for a late worker), 20
    steps behind at 11 steps/s.  Every step is judged with both shards (shard 1's slowest is the step's), never
    closed because shard 0's later steps came first; the job's membership is both shards'."""
    from lockstep.schemas.records import StepPartial

    det = SlowdownDetector(Policy())
    arrivals = []
    for step in range(200):
        sent = 1000.0 + 0.09 * step
        for shard, delay, slowest in ((0, 0.3, 0.09), (1, 2.2, 0.1)):
            p = StepPartial(
                job="j",
                step=step,
                shard=shard,
                partition=shard,
                workers=2,
                slowest_s=slowest,
                members=2,
                clock_worker=2 * shard,
                clock_sent_at=sent,
                newest_sent_at=sent,
                highest=step,
            )
            arrivals.append((sent + delay, p))
    for now, p in sorted(arrivals, key=lambda a: a[0]):
        det.observe_partial(p, now)
    st = det.jobs["j"]
    assert st.last_complete >= 150 and len(st.history) == st.last_complete + 1
    assert set(st.history) == {0.1}  # shard 1's partial was in every step judged
    assert det.active_workers(st) == 4


def test_a_far_future_step_among_a_new_shards_first_rows_is_refused_with_them_not_after():
    """A new job's first heartbeats and a step a million ahead in one batch of records: the shard knew nothing yet,
    so the far one was judged against nothing and poisoned the shard (the bad-input test failed when they shared a
    fetch)."""
    import numpy as np

    from lockstep.streams.heartbeats import HeartbeatShards

    shards = HeartbeatShards()
    steps = np.array([*range(40), 1_000_039])
    bad = shards.future(("fj", -1, 0), steps, np.full(steps.size, 1.8e9), 1.8e9)
    assert bad.tolist() == [False] * 40 + [True]
    assert "not plausible" in shards.future_detail(("fj", -1, 0), steps[-1:], np.full(1, 1.8e9), 1.8e9)
    # a resumed job's first steps may be anywhere: alone, or all together, they are not judged
    assert not shards.future(("r", -1, 0), np.arange(500_000, 500_040), np.full(40, 1.8e9), 1.8e9).any()
