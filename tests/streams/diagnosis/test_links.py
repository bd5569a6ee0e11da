"""Lossy and slow links named from the workers' TCP connections (streams/diagnosis/links.py)."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from lockstep.schemas.events import CONNECTION_SCHEMA
from lockstep.streams.diagnosis.links import between_hosts, lossy_links, slow_links
from lockstep.streams.policy import DiagnosisPolicy

DP = DiagnosisPolicy()


def ip(w: int) -> str:
    return f"10.0.0.{w + 1}"


def table(conns: list[tuple[int, int, int, int]], *, extra: list[dict] | None = None) -> pa.Table:
    """``(sender, receiver, segs_out, retrans)`` per connection: each is seen by both ends, the receiver sending
    only acknowledgements on it (no data segments)."""
    rows = []
    for i, (a, b, segs, retrans) in enumerate(conns):
        pa_, pb = 40000 + i, 50000 + i
        rows.append(dict(worker=a, local=f"{ip(a)}:{pa_}", peer=f"{ip(b)}:{pb}", segs_out=segs, retrans=retrans))
        rows.append(dict(worker=b, local=f"{ip(b)}:{pb}", peer=f"{ip(a)}:{pa_}", segs_out=0, retrans=0))
    return pa.Table.from_pylist(rows + (extra or []), schema=CONNECTION_SCHEMA)


def ring(n: int, lossy: set[tuple[int, int]], segs: int = 30_000, lost: int = 1_500) -> pa.Table:
    """A ring sending r -> r-1 (as gloo's ring all-reduce does); the pairs in ``lossy`` lose ``lost`` segments."""
    conns = []
    for r in range(n):
        a, b = r, (r - 1) % n
        conns.append((a, b, segs, lost if (a, b) in lossy else 3))
    return table(conns)


def named(t: pa.Table, dp: DiagnosisPolicy = DP) -> list[tuple[int, tuple[int, ...]]]:
    return [(x.worker, x.peers) for x in lossy_links(t, dp)]


def test_a_workers_lossy_link_in_a_ring_names_it_not_its_neighbours():
    # worker 2's link drops packets both ways: its connection to 1 and the one from 3 lose
    assert named(ring(4, {(2, 1), (3, 2)})) == [(2, (1, 3))]
    assert named(ring(8, {(5, 4), (6, 5)})) == [(5, (4, 6))]
    assert named(ring(3, {(1, 0), (2, 1)})) == [(1, (0, 2))]


def test_the_evidence_says_how_much_was_lost_against_the_other_connections():
    (link,) = lossy_links(ring(4, {(2, 1), (3, 2)}, segs=10_000, lost=600), DP)
    assert link.retrans == 1_200 and link.segs_out == 20_000 and link.loss == pytest.approx(0.06)
    assert link.others_loss == pytest.approx(3 / 10_000)
    assert link.lossy == 2 and link.judged == 4


def test_a_pair_names_neither_worker():
    # the one connection between two workers is both workers' link
    assert named(ring(2, {(1, 0), (0, 1)})) == []
    assert named(table([(0, 1, 30_000, 2_000)])) == []


def test_a_network_where_every_connection_loses_names_no_worker():
    assert named(ring(4, {(0, 3), (1, 0), (2, 1), (3, 2)})) == []


def test_a_worker_every_peer_loses_with_in_a_full_mesh_is_named():
    conns = [(a, b, 20_000, 800 if 0 in (a, b) else 0) for a in range(4) for b in range(4) if a != b]
    assert named(table(conns)) == [(0, (1, 2, 3))]


def test_two_faulty_links_apart_are_both_named():
    assert named(ring(8, {(2, 1), (3, 2), (6, 5), (7, 6)})) == [(2, (1, 3)), (6, (5, 7))]


def test_below_the_bars_nothing_is_lossy():
    # 0.4% sent again: under link_loss_min
    assert named(ring(4, {(2, 1), (3, 2)}, segs=100_000, lost=400)) == []
    # too few segments to judge
    assert named(ring(4, {(2, 1), (3, 2)}, segs=500, lost=100)) == []
    # a high share of very few segments sent again
    assert named(ring(4, {(2, 1), (3, 2)}, segs=1_000, lost=9)) == []
    # the policy's bar decides
    assert named(ring(4, {(2, 1), (3, 2)}, segs=100_000, lost=400), dataclasses.replace(DP, link_loss_min=0.003)) == [
        (2, (1, 3))
    ]


def test_connections_to_what_is_not_a_worker_do_not_count():
    # a lossy connection to a broker or a store (its other end in no worker's table) and one to itself
    outside = [
        dict(worker=2, local=f"{ip(2)}:1000{i}", peer=f"10.9.9.9:909{i}", segs_out=50_000, retrans=5_000)
        for i in range(3)
    ]
    loopback = [
        dict(worker=2, local=f"{ip(2)}:2000", peer=f"{ip(2)}:2001", segs_out=50_000, retrans=5_000),
        dict(worker=2, local=f"{ip(2)}:2001", peer=f"{ip(2)}:2000", segs_out=50_000, retrans=5_000),
    ]
    t = ring(4, set())
    t = pa.concat_tables([t, pa.Table.from_pylist(outside + loopback, schema=CONNECTION_SCHEMA)])
    assert named(t) == []


def test_an_endpoint_two_workers_claim_is_left_out():
    # two agents report the same local endpoint (a copied table, a NAT): which worker is at the other end is unknown
    t = ring(4, {(2, 1), (3, 2)})
    rows = t.to_pylist()
    clone = next(r for r in rows if r["worker"] == 2 and r["segs_out"] > 0)
    rows.append({**clone, "worker": 0})
    assert 2 not in [w for w, _ in named(pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA))]


