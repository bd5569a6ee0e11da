"""The per-host relay's local hand-over: frames, merging, real Unix datagram sockets between a relay and its agents,
and two agents on one host with Kafka in memory (MemoryKafka).  Real processes and the real broker:
tests/integration/test_relay.py."""

import socket
import time

import pytest

from lockstep.config import ConfigError
from lockstep.kafka import MemoryKafka, Topics, heartbeat_key
from lockstep.producers.agent.agent import Agent
from lockstep.producers.agent.meta import Identity
from lockstep.producers.agent.relay import (
    ALIVE,
    CONTROL,
    HEARTBEATS,
    RELAY_SOCKET,
    FrameError,
    Relay,
    RelayLink,
    frame,
    heartbeat_frames,
    merge_batches,
    parse_frame,
    run_dir,
    split_batch,
)
from lockstep.producers.agent.settings import AgentConfig, load
from lockstep.schemas.records import (
    AgentCounters,
    HeartbeatBatch,
    ProfileTrigger,
    RawRequest,
    StepHeartbeat,
    WorkerMeta,
    batch_heartbeats,
    decode,
)


def beats(worker: int, steps: range, *, final_last: bool = False, host: str = "h0", **extra) -> list[StepHeartbeat]:
    return [
        StepHeartbeat(
            job="j",
            worker=worker,
            step=s,
            step_time_s=0.1 + worker / 100,
            host=host,
            sent_at=1000.0 + s,
            final=final_last and s == steps[-1],
            **(extra if s == steps[0] else {}),
        )
        for s in steps
    ]


def batch_of(hbs: list[StepHeartbeat], shard_workers: int = 256) -> HeartbeatBatch:
    ((_, b),) = batch_heartbeats(hbs, shard_workers)
    return b


def rows(batches) -> list[tuple]:
    """Every heartbeat in ``batches`` as comparable tuples (worker, step, time, sent, final, echo, counters)."""
    return sorted(
        (
            hb.worker,
            hb.step,
            hb.step_time_s,
            hb.sent_at,
            hb.final,
            hb.trigger_window,
            hb.agent.failed_windows if isinstance(hb.agent, AgentCounters) else None,
        )
        for b in batches
        for hb in b.heartbeats()
    )


# --------------------------------------------------------------------------- pure parts


def test_frames_round_trip_and_anything_else_is_refused():
    assert parse_frame(frame(HEARTBEATS, b"xyz")) == (HEARTBEATS, b"xyz")
    assert parse_frame(frame(ALIVE)) == (ALIVE, b"")
    for bad in (b"", b"LS", b"XYZ\x01H", b"LSR\x02H{}", b"LSR\x01Z{}"):
        with pytest.raises(FrameError):
            parse_frame(bad)


def test_merge_keeps_every_row_and_renumbers_final_rows_and_sparse_fields():
    a = beats(1, range(10, 13), final_last=True, trigger_window="w1", trigger_latency_s=0.5)
    b = beats(2, range(10, 14), agent=AgentCounters(failed_windows=3))
    c = beats(0, range(11, 13), final_last=True)
    merged = merge_batches([batch_of(a), batch_of(b), batch_of(c)])
    assert len(merged) == 1
    m = merged[0]
    m.validate()
    assert m.host == "h0" and m.shard == 0 and len(m.worker) == 9
    assert rows(merged) == rows([batch_of(x) for x in (a, b, c)])
    assert [m.worker[i] for i in m.final] == [1, 0] and [m.step[i] for i in m.final] == [12, 12]


def test_merge_keeps_shards_and_jobs_apart_and_hosts_honest():
    b0 = batch_of(beats(3, range(5)), shard_workers=4)  # shard 0
    b1 = batch_of(beats(5, range(5)), shard_workers=4)  # shard 1
    b2 = batch_of(beats(6, range(5), host="h1"), shard_workers=4)  # shard 1, another host
    merged = {m.shard: m for m in merge_batches([b0, b1, b2])}
    assert set(merged) == {0, 1}
    assert merged[0] is b0 and merged[1].host == "" and sorted(set(merged[1].worker)) == [5, 6]
    for m in merged.values():
        m.validate()


