"""The agent's answer to a hang trigger: the training thread's stack and region, the last collective, the
processes of its host, within the report's bound; nothing of it runs before a trigger."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from lockstep.producers.agent.hang import (
    CollectiveTracker,
    HangResponder,
    ProcessRegistry,
    RegionTracker,
    fit,
    host_workers,
)
from lockstep.producers.agent.redact import Redaction
from lockstep.schemas.records import MAX_HANG_REPORT_BYTES, HangReport, ProfileTrigger, WorkerMeta, encode


def trigger(kind: str = "hang") -> ProfileTrigger:
    return ProfileTrigger(job="j", window="hang-7", start_step=10, steps=4, expected_workers=4, kind=kind)


def stuck_in_a_region(started: threading.Event, release: threading.Event) -> None:
    with torch.profiler.record_function("load_batch"):
        started.set()
        release.wait(30)


def test_the_answer_names_the_stuck_threads_frame_and_region_from_another_thread(tmp_path):
    started, release = threading.Event(), threading.Event()
    responder: list[HangResponder] = []

    def training() -> None:
        responder.append(
            HangResponder(
                WorkerMeta(rank=2, host="h", device="h/gpu2", local_rank=2),
                Redaction.parse("paths=strip,stacks=keep"),
                registry=ProcessRegistry(tmp_path),
            )
        )
        stuck_in_a_region(started, release)

    t = threading.Thread(target=training)
    t.start()
    try:
        assert started.wait(30)
        rep = responder[0].answer(trigger(), 9)
        assert responder[0].answer(trigger(), 9) is None  # one answer per window
        assert responder[0].answer(trigger("slowdown"), 9) is None
    finally:
        release.set()
        t.join()
    assert rep is not None
    assert (rep.worker, rep.last_step, rep.region, rep.thread) == (2, 9, "load_batch", "found")
    assert rep.frame.endswith("wait") or "stuck_in_a_region" in " ".join(rep.stack)
    assert any("stuck_in_a_region" in f for f in rep.stack)
    assert all("/" not in f.split("(")[0] for f in rep.stack)  # paths stripped
    responder[0].close()
    assert not (tmp_path / "2.pid").exists()


def test_stacks_are_dropped_under_the_default_redaction_but_the_frame_is_named():
    rep = HangResponder(WorkerMeta(rank=0, host="h"), Redaction()).report(trigger(), 3)
    assert rep.stack == [] and rep.frame and "/" not in rep.frame.split("(")[0]


def test_the_collective_counter_says_which_call_is_open_and_its_group():
    t = CollectiveTracker()
    seen = []

    def fake_all_reduce(tensor, group=None):
        seen.append((t.name, t.seq, t.open, t.group_name()))

    wrapped = t.wrap("all_reduce", fake_all_reduce)
    wrapped(torch.zeros(1))
    wrapped(torch.zeros(1))
    assert seen == [("all_reduce", 1, True, "default"), ("all_reduce", 2, True, "default")]
    assert t.open is False and t.seq == 2


def test_installing_wraps_torch_distributed_once_and_a_second_agent_shares_the_counter():
    first = CollectiveTracker().install()
    assert getattr(dist.all_reduce, "__lockstep_collective__", None) is first
    assert CollectiveTracker().install() is first


def test_the_region_tracker_follows_the_last_agents_thread_only():
    r = RegionTracker(threading.get_ident()).install()
    with torch.profiler.record_function("outer"), torch.profiler.record_function("inner"):
        assert r.innermost() == "inner"
        done = threading.Event()

        def other() -> None:
            with torch.profiler.record_function("elsewhere"):
                done.set()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert done.is_set() and r.innermost() == "inner"
    assert r.innermost() == ""


def test_a_report_is_cut_to_its_bound():
    rep = HangReport(job="j", window="w", worker=0, host="h", expected_workers=1, stack=["x" * 1000] * 60, frame="f")
    out = fit(rep)
    assert len(encode(out)) <= MAX_HANG_REPORT_BYTES and out.truncated and out.stack == ["x" * 1000] * len(out.stack)


def test_host_workers_come_from_the_launchers_local_world():
    assert host_workers(6, 2, {"LOCAL_WORLD_SIZE": "4"}) == [4, 5, 6, 7]
    assert host_workers(6, 2, {}) == []


def test_the_registry_tells_an_exited_process_from_a_running_one(tmp_path):
    reg = ProcessRegistry(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reg.register(0)
        reg.register(1, child.pid)
        assert reg.exited([0, 1, 2]) == []
        child.kill()
        child.wait()
        assert reg.exited([0, 1, 2]) == [1]
        reg.unregister(1)  # a worker that closed is not a death
        assert reg.exited([0, 1]) == []
    finally:
        child.kill()


def test_a_closing_agent_names_the_host_workers_that_exited_before_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    reg = ProcessRegistry(tmp_path)
    r = HangResponder(WorkerMeta(rank=0, host="h", local_rank=0), Redaction(), registry=reg)
    assert r.exit_report("j", 2, 5) is None  # rank 1 never registered
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    reg.register(1, child.pid)
    rep = r.exit_report("j", 2, 5)
    assert rep is not None and (rep.reason, rep.exited, rep.window) == ("exit", [1], f"exit-r1-p{child.pid}")