def test_no_table_or_an_empty_one_names_nobody():
    assert lossy_links(None, DP) == []
    assert lossy_links(CONNECTION_SCHEMA.empty_table(), DP) == []


def test_a_window_takes_each_connection_once_from_its_step_results():
    # a replayed shard's twin slices bring a worker's connections twice: they count once
    from lockstep.streams.diagnosis.step import StepResult
    from lockstep.streams.diagnosis.window import window_connections

    t = ring(4, {(2, 1), (3, 2)})
    empty = pa.table({})

    def result(step: int, conns: pa.Table | None) -> StepResult:
        return StepResult("j", "w", step, 4, 1.0, 1.0, 1.0, 1.0, empty, empty, connections=conns)

    got = window_connections([result(1, t), result(1, t.slice(0, 3)), result(2, None)])
    assert got.num_rows == t.num_rows and got.equals(t)
    assert window_connections([result(1, None)]) is None
    assert named(got) == [(2, (1, 3))]


# --------------------------------------------------------------------------- slow links


def busy_ring(
    n: int,
    mbps: dict[tuple[int, int], float],
    *,
    healthy: float = 800.0,
    sent: int = 40_000_000,
    control: bool = False,
) -> pa.Table:
    """A ring sending r -> r-1 whose connections ran at ``healthy`` MB/s while busy, those in ``mbps`` at theirs;
    the receiving end's row carries no data (segs_out 0), as the kernel counts it, or with ``control`` the small
    messages gloo's receiving end sends back, as recorded in a 24-step window of an 8-rank ring (1,344 segments of
    48 bytes, busy 0.2 s: past the segment floor)."""
    rows = []
    for r in range(n):
        a, b = r, (r - 1) % n
        rate = mbps.get((a, b), healthy)
        pa_, pb = 40000 + r, 50000 + r
        rows.append(
            dict(worker=a, local=f"{ip(a)}:{pa_}", peer=f"{ip(b)}:{pb}", segs_out=sent // 1448, retrans=0,
                 bytes_sent=sent, busy_us=int(sent / rate), rwnd_limited_us=0, sndbuf_limited_us=0, rtt_us=300.0)
        )  # fmt: skip
        back = dict(worker=b, local=f"{ip(b)}:{pb}", peer=f"{ip(a)}:{pa_}", segs_out=0, retrans=0)
        if control:
            back |= dict(segs_out=1_344, bytes_sent=64_512, busy_us=200_000, rwnd_limited_us=0, sndbuf_limited_us=0)
        rows.append(back)
    return pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)


def slow(t: pa.Table, dp: DiagnosisPolicy = DP) -> list[tuple[int, tuple[int, ...]]]:
    return [(x.worker, x.peers) for x in slow_links(t, dp)]


def test_a_workers_slow_link_in_a_ring_names_it_not_its_neighbours():
    # worker 2's link is shaped both ways: its connection to 1 and the one from 3 deliver at 120 MB/s
    assert slow(busy_ring(4, {(2, 1): 120.0, (3, 2): 130.0})) == [(2, (1, 3))]
    assert slow(busy_ring(8, {(5, 4): 120.0, (6, 5): 110.0})) == [(5, (4, 6))]
    assert slow(busy_ring(3, {(1, 0): 300.0, (2, 1): 350.0})) == [(1, (0, 2))]
    (link,) = slow_links(busy_ring(4, {(2, 1): 100.0, (3, 2): 200.0}), DP)
    assert link.mbps == pytest.approx(200.0) and link.others_mbps == pytest.approx(800.0)
    assert link.judged == 4 and link.rtt_us == 300.0


def test_control_ends_of_the_connections_are_not_compared_with_the_data_ends():
    # in a longer window the ends that send only control messages pass the segment floor; their throughput while
    # busy (0.3 MB/s) is their latency: among the others they would pull the median below any slow link's
    slowed = {(5, 4): 78.0, (6, 5): 105.0}
    assert slow(busy_ring(8, slowed, healthy=240.0, control=True)) == [(5, (4, 6))]
    assert slow(busy_ring(8, slowed, healthy=240.0, control=True), dataclasses.replace(DP, link_bulk_share=0.0)) == []
    assert slow(busy_ring(8, {}, healthy=240.0, control=True)) == []
    (link,) = slow_links(busy_ring(8, slowed, healthy=240.0, control=True), DP)
    assert link.judged == 8 and link.others_mbps == pytest.approx(240.0, rel=1e-3)