def test_a_merge_over_the_row_bound_splits_without_losing_a_row():
    parts = [
        batch_of(beats(w, range(40), final_last=True, trigger_window="w", trigger_latency_s=0.1)) for w in range(5)
    ]
    merged = merge_batches(parts, max_rows=64)
    assert all(len(m.worker) <= 64 for m in merged) and len(merged) == 4
    assert rows(merged) == rows(parts)
    assert sum(len(m.echoes) for m in merged) == 5 and sum(len(m.final) for m in merged) == 5
    for m in merged:
        m.validate()
    assert rows(split_batch(parts[0], 7)) == rows([parts[0]])


def test_heartbeat_frames_fit_a_datagram():
    big = batch_of(beats(1, range(3000)))
    frames = heartbeat_frames([big], max_bytes=20_000)
    assert len(frames) > 1 and all(len(f) <= 20_000 for f in frames)
    back = [decode(parse_frame(f)[1], HeartbeatBatch) for f in frames]
    assert rows(back) == rows([big])


def test_run_dir_is_per_job_and_run():
    a = run_dir("j", "h", {"TORCHELASTIC_RUN_ID": "r1"})
    assert a == run_dir("j", "h", {"TORCHELASTIC_RUN_ID": "r1"})
    assert a != run_dir("j", "h", {"TORCHELASTIC_RUN_ID": "r2"}) and a != run_dir(
        "k", "h", {"TORCHELASTIC_RUN_ID": "r1"}
    )
    assert a != run_dir("j", "h2", {"TORCHELASTIC_RUN_ID": "r1"})  # ranks configured as other hosts: apart
    assert len(str(a / "agent-4194304.sock")) < 100


# --------------------------------------------------------------------------- real sockets


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def relay_dir(tmp_path_factory):
    # a short path of its own: a Unix socket path has at most 107 bytes
    return run_dir(f"t-{time.monotonic_ns()}")


def test_agents_hand_heartbeats_over_and_receive_control_records(relay_dir):
    relay = Relay(relay_dir).start()
    links = [RelayLink(relay_dir, join_s=2.0) for _ in range(2)]
    try:
        for link in links:
            assert link.relayed
        sent = [batch_of(beats(w + 1, range(4))) for w in range(2)]
        for link, b in zip(links, sent):
            assert link.hand_over([b]) == []
        got: list[HeartbeatBatch] = []
        wait_for(lambda: (got.extend(relay.take()), len(got) == 2)[1])
        assert rows(got) == rows(sent) and relay.counters.rows_in == 8
        assert len(relay.peers) == 2

        trig = ProfileTrigger(job="j", window="w9", start_step=50, steps=3, expected_workers=3)
        req = RawRequest(job="j", request="r1", workers=[2])
        relay.fan_out([trig, req])
        for link in links:
            seen: list = []
            wait_for(lambda seen=seen, link=link: (seen.extend(link.poll(0.05)), len(seen) == 2)[1])
            assert seen == [trig, req]
    finally:
        relay.close()
        for link in links:
            link.close()


def test_agents_fall_back_when_the_relay_ends_and_come_back_when_one_answers(relay_dir):
    relay = Relay(relay_dir).start()
    link = RelayLink(relay_dir, join_s=1.0, retry_s=0.2)
    try:
        b = batch_of(beats(1, range(3)))
        assert link.hand_over([b]) == []
        wait_for(lambda: relay.counters.rows_in == 3)
        relay.close()
        assert not (relay_dir / RELAY_SOCKET).exists()
        assert link.hand_over([b]) == [b]  # at once, never a wait: the agent sends it itself
        assert not link.relayed and link.fallbacks == 1
        assert link.hand_over([b]) == [b]
        relay = Relay(relay_dir).start()  # a relay again (e.g. a restarted one)
        wait_for(lambda: (link.poll(0.02), link.relayed)[1])
        assert link.hand_over([b]) == []
        wait_for(lambda: relay.counters.rows_in == 3)
    finally:
        relay.close()
        link.close()


