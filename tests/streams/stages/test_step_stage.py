"""The step stage in memory: a step's report, acknowledgements in offset order only after it, bad records,
timeouts, late and replayed records, a bug in the analysis, a partition revoked mid-step."""

from __future__ import annotations

import msgspec
import pytest

from lockstep.kafka import Topics
from lockstep.schemas import functions as ft
from lockstep.schemas.records import StepReport, encode
from lockstep.streams.stages import Partition
from lockstep.streams.stages import step as step_module

TOPICS = Topics.named("t")  # the pair's


def features(p, batches) -> list:
    return [p.produce(TOPICS.features, f"{b.job}:{b.step}", b) for b in batches]


def reports(p) -> list[StepReport]:
    return [r for r in p.sent(TOPICS.stepreports) if isinstance(r, StepReport)]


async def test_a_complete_step_is_reported_once_and_only_then_are_its_records_acknowledged(pair, batches):
    p = pair()
    recs = features(p, batches[60])
    await p.feed(recs[:-1])
    assert reports(p) == [] and p.acked(TOPICS.features) == [] and len(p.proc.steps.assembler) == 1
    await p.feed(recs[-1:])
    (r,) = reports(p)
    assert (r.job, r.window, r.step, r.workers_seen, r.expected_workers, r.closed) == ("j", "w60", 60, 8, 8, "complete")
    assert r.bytes_in == sum(len(x.value) for x in recs)
    assert p.acked(TOPICS.features) == list(range(8))
    m = p.proc.metrics
    assert m.get("steps_closed_total", reason="complete") == 1 and m.get("step_close_latency_seconds") == 1
    assert m.get("records_out_total", topic=TOPICS.stepreports) == 1 and m.get("open_steps") == 0


async def test_a_batch_of_records_is_the_same_as_one_at_a_time(pair, batches):
    one, many = pair(), pair()
    await one.feed(features(one, batches[60] + batches[61]))
    await many.feed(features(many, batches[60] + batches[61]), batch=True)
    assert [r.value for r in one.out.records(TOPICS.stepreports)] == [
        r.value for r in many.out.records(TOPICS.stepreports)
    ]
    assert one.acked(TOPICS.features) == many.acked(TOPICS.features) == list(range(16))


async def test_acks_wait_for_every_earlier_record_of_the_partition(pair, batches):
    """Step 60 stays open (one worker missing); step 61, later in the same partition, closes: its records
    may not be acknowledged before 60's, or a crash would commit past an open step."""
    p = pair(partitions=1)
    recs = features(p, batches[60][:7] + batches[61])
    await p.feed(recs)
    assert [r.step for r in reports(p)] == [61]
    assert p.acked(TOPICS.features) == []
    await p.feed(features(p, batches[60][7:]))
    assert [r.step for r in reports(p)] == [61, 60]
    assert p.acked(TOPICS.features) == list(range(16))


async def test_a_bad_record_is_dead_lettered_and_acknowledged_in_its_turn(pair, batches):
    p = pair()
    first = features(p, batches[60][:4])
    junk = p.produce(TOPICS.features, "j:60", b"\x00not a record")
    rest = features(p, batches[60][4:])
    await p.feed([*first, junk])
    assert p.dead() == {("steps", "malformed"): 1}
    assert p.acked(TOPICS.features) == []  # offset 4 is done, but 0-3 are held by the open step
    (dl,) = p.sent(TOPICS.deadletter)
    assert (dl.topic, dl.partition, dl.offset, dl.payload) == (TOPICS.features, 0, 4, junk.value)
    assert p.out.records(TOPICS.deadletter)[0].key == b"j:60"  # under the record's own key
    await p.feed(rest)
    assert reports(p)[0].workers_seen == 8 and p.acked(TOPICS.features) == list(range(9))
    assert p.proc.metrics.get("dead_letters_total", reason="malformed", stage="steps") == 1


async def test_a_table_whose_values_fail_the_step_check_goes_to_the_dead_letters_and_the_step_goes_on(pair, batches):
    p = pair()
    bad = batches[60][2]
    t = ft.unpack(bad.functions)
    col = t.column("total_us").to_numpy(zero_copy_only=False).copy()
    col[0] = -1.0
    t = t.set_column(
        t.column_names.index("total_us"), t.schema.field("total_us"), ft.pa.array(col)
    )  # still in the schema: read as is
    spoilt = msgspec.structs.replace(bad, functions=ft.pack(t))
    await p.feed(features(p, [*batches[60][:2], spoilt, *batches[60][3:]]))
    assert p.dead() == {("steps", "bad_function_table"): 1}
    (r,) = reports(p)
    assert r.workers_seen == 7  # the step closed (8 records) and was analysed without the refused one
    assert p.acked(TOPICS.features) == list(range(8))


