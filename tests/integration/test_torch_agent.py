"""A real PyTorch job (CPU, gloo) with the agent, end to end through Kafka into DuckDB.

The ranks, the stream processor and the sink are separate processes; the test
only talks to them through Kafka (a trigger on the control topic, as the
detector would send) and reads the finding from the sink.  Of 4 ranks, rank 2 is
slowed in ``preprocess``; of 2 ranks, rank 1 spends the extra time in a region
no other rank runs (``slow_only``: before issue 20 every step report of such a
window was refused and the window lost); the finding must name it.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import free_port
from lockstep.kafka import Publisher, consumer_config, ensure_topics, producer_config, read_all, window_features_key
from lockstep.schemas import functions as ft
from lockstep.schemas.records import HeartbeatBatch, ProfileTrigger, Sampling, StepHeartbeat, WindowFeatures, decode
from lockstep.sinks.http import query
from lockstep.sinks.store import StoreError
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # real-time rates: run with the machine to itself

JOB = "ddp-job"
HERE = Path(__file__).resolve().parent


def start_ranks(settings, tmp_path: Path, world: int, slow_rank: int, region: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "JOB": JOB,
            "SLOW_RANK": str(slow_rank),
            "SLOW_MS": "40",
            "SLOW_REGION": region,
            "STOP_FILE": str(tmp_path / "stop"),
            "OUT_DIR": str(tmp_path),
            "MAX_S": "150",
            "OMP_NUM_THREADS": "1",
            "LOCKSTEP_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "LOCKSTEP_TOPIC_PREFIX": settings.topic_prefix,
            "LOCKSTEP_AGENT_SPOOL_DIR": str(tmp_path / f"spool{rank}"),
            "LOCKSTEP_AGENT_REDACT": "none",
            # each rank stands for a worker on a host of its own (they share this machine's name otherwise,
            # and the diagnosis reports deviating workers that share a host together)
            "LOCKSTEP_AGENT_HOST": f"node{rank}",
        }
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "agent_torch_job.py")], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
    return procs


def steps_seen(consumer: Consumer, seen: dict[int, int]) -> dict[int, int]:
    for msg in consumer.consume(500, timeout=0.2):
        if not msg.error():
            rec = decode(msg.value(), (StepHeartbeat, HeartbeatBatch))  # agents send batches since issue 13
            for hb in rec.heartbeats() if isinstance(rec, HeartbeatBatch) else [rec]:
                if hb.job == JOB:
                    seen[hb.worker] = max(seen.get(hb.worker, -1), hb.step)
    return seen


@pytest.mark.parametrize(("world", "slow_rank", "region"), [(4, 2, "preprocess"), (2, 1, "slow_only")])
def test_a_slow_rank_of_a_real_ddp_job_is_found_end_to_end(settings, tmp_path, world, slow_rank, region):
    topics = ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    policy = tmp_path / "policy.yaml"  # the detector stays quiet: this test sends the trigger itself
    policy.write_text("id: agent-test\ndetector: {slowdown_threshold: 100.0, hang_factor: 1000.0}\n")
    # a rank of 4 on 2 shared cores can stall for seconds while the whole suite runs: a lateness bound that a stall
    # does not pass (the default 2 s is exercised in test_live_jobs and test_heartbeat_arrival)
    settings = dataclasses.replace(settings, heartbeat_lateness_s=15.0)
    flags = [*settings_flags(settings, "processor"), "--policy", str(policy)]
    port, sink_port = free_port(), free_port()
    proc = Child(
        "processor", ["processor", *flags, "--http-port", str(port)], tmp_path, f"http://127.0.0.1:{port}/healthz"
    )
    sink = Child(
        "sink",
        ["sink", *settings_flags(settings, "sink"), "--http-port", str(sink_port)],
        tmp_path,
        f"http://127.0.0.1:{sink_port}/healthz",
    )
    ranks = start_ranks(settings, tmp_path, world, slow_rank, region)
    hb = Consumer(consumer_config(settings, None))
    hb.assign([TopicPartition(topics.heartbeats, p, 0) for p in range(settings.partitions)])
    try:
        proc.wait_healthy(60)
        sink.wait_healthy(60)
        seen: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while len(steps_seen(hb, seen)) < world or min(seen.values()) < 3:
            assert time.monotonic() < deadline, f"heartbeats from ranks {sorted(seen)} only; see {tmp_path}/rank*.log"
            assert all(r.poll() is None for r in ranks), f"a rank exited; see {tmp_path}/rank*.log"
        start = (
            max(seen.values()) + 40
        )  # far enough ahead for every rank to hear of it (~80 ms steps, up to 1 s on the embedded broker)
        trigger = ProfileTrigger(
            job=JOB,
            window="w-agent",
            start_step=start,
            steps=5,
            expected_workers=world,
            sampling=Sampling(hardware_hz=50),
            reason="test",
        )
        pub = Publisher(producer_config(settings))
        pub.send(topics.control, JOB, trigger)
        pub.flush()

        def window_stored():
            try:
                return query(
                    settings.db, "SELECT coverage, closed, expected_workers FROM windows WHERE window_id = 'w-agent'"
                )[1]
            except StoreError:
                return None

        deadline = time.monotonic() + 60
        while not window_stored():  # the sink stores a window's report after its findings
            assert time.monotonic() < deadline, f"window w-agent was not diagnosed; see {tmp_path}"
            assert all(r.poll() is None for r in ranks), f"a rank exited; see {tmp_path}/rank*.log"
            proc.healthy()
            time.sleep(0.5)
        windows = window_stored()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        # each job's agents, as an operator asks for them (the store's step times, the processor's counters)
        # (the store's step times trail the window's report by a flush: asked again until they reach its start)
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run(
                [sys.executable, "-m", "lockstep", "agent", "status", "--db", str(settings.db), "--json"]
                + ["--processor", f"http://127.0.0.1:{port}", "--job", JOB],
                capture_output=True,
                text=True,
                timeout=60,
            )
            seen = json.loads(status.stdout or "[{}]") if status.returncode == 0 else [{}]
            if ((seen or [{}])[0].get("last_step") or -1) >= start or time.monotonic() > deadline:
                break
            time.sleep(1)
        _, rows = query(
            settings.db,
            "SELECT workers, function, cause, hosts FROM findings WHERE window_id = 'w-agent' ORDER BY step_time_share DESC",
        )
    finally:
        (tmp_path / "stop").touch()
        codes = []
        for r in ranks:
            try:
                codes.append(r.wait(timeout=30))
            except subprocess.TimeoutExpired:
                r.kill()
                codes.append(r.wait())
        hb.close()
        proc.stop()
        sink.stop()
    assert codes == [0] * world, f"see {tmp_path}/rank*.log"
    assert status.returncode == 0, status.stderr
    (agents,) = json.loads(status.stdout)
    assert agents["job"] == JOB and agents["workers_most"] == world and agents["last_step"] >= start, agents
    assert (agents["dropped_records"], agents["refused_triggers"], agents["failed_windows"]) == (0, 0, 0), agents
    # each rank's agent said what it did, in the job's own output (the script sets up no logging)
    for r in range(world):
        said = (tmp_path / f"rank{r}.log").read_text(errors="replace")
        assert "lockstep.agent: lockstep agent attached: job ddp-job" in said, said[-2000:]
        assert f"lockstep.agent: accepted profiling window w-agent: steps {start}..{start + 4}" in said, said[-2000:]
        assert "lockstep.agent: published window w-agent: its " in said, said[-2000:]

    # the costliest finding that names workers names the slowed rank, its host, and the slowed function; no
    # finding blames the healthy ranks that waited for it (job-wide ones name no worker; on 2 shared cores
    # a healthy rank may still stand out in some small function)
    named = [(workers, function, hosts) for workers, function, _cause, hosts in rows if workers]
    assert named and named[0][0] == [slow_rank] and named[0][2] == [f"node{slow_rank}"] and region in named[0][1], rows
    assert not any(region in function or "all_reduce" in function for workers, function, _ in named[1:]), rows
    assert windows == [[1.0, "complete", world]]
    # each rank's agent batched its own heartbeats every flush, the batches of the ranks arriving in any order: the
    # heartbeat stage counted none of them late (issue 20: about a quarter before)
    beats = re.search(r"^lockstep_heartbeats_total (\S+)$", metrics, re.M)
    late = re.search(r'^lockstep_late_records_total\{stage="heartbeats"\} (\S+)$', metrics, re.M)
    beats, late = float(beats.group(1)) if beats else 0.0, float(late.group(1)) if late else 0.0
    print(f"heartbeats {beats:.0f}, late {late:.0f}")
    assert beats > 0 and late <= 0.002 * beats

    # every rank delivered one feature record with every step of the window, keyed job:window:shard
    records = [
        (k, decode(v, WindowFeatures)) for k, v in read_all(settings, [topics.windowfeatures])[topics.windowfeatures]
    ]
    assert sorted((b.worker.rank, s) for _, b in records for s in b.steps) == [
        (r, s) for r in range(world) for s in range(start, start + 5)
    ]
    assert all(k == window_features_key(JOB, "w-agent", 0) and b.hardware == "host" for k, b in records)
    assert all(ft.read_compact(b.functions).num_rows > 0 for _, b in records)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["windows"][0]["window"] == "w-agent" and r["windows"][0]["error"] == "" for r in reports)
    assert all(r["counters"]["dropped_records"] == 0 for r in reports)
    # each rank's agent read its process's TCP connections over the window from the kernel: the gradient
    # all-reduce's connections, each seen from both ends, so that every one that carried data has a worker at its
    # other end (what the window's link rule needs); on the loopback nothing is lossy, so no nic finding
    from lockstep.schemas.events import connection_table
    from lockstep.streams.diagnosis.links import peer_workers

    conns = connection_table([b.worker.rank for _, b in records], [b.connections for _, b in records])
    assert set(conns.column("worker").to_pylist()) == set(range(world)), conns.to_pylist()
    busy = [p for p, segs in zip(peer_workers(conns), conns.column("segs_out").to_pylist(), strict=True) if segs >= 100]
    assert busy and all(0 <= p < world for p in busy), conns.to_pylist()
    # ... and how long each had data in flight (the slow-link rule's measure), where the kernel counts it: the
    # kernel's busy time holds the time the receiver's window and the sender's buffer held it back
    sending = [r for r in conns.to_pylist() if r["segs_out"] >= 100]
    if all(r["busy_us"] is not None for r in sending):
        assert all(r["busy_us"] >= r["rwnd_limited_us"] + r["sndbuf_limited_us"] >= 0 for r in sending), sending
    assert not any(cause == "nic" for _w, _f, cause, _h in rows), rows