def test_an_agent_waits_a_little_for_a_relay_that_starts_after_it(relay_dir):
    early = RelayLink(relay_dir, join_s=5.0)  # no relay yet: it keeps its heartbeats for a while
    lonely = None
    relay = None
    try:
        b1, b2 = batch_of(beats(1, range(3))), batch_of(beats(1, range(3, 6)))
        assert early.joining and not early.relayed and early.hand_over([b1]) == []
        relay = Relay(relay_dir).start()
        wait_for(lambda: (early.poll(0.02), early.relayed)[1])  # its hello is answered
        assert early.hand_over([b2]) == []
        wait_for(lambda: relay.counters.rows_in == 6)
        assert rows(relay.take()) == rows([b1, b2])

        lonely = RelayLink(run_dir(f"none-{time.monotonic_ns()}"), join_s=0.2)  # no relay ever
        assert lonely.hand_over([b1]) == []
        time.sleep(0.25)
        assert not lonely.joining and lonely.hand_over([b2]) == [b1, b2]  # the agent sends them itself
    finally:
        if relay is not None:
            relay.close()
        early.close()
        if lonely is not None:
            lonely.close()


def test_a_stalled_relay_never_blocks_the_agent_and_is_left(relay_dir):
    relay_dir.mkdir(parents=True, mode=0o700)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # bound, never read, never answers
    stalled.bind(str(relay_dir / RELAY_SOCKET))
    link = RelayLink(relay_dir, join_s=0.3)
    try:
        b = batch_of(beats(1, range(50)))
        handed = 0
        while link.hand_over([b]) == []:  # the stalled relay's queue fills, then a hand-over fails at once
            handed += 1
            assert handed < 100_000
        assert not link.relayed and handed > 0
        link2 = RelayLink(relay_dir, join_s=0.3)  # its queue is full: the hello fails, waited for join_s, then left
        time.sleep(0.4)
        link2.poll(0.0)
        assert not link2.relayed
        link2.close()
    finally:
        stalled.close()
        link.close()


def test_the_relay_ignores_what_is_not_a_frame_and_bounds_what_it_holds(relay_dir):
    relay = Relay(relay_dir, pending_rows_max=100).start()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for junk in (b"hello", frame(HEARTBEATS, b"{not json"), frame(CONTROL, b"{}")):
            sender.sendto(junk, str(relay.path))
        link = RelayLink(relay_dir, join_s=2.0)
        for s in range(5):
            assert link.hand_over([batch_of(beats(1, range(s * 40, s * 40 + 40)))]) == []
        wait_for(lambda: relay.counters.batches_in == 5)
        assert relay.counters.bad_frames == 2  # the control frame is no heartbeat, and is not counted as bad
        kept = relay.take()
        assert sum(len(b.worker) for b in kept) <= 100 and relay.counters.dropped_rows == 120
        assert kept[-1].step[-1] == 199  # the newest are kept
        link.close()
    finally:
        sender.close()
        relay.close()


# --------------------------------------------------------------------------- two agents with Kafka in memory


def agent(kafka: MemoryKafka, relay_dir, rank: int, tmp_path, **settings) -> Agent:
    cfg = AgentConfig(
        job="j",
        **settings,
        bootstrap_servers="memory:0",
        topic_prefix="t",
        flush_interval_s=0.05,
        relay_dir=relay_dir,
        spool_dir=tmp_path / f"spool{rank}",
    ).validate()
    meta = WorkerMeta(rank=rank, host="h0", device="h0/cpu", local_rank=rank)
    return Agent(cfg, Identity(meta=meta, world_size=2), clients=kafka.clients())


def sent_heartbeats(kafka: MemoryKafka, topics: Topics) -> list[tuple[bytes, HeartbeatBatch]]:
    return [(m.key(), decode(m.value(), HeartbeatBatch)) for m in kafka.messages(topics.heartbeats)]