async def test_a_step_missing_workers_closes_on_the_timer(pair, batches):
    p = pair(step_timeout_s=5.0)
    await p.feed(features(p, batches[60][:6]))
    await p.proc.steps.on_timer(p.clock.t + 4.9)
    assert reports(p) == []
    p.clock.t += 5.0
    await p.proc.steps.on_timer(p.clock.t)
    (r,) = reports(p)
    assert (r.closed, r.workers_seen) == ("timeout", 6) and p.acked(TOPICS.features) == list(range(6))
    assert p.proc.metrics.get("steps_closed_total", reason="timeout") == 1


async def test_a_record_for_a_closed_step_is_late_and_a_replayed_twin_replaces_its_first_copy(pair, batches):
    p = pair()
    await p.feed(
        features(p, [*batches[60][:4], batches[60][0], *batches[60][4:]])
    )  # worker 0 twice (a producer's retry)
    (r,) = reports(p)
    assert r.workers_seen == 8 and p.acked(TOPICS.features) == list(range(9))
    await p.feed(features(p, batches[60][3:4]))  # after the close: late, acknowledged at once
    assert len(reports(p)) == 1 and p.acked(TOPICS.features)[-1] == 9
    assert p.proc.metrics.get("late_records_total", stage="steps") == 1


async def test_a_bug_in_the_analysis_dead_letters_the_steps_records_and_the_stage_goes_on(pair, batches, monkeypatch):
    p = pair()
    real = step_module.analyze_step

    def broken(frame, policy):
        if frame.step == 60:
            raise ZeroDivisionError("a bug")
        return real(frame, policy)

    monkeypatch.setattr(step_module, "analyze_step", broken)
    await p.feed(features(p, batches[60] + batches[61]))
    assert p.dead() == {("steps", "processing_failed"): 8}
    assert "ZeroDivisionError: a bug" in p.sent(TOPICS.deadletter)[0].detail
    assert [r.step for r in reports(p)] == [61]
    assert p.acked(TOPICS.features) == list(range(16))


async def test_a_revoked_partition_is_forgotten_and_its_new_owner_replays_it(pair, batches):
    """The committed offset stayed before the open step's records: the new owner reads them again and reports
    the step once, as the old owner would have."""
    old = pair()
    recs = features(old, batches[60])
    await old.feed(recs[:5])
    old.proc.steps.on_revoked({Partition(TOPICS.features, 0)})
    assert len(old.proc.steps.assembler) == 0 and old.acked(TOPICS.features) == []
    await old.feed(recs[5:])  # a stale fetch after the revocation: not a complete step here
    assert reports(old) == []
    new = pair(out=old.out)
    await new.feed(recs)  # replayed from offset 0
    (r,) = reports(new)
    assert r.workers_seen == 8
    unrevoked = pair()
    await unrevoked.feed(features(unrevoked, batches[60]))
    assert encode(r) == unrevoked.out.records(TOPICS.stepreports)[0].value


@pytest.mark.parametrize("partitions", [1, 3])
async def test_every_record_is_acknowledged_exactly_once(pair, batches, partitions):
    p = pair(partitions=partitions)
    recs = features(p, batches[60] + batches[61])
    await p.feed(recs)
    assert sorted((r.partition, r.offset) for r in p.out.acknowledged) == sorted((r.partition, r.offset) for r in recs)


@pytest.mark.parametrize("seed", range(20))
def test_missing_workers_names_the_first_missing_ranks_and_counts_all_without_a_rank_per_expected_worker(seed):
    import numpy as np

    from lockstep.schemas.records import MAX_NAMED_MISSING
    from lockstep.streams.stages.step import missing_workers

    rng = np.random.default_rng(seed)
    expected = int(rng.integers(1, 400))
    seen = rng.integers(-3, expected + 5, size=int(rng.integers(0, 300)))
    lost = np.setdiff1d(np.arange(expected), seen)
    assert missing_workers(expected, seen) == (lost[:MAX_NAMED_MISSING].tolist(), int(lost.size))
    named, total = missing_workers(10_000_000, np.arange(4))  # a record's claim: counted, not enumerated
    assert total == 9_999_996 and named == list(range(4, 4 + MAX_NAMED_MISSING))
