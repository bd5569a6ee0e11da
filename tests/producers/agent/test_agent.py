"""The agent in a real PyTorch process against the real broker: triggers, windows, raw requests, the launcher."""

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lockstep.commands import cli
from lockstep.kafka import Publisher, ensure_topics, producer_config, read_all
from lockstep.producers.agent import attach
from lockstep.producers.agent.profiler import profiler_enabled
from lockstep.producers.agent.redact import Redaction
from lockstep.producers.agent.retention import decompress
from lockstep.schemas import functions as ft
from lockstep.schemas.records import (
    AgentCounters,
    HeartbeatBatch,
    ProfileTrigger,
    RawRequest,
    RawTrace,
    Sampling,
    StepHeartbeat,
    WindowFeatures,
    decode,
)
from lockstep.sinks.http import wait_for

pytestmark = pytest.mark.integration


def heartbeats_of(values) -> list[StepHeartbeat]:
    """The heartbeats in the topic's records, in order: agents send a ``HeartbeatBatch`` per flush since issue 13."""
    out: list[StepHeartbeat] = []
    for v in values:
        rec = decode(v, (StepHeartbeat, HeartbeatBatch))
        out += rec.heartbeats() if isinstance(rec, HeartbeatBatch) else [rec]
    return out


def train_until(agent, cond, timeout_s=60.0, step_s=0.02):
    import torch  # here, not at the top: collecting the quick tier needs no torch

    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        model(torch.randn(32, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(step_s)
        agent.step()


def test_a_trigger_profiles_exactly_its_steps_then_nothing_stays_attached(settings, tmp_path, capsys):
    pytest.importorskip("torch", reason="the agent is tested in a real PyTorch training loop")
    topics = ensure_topics(settings)
    redaction = Redaction(names="hash", salt="t")
    agent = attach(
        job="unit",
        bootstrap_servers=settings.bootstrap_servers,
        topic_prefix=settings.topic_prefix,
        rank=5,
        world_size=8,
        labels={"pp": "1"},
        spool_dir=tmp_path / "spool",
        redact=redaction.spec(with_salt=True),
    )
    pub = Publisher(producer_config(settings))
    try:
        train_until(agent, lambda: agent._control.connected and agent.current_step >= 5)
        start = agent.current_step + 60  # the embedded broker delivers a control record within about a second
        pub.send(
            topics.control,
            "unit",
            ProfileTrigger(job="unit", window="w-past", start_step=agent.current_step - 1, steps=2, expected_workers=8),
        )
        pub.send(
            topics.control,
            "other-job",
            ProfileTrigger(job="other-job", window="w-other", start_step=start, steps=3, expected_workers=8),
        )
        pub.send(
            topics.control,
            "unit",
            ProfileTrigger(
                job="unit",
                window="w1",
                start_step=start,
                steps=3,
                expected_workers=8,
                created_at=time.time(),
                sampling=Sampling(hardware_hz=50, with_stack=True),
                policy="p",
                policy_hash="h",
            ),
        )
        pub.flush()
        train_until(agent, lambda: agent.current_step > start + 3)
        assert not profiler_enabled()  # stopped at the boundary after the window
        agent.drain()
        assert [w.window for w in agent.report().windows] == ["w1"]
        # raw requests: only the named workers answer, with a bounded, redacted slice of the steps asked for
        # (the agent answers from its own threads: training need not step meanwhile)
        rc = cli.main(
            [
                "raw",
                "unit",
                "--workers",
                "5",
                "--steps",
                str(start + 1),
                "--max-bytes",
                "50000",
                "--out",
                str(tmp_path / "raw"),
                "--json",
                "--bootstrap-servers",
                settings.bootstrap_servers,
                "--topic-prefix",
                settings.topic_prefix,
            ]
        )
        assert rc == 0
        (printed,) = json.loads(capsys.readouterr().out)
        pub.send(topics.control, "unit", RawRequest(job="unit", request="r2", workers=[1, 2]))
        pub.send(topics.control, "unit", RawRequest(job="unit", request="r3", workers=[5], window="w-unknown"))
        pub.flush()
        train_until(agent, lambda: agent.report().raw_answers >= 2)
        report = agent.report()
    finally:
        agent.close()
    assert report.refused == [("w-past", "past")] and report.counters.refused_triggers == 1
    (window,) = report.windows
    assert (
        window.error == "" and window.summarised == 3 and window.sampler.source == "host" and window.sampler.samples > 0
    )

    recs = read_all(settings, [topics.windowfeatures, topics.heartbeats, topics.raw])
    ((key, b),) = [(k, decode(v, WindowFeatures)) for k, v in recs[topics.windowfeatures]]  # the window in one record
    assert (
        key == b"unit:w1:0"
        and b.steps == [start, start + 1, start + 2]
        and window.record_bytes == len(recs[topics.windowfeatures][0][1])
    )
    assert (b.window, b.window_start, b.window_steps, b.expected_workers, b.policy, b.hardware) == (
        "w1",
        start,
        3,
        8,
        "p@h",
        "host",
    )
    assert (b.worker.rank, b.worker.labels, b.shard) == (5, {"pp": "1"}, 0)
    table = ft.read_compact(b.functions)
    assert set(table.column("step").to_pylist()) == set(b.steps) and all(
        n.startswith("fn:") for n in table.column("function").to_pylist()
    )
    assert all(t > 0 for t in b.step_time_us)  # how long depends on the machine's load: not compared
    heartbeats = heartbeats_of(v for _, v in recs[topics.heartbeats])
    *beats, final = heartbeats
    assert [h.step for h in beats] == list(range(len(beats))) and all(not h.final for h in beats)
    assert final.final is True and final.step == beats[-1].step  # the detector knows the worker ended, not hung
    assert any(isinstance(h.agent, AgentCounters) and h.agent.refused_triggers == 1 for h in heartbeats)
    # every trigger for the job is echoed once, with its receipt latency, for the detector's control-latency estimate
    echoed = [h.trigger_window for h in heartbeats if isinstance(h.trigger_window, str)]
    assert "w1" in echoed and "w-other" not in echoed

    answers = {r.request: r for r in (decode(v, RawTrace) for _, v in recs[topics.raw])}
    assert len(answers) == 2 and "r3" in answers and "r2" not in answers  # r2 named other workers
    assert answers["r3"].error and not answers["r3"].trace
    r1 = answers[printed["request"]]  # the answer to `lockstep raw`
    assert (r1.window, r1.worker, r1.steps, r1.error) == ("w1", 5, [start + 1], "") and len(r1.trace) <= 50_000
    assert r1.redaction == "paths=strip,stacks=drop,names=hash" and printed["bytes"] == len(r1.trace)
    doc = json.loads(Path(printed["file"]).read_text())  # what `lockstep raw` wrote: a Chrome trace Perfetto opens
    assert doc == json.loads(decompress(r1.trace))
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert names and all(n.startswith(("fn:", "ProfilerStep#")) for n in names)


def test_the_launcher_attaches_the_agent_to_an_unedited_script(settings, tmp_path):
    pytest.importorskip("torch", reason="the script the launcher starts trains with PyTorch")
    topics = ensure_topics(settings)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        model = torch.nn.Linear(16, 2)
        opt = torch.optim.Adam(model.parameters())
        other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # a second optimizer does not count steps
        for _ in range(12):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            other.step()
    """)
    )
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "agent",
        "run",
        "--job",
        "launched",
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
        "--labels",
        "role=loss",
        "--spool-dir",
        str(tmp_path / "spool"),
        "--",
        sys.executable,
        str(script),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={"RANK": "3", "WORLD_SIZE": "4", "PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, done.stderr
    beats = heartbeats_of(v for _, v in read_all(settings, [topics.heartbeats])[topics.heartbeats])
    # the first optimizer step creates the agent; every later one of the same optimizer ends a step
    assert [(h.job, h.worker, h.step, bool(h.final)) for h in beats] == [
        ("launched", 3, s, False) for s in range(1, 12)
    ] + [("launched", 3, 11, True)]


#: the agent's lines (logger lockstep.agent), the only ones it says by default
AGENT_LINES = re.compile(
    r"lockstep agent attached: |accepted profiling window |refused profiling window |published window "
    r"|Kafka unreachable |Kafka answers again|spool full |spool: a |agent queue full |raw request "
    r"|\d+ record\(s\) left in the spool"
)


def agent_lines(text: str) -> list[str]:
    return [line.split(" lockstep.agent: ", 1)[1] for line in text.splitlines() if " lockstep.agent: " in line]


TRAIN = """
import pathlib, sys, time, torch
from lockstep.producers.agent import attach

stop = pathlib.Path(sys.argv[1])
agent = attach(job="talks", rank=0, world_size=1, spool_dir=sys.argv[2], delivery_timeout_s=1.0, spool_max_bytes=4096)
model = torch.nn.Linear(64, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
deadline = time.monotonic() + 90
ready = False
while not stop.exists() and time.monotonic() < deadline:
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    agent.step()
    if not ready and agent._control.connected:
        ready = True
        print("READY", agent.current_step, flush=True)
    time.sleep(0.02)
agent.close()
"""


def run_training(tmp_path, bootstrap, prefix):
    """The training script in its own process, with no logging set up: what a job's output shows of the agent."""
    script, stop, err = tmp_path / "train.py", tmp_path / "stop", tmp_path / "stderr.txt"
    script.write_text(TRAIN)
    env = {
        "PATH": "/usr/bin:/bin",
        "LOCKSTEP_BOOTSTRAP_SERVERS": bootstrap,
        "LOCKSTEP_TOPIC_PREFIX": prefix,
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, str(script), str(stop), str(tmp_path / "spool")],
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
        env=env,
    )
    return proc, stop, err


def wait_for_line(proc, err: Path, text: str) -> None:
    """Until the training process's stderr holds ``text``; it must not exit first (the bound only ends a hang)."""
    wait_for(lambda: text in err.read_text() or proc.poll() is not None, timeout_s=300)
    assert text in err.read_text() and proc.poll() is None, err.read_text()


def test_the_agent_says_when_it_attaches_accepts_refuses_and_publishes_a_window(settings, tmp_path):
    pytest.importorskip("torch", reason="the agent profiles a real PyTorch training loop")
    topics = ensure_topics(settings)
    proc, stop, err = run_training(tmp_path, settings.bootstrap_servers, settings.topic_prefix)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), (line, err.read_text())
        pub = Publisher(producer_config(settings))
        pub.send(
            topics.control,
            "talks",
            ProfileTrigger(job="talks", window="w-late", start_step=0, steps=2, expected_workers=1),
        )
        pub.flush()
        # the first trigger can take seconds to arrive (the agent's consumer joining): the next one is set ahead of
        # the step the worker was at when it refused the first, not of the step it was at when it attached
        wait_for_line(proc, err, "refused profiling window w-late")
        step = int(re.search(r"w-late .*this worker is at step (\d+)", err.read_text()).group(1))
        pub.send(
            topics.control,
            "talks",
            ProfileTrigger(job="talks", window="w1", start_step=step + 60, steps=3, expected_workers=1),
        )
        pub.flush()
        pub.close()
        wait_for_line(proc, err, "published window w1")
    finally:
        stop.touch()
        proc.wait(timeout=60)
    lines = agent_lines(err.read_text())
    assert lines[0].startswith("lockstep agent attached: job talks"), lines
    assert any(x.startswith("refused profiling window w-late starting at step 0") for x in lines), lines
    assert any(x.startswith(f"accepted profiling window w1: steps {step + 60}..{step + 62}") for x in lines), lines
    assert any(x.startswith("published window w1: its ") for x in lines), lines
    # the refusal travels to the detector on a heartbeat (it closes a window every worker refused at once)
    beats = heartbeats_of(v for _, v in read_all(settings, [topics.heartbeats])[topics.heartbeats])
    echoed = {(hb.trigger_window, hb.trigger_refused) for hb in beats if hb.echo() is not None}
    assert echoed == {("w-late", "past")}, echoed  # w1 was accepted (and, without created_at, not timed)
    # and nothing else by default
    assert all(AGENT_LINES.match(x) for x in lines), lines
    assert "rdkafka" not in err.read_text()


def test_the_agent_says_when_it_spools_and_when_it_drops(tmp_path):
    """Kafka on a closed port: the records go to a spool of 4 KiB, which soon drops its oldest."""
    pytest.importorskip("torch", reason="the script trains with PyTorch")
    proc, stop, err = run_training(tmp_path, "127.0.0.1:1", "lockstep")
    try:
        wait_for_line(proc, err, "spool full")
    finally:
        stop.touch()
        proc.wait(timeout=60)
    lines = agent_lines(err.read_text())
    assert lines[0].startswith("lockstep agent attached: job talks"), lines
    assert any(x.startswith("Kafka unreachable (") and "spooling records to" in x for x in lines), lines
    assert any(x.startswith("spool full (4096 bytes): dropped the ") for x in lines), lines
    assert all(AGENT_LINES.match(x) for x in lines), lines
    assert "rdkafka" not in err.read_text()  # librdkafka's FAIL line per retry: only at --log-level DEBUG
