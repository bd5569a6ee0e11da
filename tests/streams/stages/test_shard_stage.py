"""The shard stage in memory: a shard's workers handed to the step stage as one slice per step, acknowledgements
only after them, bad records and table values, a worker that never comes, replays, slices cut to size, a
revoked partition; and the step stage assembling steps from slices, alone or with feature batches."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from lockstep.kafka import Topics, window_features_key
from lockstep.schemas import functions as ft
from lockstep.schemas.records import Finding, StepReport, StepSlice, decode, encode
from lockstep.streams.stages import Partition
from lockstep.streams.stages import shard as shard_module

TOPICS = Topics.named("t")  # the pair's


def shipped(p, records) -> list:
    return [
        p.produce(TOPICS.windowfeatures, window_features_key(r.job, r.window, r.shard).decode(), r) for r in records
    ]


def slices(p) -> list[StepSlice]:
    return [s for s in p.sent(TOPICS.features) if isinstance(s, StepSlice)]


def reports(p) -> list[StepReport]:
    return [r for r in p.sent(TOPICS.stepreports) if isinstance(r, StepReport)]


def findings(p) -> list[Finding]:
    return [f for f in p.sent(TOPICS.findings) if isinstance(f, Finding)]


async def test_a_complete_shard_sends_one_slice_per_step_and_only_then_acknowledges_its_records(pair, window_features):
    p = pair()
    recs = shipped(p, window_features[:4])  # shard 0: workers 0-3
    await p.feed(recs[:3])
    assert slices(p) == [] and p.acked(TOPICS.windowfeatures) == [] and len(p.proc.shards.assembler) == 1
    await p.feed(recs[3:])
    got = slices(p)
    assert [(s.step, s.shard, s.missing) for s in got] == [(60, 0, []), (61, 0, [])]
    assert [k.key for k in p.out.records(TOPICS.features)] == [b"j:60", b"j:61"]
    workers = ft.unpack_ipc(got[0].workers)
    assert (
        workers.column("rank").to_pylist() == [0, 1, 2, 3]
        and sum(workers.column("rows").to_pylist())
        == ft.unpack_ipc(got[0].functions, got[0].functions_codec, size=got[0].functions_size).num_rows
    )
    assert sum(s.bytes_in for s in got) == pytest.approx(
        sum(len(r.value) for r in recs), abs=8
    )  # the agents' bytes, shared out over the steps
    assert (
        p.acked(TOPICS.windowfeatures) == [0, 1, 2, 3]
        and p.proc.metrics.get("shards_closed_total", reason="complete") == 1
    )


async def test_steps_from_slices_give_the_findings_of_steps_from_feature_batches(pair, window_features, batches):
    old, new = pair(partitions=3), pair(partitions=3)
    for step in sorted(batches):
        await old.feed([old.produce(TOPICS.features, f"j:{b.step}", b) for b in batches[step]])
    await old.pump()
    await new.feed(shipped(new, window_features))
    await new.pump()
    assert [(r.step, r.workers_seen, r.closed) for r in reports(new)] == [
        (r.step, r.workers_seen, r.closed) for r in reports(old)
    ]
    assert [(f.id, f.workers, f.cause, f.confidence, f.evidence) for f in findings(new)] == [
        (f.id, f.workers, f.cause, f.confidence, f.evidence) for f in findings(old)
    ] and findings(new)
    assert (
        new.dead() == {} and len(new.out.acknowledged) == len(window_features) + 2 * 2 + 2
    )  # records, slices, step reports


async def test_a_job_whose_agents_send_both_records_is_one_step(pair, window_features, batches):
    """Agents of one job upgraded in turn: workers 0-3 send WindowFeatures, 4-7 FeatureBatches."""
    p = pair()
    await p.feed(shipped(p, window_features[:4]))
    await p.pump()
    for step in sorted(batches):
        await p.feed([p.produce(TOPICS.features, f"j:{b.step}", b) for b in batches[step][4:]])
    await p.pump()
    assert [(r.step, r.workers_seen, r.closed) for r in reports(p)] == [(60, 8, "complete"), (61, 8, "complete")]
    assert [(f.workers, f.cause) for f in findings(p)] == [([3], "gpu_slow")]


async def test_a_worker_that_never_sends_is_declared_missing_and_the_step_does_not_wait_for_it(pair, window_features):
    p = pair(step_timeout_s=5.0)
    await p.feed(shipped(p, [w for w in window_features if w.worker.rank != 6]))
    await p.pump()
    assert [s.shard for s in slices(p)] == [0, 0]  # shard 1 waits for worker 6
    p.clock.t += 5.0
    await p.proc.shards.on_timer(p.clock.t)
    await p.pump()
    assert [(s.shard, s.missing, s.missing_ranges) for s in slices(p)][2:] == [(1, [6], [(6, 6)]), (1, [6], [(6, 6)])]
    assert [(r.workers_seen, r.closed) for r in reports(p)] == [
        (7, "complete"),
        (7, "complete"),
    ]  # accounted for: no step timeout
    assert p.proc.metrics.get("shards_closed_total", reason="timeout") == 1


async def test_a_bad_record_or_table_is_dead_lettered_and_its_worker_declared_missing(pair, window_features):
    p = pair()
    t = ft.read_compact(window_features[2].functions)
    col = t.column("critical_us").to_numpy(zero_copy_only=False).copy()
    col[-1] = float("inf")  # a value of the last step
    t = t.set_column(t.column_names.index("critical_us"), t.schema.field("critical_us"), ft.pa.array(col))
    spoilt = msgspec.structs.replace(window_features[2], functions=ft.pack(t))
    recs = shipped(p, [window_features[0], spoilt, window_features[1]])
    junk = p.produce(TOPICS.windowfeatures, "j:w60:0", b"\x93junk")
    await p.feed([*recs, junk, *shipped(p, window_features[3:4])])
    assert p.dead() == {("shards", "bad_function_table"): 1, ("shards", "malformed"): 1}
    assert "critical_us must be finite" in p.sent(TOPICS.deadletter)[1].detail
    assert [s.missing for s in slices(p)] == [[2], [2]]  # the refused worker: accounted for, not waited for
    assert p.acked(TOPICS.windowfeatures) == [0, 1, 2, 3, 4]


async def test_a_replayed_shard_adds_nothing(pair, window_features):
    """After the shard closed its records are late; after a crash the next owner sends the same slices again,
    which the step stage takes as nothing new."""
    p = pair()
    recs = shipped(p, window_features)
    await p.feed(recs)
    await p.feed(recs[:1])  # a twin after the close
    assert p.proc.metrics.get("late_records_total", stage="shards") == 1
    again = pair(out=p.out)  # a restarted processor replays the topic from its start
    await again.feed(recs)
    assert [s.value for s in p.out.records(TOPICS.features)[:4]] == [
        s.value for s in p.out.records(TOPICS.features)[4:]
    ]
    await p.pump()  # the first processor's step stage reads all eight slices
    assert [(r.step, r.workers_seen) for r in reports(p)] == [(60, 8), (61, 8)]


async def test_a_slice_over_the_size_bound_is_cut_and_the_step_still_gets_every_worker(
    pair, window_features, monkeypatch
):
    monkeypatch.setattr(shard_module, "SLICE_MAX_BYTES", 2000)
    p = pair()
    await p.feed(shipped(p, window_features))
    assert len(slices(p)) == 16  # every worker's step alone
    await p.pump()
    assert [(r.step, r.workers_seen, r.closed) for r in reports(p)] == [(60, 8, "complete"), (61, 8, "complete")]


async def test_a_slice_that_does_not_add_up_is_dead_lettered_by_the_step_stage(pair, window_features):
    p = pair()
    await p.feed(shipped(p, window_features[:4]))
    good = slices(p)[0]
    wrong = msgspec.structs.replace(good, workers=ft.pack(ft.unpack_ipc(good.workers).slice(0, 3)))
    await p.feed([p.produce(TOPICS.features, "j:60", wrong)])
    assert p.dead() == {("steps", "bad_function_table"): 1}
    assert "slice workers claim" in p.sent(TOPICS.deadletter)[0].detail


async def test_a_revoked_partition_drops_its_open_shards(pair, window_features):
    p = pair()
    await p.feed(shipped(p, window_features[:3]))
    p.proc.shards.on_revoked({Partition(TOPICS.windowfeatures, 0)})
    assert len(p.proc.shards.assembler) == 0
    await p.feed(shipped(p, window_features[3:4]))
    assert slices(p) == [] and len(p.proc.shards.assembler) == 1  # a new shard here: the new owner replays the rest


def test_the_slice_path_encodes_what_decode_reads(window_features):
    """A StepSlice survives the codec with its tables (the step stage's read checks them against each other)."""
    from lockstep.streams.stages.step import read_slice
    from lockstep.streams.windows import Handle, ShardAssembler

    a: ShardAssembler = ShardAssembler(60.0)
    for i, w in enumerate(window_features[:4]):
        closed, _ = a.add(w, ft.read_compact(w.functions), len(encode(w)), Handle(0, i, None), 0.0)
    out, errors = shard_module.step_slices(closed.pending, ("pp",))
    assert errors == [] and [s for s, _ in out] == [60, 61]
    workers, functions = read_slice(decode(out[0][1], StepSlice))
    assert workers.num_rows == 4 and functions.num_rows == sum(workers.column("rows").to_pylist())


def test_missing_workers_travel_as_ranges_and_the_list_only_when_short():
    """Issue 22: a shard of 4,096 members of which 4,000 sent nothing named them one by one (a list of up to 100,000
    ranks in every slice of every step); now as inclusive ranges, and the old list only when it names at most 64."""
    from lockstep.schemas.records import MAX_MISSING_RANKS, RecordError, ranks_as_ranges

    assert ranks_as_ranges([0, 1, 2, 5, 7, 8]) == [(0, 2), (5, 5), (7, 8)] and ranks_as_ranges([]) == []
    base = StepSlice(
        job="j", window="w", step=0, window_start=0, window_steps=1, expected_workers=4096, shard=0, workers=b"",
        functions=b"", missing=[5000], missing_ranges=ranks_as_ranges(np.r_[0:4000, 4010]),
    )  # fmt: skip
    back = decode(encode(base), StepSlice)
    assert back.missing_ranges == [(0, 3999), (4010, 4010)]
    assert sorted(back.missing_workers()) == [*range(4000), 4010, 5000]
    assert len(encode(base)) < 300  # the 4,001 ranks as a list: ~12 KB of MessagePack
    for bad, why in [
        ([(5, 4)], "empty"),
        ([(0, 9), (9, 12)], "not after"),
        ([(0, MAX_MISSING_RANKS)], "over"),
    ]:
        with pytest.raises(RecordError, match=why):
            decode(encode(msgspec.structs.replace(base, missing_ranges=bad)), StepSlice)


async def test_a_shard_missing_many_workers_sends_ranges_and_no_list(pair, window_features):
    """A shard of 256 members of which 8 sent: 248 missing, one range, no list (older readers wait out the step)."""
    p = pair(step_timeout_s=5.0)
    wide = [msgspec.structs.replace(w, shard=0, shard_workers=256, expected_workers=256) for w in window_features]
    await p.feed(shipped(p, wide))
    p.clock.t += 5.0
    await p.proc.shards.on_timer(p.clock.t)
    await p.pump()
    assert [(s.shard, s.missing, s.missing_ranges) for s in slices(p)] == [(0, [], [(8, 255)])] * 2
    assert [(r.workers_seen, r.closed) for r in reports(p)] == [(8, "complete"), (8, "complete")]


async def test_a_shards_slices_are_built_and_sent_one_at_a_time(pair, window_features, monkeypatch):
    """Issue 22: the shard stage built every slice of the window (one per step, up to 64) before sending the first."""
    built: list[int] = []
    encoded = shard_module._encoded
    monkeypatch.setattr(shard_module, "_encoded", lambda base, *a: built.append(base.step) or encoded(base, *a))
    p = pair()
    sends = p.out.send

    async def send(topic, key, value):
        if topic == TOPICS.features:
            assert built == [decode(value, StepSlice).step]  # this slice built, the next not yet
            built.clear()
        return await sends(topic, key, value)

    p.out.send = send
    await p.feed(shipped(p, window_features[:4]))
    assert [s.step for s in slices(p)] == [60, 61]


def with_ring_connections(records, culprit: int, lost: int = 2_000):
    """The records with each worker's TCP connections of a ring sending r -> r-1: ``culprit``'s link loses ``lost``
    of 40,000 segments both ways."""
    from lockstep.schemas.records import Connection

    n = len(records)
    conns: dict[int, list[Connection]] = {r: [] for r in range(n)}
    for r in range(n):
        to = (r - 1) % n
        a, b = f"10.0.0.{r + 1}:4{r:04d}", f"10.0.0.{to + 1}:5{to:04d}"
        bad = culprit in (r, to)
        conns[r].append(Connection(local=a, peer=b, segs_out=40_000, retrans=lost if bad else 3, rtt_us=80.0))
        conns[to].append(Connection(local=b, peer=a, segs_out=0, retrans=0, rtt_us=60.0))
    return [msgspec.structs.replace(rec, connections=conns[rec.worker.rank]) for rec in records]


@pytest.mark.parametrize("cut", [False, True])
async def test_the_workers_connections_reach_the_window_stage_once_and_name_a_lossy_link(
    pair, window_features, monkeypatch, cut
):
    if cut:  # slices cut to one worker each: each worker's connections go with its own part
        monkeypatch.setattr(shard_module, "SLICE_MAX_BYTES", 2000)
    p = pair()
    recs = shipped(p, with_ring_connections(window_features, culprit=6))
    await p.feed(recs)
    carried = [s for s in slices(p) if s.connections]
    assert {s.step for s in carried} == {60}  # the workers' first step only
    assert sorted(ft.unpack_ipc(s.connections).column("worker").to_pylist().count(6) for s in carried)[-1] == 2
    await p.pump()
    nic = [f for f in findings(p) if f.cause == "nic"]
    assert [(f.workers, f.scope) for f in nic] == [([6], "worker")], [(f.workers, f.cause) for f in findings(p)]
    ev = {e.feature: e for e in nic[0].evidence}
    assert ev["tcp_retrans_share"].value == pytest.approx(0.05) and ev["lossy_peers"].value == 2
    # the simulated fault is still found beside it
    assert any(f.workers == [3] for f in findings(p))


async def test_a_slice_whose_connections_are_not_a_connection_table_is_dead_lettered(pair, window_features):
    import pyarrow as pa

    p = pair()
    await p.feed(shipped(p, with_ring_connections(window_features[:4], culprit=1)))
    good = next(s for s in slices(p) if s.connections)
    wrong = msgspec.structs.replace(good, connections=ft.pack(pa.table({"worker": [0], "local": ["a:1"]})))
    conns = ft.unpack_ipc(good.connections)
    negative = msgspec.structs.replace(
        good, connections=ft.pack(conns.set_column(3, "segs_out", pa.array([-1] * conns.num_rows, pa.int64())))
    )
    await p.feed([p.produce(TOPICS.features, "j:60", wrong), p.produce(TOPICS.features, "j:60", negative)])
    assert p.dead() == {("steps", "bad_function_table"): 2}
    details = [d.detail for d in p.sent(TOPICS.deadletter)]
    assert "is not a connection table" in details[0] and "segs_out holds an empty or negative value" in details[1]