def test_two_agents_on_a_host_send_through_one_producer_and_go_their_own_way_when_it_ends(tmp_path, relay_dir):
    topics = Topics.named("t")
    kafka = MemoryKafka({topics.heartbeats: 2, topics.control: 1, topics.windowfeatures: 1, topics.raw: 1})
    a0 = agent(kafka, relay_dir, 0, tmp_path)
    a1 = agent(kafka, relay_dir, 1, tmp_path)
    try:
        assert a0.relay_role == "relay" and a1.relay_role == "relayed"
        for _ in range(20):
            a0.step()
            a1.step()
            time.sleep(0.01)
        wait_for(lambda: sum(b.worker.count(1) for _, b in sent_heartbeats(kafka, topics)) >= 20)
        assert not a1.report().kafka_producer  # rank 1 never needed a Kafka client
        sent = sent_heartbeats(kafka, topics)
        assert all(k == heartbeat_key("j", 0) for k, _ in sent)
        assert any(set(b.worker) == {0, 1} for _, b in sent)  # the host's heartbeats in one record
        assert a0.report().relayed_rows == 20 and a1.report().handed_over > 0

        # a trigger reaches rank 1 through the relay (rank 1 follows no control topic itself)
        assert not a1._control.connected
        wait_for(lambda: a0._control.connected)
        from lockstep.kafka import Publisher

        pub = Publisher({}, clients=kafka.clients())
        pub.send(
            topics.control, "j", ProfileTrigger(job="j", window="w-past", start_step=1, steps=2, expected_workers=2)
        )
        pub.flush(5)

        def refused() -> bool:
            a0.step()
            a1.step()
            time.sleep(0.01)
            return bool(a1.report().refused) and bool(a0.report().refused)

        wait_for(refused)  # both saw it (and refused it: its steps are past)
        assert a1.report().refused == [("w-past", "past")]

        a0.close()  # the relay ends: rank 1 goes its own way at its next flush, and nothing blocks
        for _ in range(20):
            a1.step()
            time.sleep(0.01)
        wait_for(lambda: a1.relay_role == "direct")
        n = sum(b.worker.count(1) for _, b in sent_heartbeats(kafka, topics))
        for _ in range(5):
            a1.step()
        a1.close()
        last = [b for _, b in sent_heartbeats(kafka, topics)]
        steps1 = sorted(s for b in last for w, s in zip(b.worker, b.step) if w == 1)
        assert len(steps1) >= n + 5 and set(steps1) == set(range(a1.current_step))  # every heartbeat of rank 1
        assert a1.report().relay_fallbacks == 1
    finally:
        a0.close()
        a1.close()


def test_relay_off_or_one_process_is_an_agent_on_its_own(tmp_path, relay_dir):
    assert load({"job": "j", "relay": "OFF"}, env={"LOCKSTEP_BOOTSTRAP_SERVERS": "k:9092"}).relay == "off"
    with pytest.raises(ConfigError, match="relay"):
        load({"job": "j", "relay": "sometimes"}, env={"LOCKSTEP_BOOTSTRAP_SERVERS": "k:9092"})
    topics = Topics.named("t")
    kafka = MemoryKafka({topics.heartbeats: 1, topics.control: 1})
    off = [agent(kafka, relay_dir, r, tmp_path, relay="off") for r in (0, 1)]
    try:
        assert [a.relay_role for a in off] == ["direct", "direct"] and all(a.report().kafka_producer for a in off)
        assert not (relay_dir / RELAY_SOCKET).exists()
    finally:
        for a in off:
            a.close()
    cfg = AgentConfig(job="j", bootstrap_servers="memory:0", topic_prefix="t", relay_dir=relay_dir).validate()
    alone = Agent(cfg, Identity(meta=WorkerMeta(rank=0, host="h0", local_rank=0), world_size=1), kafka.clients())
    try:
        assert alone.relay_role == "direct" and not (relay_dir / RELAY_SOCKET).exists()  # one process: no relay
    finally:
        alone.close()
