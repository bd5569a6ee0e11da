"""The per-host relay with real processes: four agent processes of one host (the relay is local rank 0's agent),
the real broker and the real stream processor.

While the relay runs, ranks 1-3 have no Kafka client at all (no librdkafka thread ever), their heartbeats reach
Kafka in the relay's batches and a trigger reaches them through it; then the relay's process is killed (SIGKILL):
the others go their own way at once (their steps go on), and every heartbeat they sent after it is in Kafka and
counted by the processor, as are all before it but the last flush the relay held when it died.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import Publisher, ensure_topics, producer_config, read_all
from lockstep.metrics import value
from lockstep.schemas.records import HeartbeatBatch, ProfileTrigger, decode
from lockstep.streams.app import changelog_topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
WORLD = 4
JOB = "relay-job"


def progress(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / f"progress-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_producer_per_host_and_the_relay_killed_mid_run(settings, tmp_path):
    topics = ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    pipeline = Pipeline(settings, tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        pipeline.start("processor")
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "JOB": JOB,
                "OUT_DIR": str(tmp_path),
                "STOP_FILE": str(tmp_path / "stop"),
                "LOCKSTEP_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                "LOCKSTEP_TOPIC_PREFIX": settings.topic_prefix,
                "LOCKSTEP_AGENT_SPOOL_DIR": str(tmp_path / f"spool{rank}"),
            }
            log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "relay_agents.py")], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
        wait_for(lambda: all(progress(tmp_path, r).get("step", 0) >= 100 for r in range(WORLD)), "100 steps")
        wait_for(lambda: progress(tmp_path, 0).get("control"), "the relay following the control topic")
        pub = Publisher(producer_config(settings))
        pub.send(
            topics.control, JOB, ProfileTrigger(job=JOB, window="w-past", start_step=1, steps=2, expected_workers=4)
        )
        pub.flush(10)
        wait_for(
            lambda: all(progress(tmp_path, r).get("refused") for r in range(WORLD)), "every rank to see the trigger"
        )
        before = {r: progress(tmp_path, r) for r in range(WORLD)}
        assert before[0]["role"] == "relay" and before[0]["relayed_rows"] > 0
        for r in range(1, WORLD):
            p = before[r]
            assert p["role"] == "relayed" and p["handed_over"] > 0, p
            # no Kafka client in this process, ever: not a producer, not the control topic's consumer
            assert p["rdk_threads_most"] == 0 and not p["producer"] and not p["control"], p
            assert p["refused"] == [["w-past", "past"]]  # the trigger came through the relay

        procs[0].send_signal(signal.SIGKILL)  # the relay dies mid-run
        procs[0].wait(10)
        at_kill = {r: progress(tmp_path, r)["step"] for r in range(1, WORLD)}
        wait_for(
            lambda: all(
                progress(tmp_path, r).get("role") == "direct" and progress(tmp_path, r)["step"] >= at_kill[r] + 100
                for r in range(1, WORLD)
            ),
            "the survivors to go their own way and step on",
        )
        (tmp_path / "stop").touch()
        for r in range(1, WORLD):
            assert procs[r].wait(60) == 0
            assert progress(tmp_path, r)["fallbacks"] == 1
        last = {r: int((tmp_path / f"done-{r}").read_text()) for r in range(1, WORLD)}

        values = [v for _, v in read_all(settings, [topics.heartbeats])[topics.heartbeats]]
        batches = [decode(v, HeartbeatBatch) for v in values]
        seen: dict[int, set[int]] = {r: set() for r in range(WORLD)}
        finals: dict[int, int] = {}
        for b in batches:
            for w, s in zip(b.worker, b.step):
                seen[w].add(s)
            for i in b.final:
                finals[b.worker[i]] = b.step[i]
        assert any(len(set(b.worker)) == WORLD for b in batches)  # the host's heartbeats in one record
        for r in range(1, WORLD):
            missing = set(range(last[r])) - seen[r]
            # lost: only what the killed relay held (about one flush), around the moment it died
            assert all(at_kill[r] - 60 <= s <= at_kill[r] + 60 for s in missing), (r, sorted(missing))
            assert len(missing) <= 30, (r, sorted(missing))
            assert finals[r] == last[r] - 1
        assert seen[0] >= set(range(before[0]["step"] - 30))  # the relay's own, up to its last flush or so

        rows = sum(len(s) for s in seen.values())  # distinct (worker, step): a final heartbeat repeats the last step
        try:
            wait_for(
                lambda: value(pipeline.metrics("processor"), "lockstep_heartbeats_total") >= rows,
                "the processor to count every heartbeat",
            )
        except AssertionError:
            m = pipeline.metrics("processor")
            raise AssertionError(
                f"{rows} heartbeats in Kafka, the processor counted {value(m, 'lockstep_heartbeats_total')}; "
                f"{ {k: v for k, v in m.items() if 'dead' in k[0] or 'late' in k[0]} }"
            ) from None
    finally:
        (tmp_path / "stop").touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        pipeline.stop()