def test_one_slow_connection_names_neither_end():
    # one direction's path is slow (a congested port between two workers): either end could own it
    assert slow(busy_ring(4, {(2, 1): 100.0})) == []


def test_healthy_spread_and_a_pair_name_nobody():
    # the spread of healthy connections measured on this machine's namespaced rings: the slowest worker's fastest
    # connection at 0.71 of the others' median
    assert slow(busy_ring(3, {(0, 2): 700.0, (1, 0): 750.0}, healthy=1050.0)) == []
    assert slow(busy_ring(8, {(3, 2): 200.0, (6, 5): 290.0}, healthy=420.0)) == []
    # a pair's connections have nothing to compare with
    assert slow(busy_ring(2, {(0, 1): 100.0, (1, 0): 100.0})) == []


def test_the_time_the_receiver_or_the_senders_buffer_held_it_back_is_not_the_links():
    t = busy_ring(4, {(2, 1): 100.0, (3, 2): 100.0})
    assert slow(t) == [(2, (1, 3))]
    # the same busy time, nine tenths of it waiting on the receiver's window: the network delivered at 1,000 MB/s
    rows = t.to_pylist()
    for r in rows:
        if r["busy_us"] and r["worker"] in (2, 3) and r["segs_out"]:
            r["rwnd_limited_us"] = int(r["busy_us"] * 0.9)
    assert slow(pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)) == []


def test_busy_time_too_short_or_not_recorded_is_not_judged():
    # 4 MB at 10,000 MB/s is 0.4 ms of busy time, under a kernel tick: those connections are not judged, and worker
    # 2's two slow ones have nothing to compare with
    assert slow(busy_ring(4, {(2, 1): 100.0, (3, 2): 100.0}, healthy=10_000.0, sent=4_000_000)) == []
    # an older agent's table has no busy time
    assert slow(ring(4, {(2, 1), (3, 2)})) == []
    assert slow_links(None, DP) == [] and slow_links(CONNECTION_SCHEMA.empty_table(), DP) == []
    # the policy's bar decides
    t = busy_ring(4, {(2, 1): 500.0, (3, 2): 500.0})
    assert slow(t) == [] and slow(t, dataclasses.replace(DP, link_slow_ratio=0.7)) == [(2, (1, 3))]


def test_a_connection_table_from_before_busy_time_is_still_read():
    # an older processor's step slice: no busy-time columns; the table is read with them empty, not dead-lettered
    from lockstep.schemas.events import read_connections_ipc
    from lockstep.schemas.functions import pack

    old = ring(4, {(2, 1), (3, 2)}).drop_columns(["busy_us", "rwnd_limited_us", "sndbuf_limited_us"])
    got = read_connections_ipc(pack(old), "slice")
    assert got.schema.equals(CONNECTION_SCHEMA) and got.column("busy_us").null_count == got.num_rows
    assert named(got) == [(2, (1, 3))] and slow(got) == []


def test_connections_within_one_host_are_no_link():
    # every rank on one address (loopback, or one host's address): the slowest and the lossiest connections are the
    # host's CPU, not a link; between two addresses the same numbers name the worker
    def on_one_host(t: pa.Table) -> pa.Table:
        rows = t.to_pylist()
        for r in rows:
            r["local"] = "127.0.0.1:" + r["local"].rpartition(":")[2]
            r["peer"] = "127.0.0.1:" + r["peer"].rpartition(":")[2]
        return pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)

    slowed, lossy = busy_ring(4, {(2, 1): 100.0, (3, 2): 100.0}), ring(4, {(2, 1), (3, 2)})
    assert slow(slowed) == [(2, (1, 3))] and named(lossy) == [(2, (1, 3))]
    assert slow(on_one_host(slowed)) == [] and named(on_one_host(lossy)) == []
    v6 = pa.table({"local": ["::1:4000", "fe80::1:4000"], "peer": ["::1:5000", "fe80::2:5000"]})
    assert between_hosts(v6).tolist() == [False, True]


def test_healthy_rings_recorded_in_network_namespaces_name_nobody():
    # real connection tables of healthy gloo jobs of 3, 4 and 8 ranks, each rank in a namespace of its own with a
    # link to a bridge, nothing shaped (tests/integration/real_faults.py --healthy-links --save): the spread that a
    # real job's links show on this machine, which the bars must leave alone
    from pathlib import Path

    from lockstep.app.offline import read_connections

    tables = sorted((Path(__file__).parents[2] / "data" / "real" / "links").glob("healthy-w*.connections.parquet"))
    assert len(tables) >= 6
    for path in tables:
        t = read_connections(path)
        assert between_hosts(t).all() and slow_links(t, DP) == [] and lossy_links(t, DP) == [], path.name
        # the healthy spread stays above the bar: every worker's fastest connection over the others' median
        every = slow_links(t, dataclasses.replace(DP, link_slow_ratio=0.999))
        assert all(x.mbps / x.others_mbps > DP.link_slow_ratio for x in every), path.name
