"""The hang diagnosis: who is not where the majority of a hung job waits, from the agents' answers."""

from __future__ import annotations

import msgspec

from lockstep.schemas.records import HangReport, decode, encode
from lockstep.streams.diagnosis.hang import diagnose_hang

BACKWARD = "graph.py(829): _engine_run_backward"


def answer(worker: int, **kw) -> HangReport:
    base = dict(
        job="j",
        window="hang-1",
        worker=worker,
        host=f"h{worker // 4}",
        expected_workers=8,
        device=f"h{worker // 4}/gpu{worker % 4}",
        last_step=41,
        frame=BACKWARD,
        collective="all_reduce",
        collective_seq=42,
        collective_group="default",
        collective_open=False,
        host_workers=list(range(4 * (worker // 4), 4 * (worker // 4) + 4)),
        sent_at=100.0 + worker,
    )
    base.update(kw)
    return HangReport(**base)


def test_a_worker_stuck_in_its_data_loading_is_the_culprit_with_its_region_and_device():
    reps = [answer(w) for w in range(8) if w != 5]
    reps.append(
        answer(
            5, frame="data.py(12): __getitem__", region="enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
        )
    )
    (f,) = diagnose_hang("j", "hang-1", reps, 8, now=200.0)
    assert (f.workers, f.cause, f.scope, f.devices, f.hosts) == ([5], "hang", "worker", ["h1/gpu1"], ["h1"])
    assert f.function.startswith("enumerate(DataLoader)") and f.function_kind == "dataloader"
    assert "__getitem__" in f.summary and "7 of 8 answering workers wait in" in f.summary
    assert BACKWARD in f.summary  # the majority's position is the evidence
    assert f.confidence >= 0.9
    assert decode(encode(f)) == f


def test_inside_the_majoritys_collective_is_waiting_an_earlier_call_of_it_is_not():
    reps = [answer(w, frame="train.py(50): main", collective_open=True) for w in range(8)]
    reps[2] = answer(2, frame="train.py(50): main", collective_open=True, collective_seq=41, last_step=40)
    reps[6] = answer(6, frame="train.py(61): main", collective_open=True, collective_seq=43)  # ahead: waits too
    found = diagnose_hang("j", "w", reps, 8, now=1.0)
    assert [f.workers for f in found] == [[2]]
    assert found[0].function_kind == "collective" and "all_reduce #41" in found[0].summary


def test_a_silent_worker_whose_process_its_host_saw_exit_died_a_silent_one_still_running_hangs():
    reps = [answer(w, exited=[1] if w in (0, 2) else []) for w in range(8) if w not in (1, 3)]
    found = {tuple(f.workers): f for f in diagnose_hang("j", "w", reps, 8, now=1.0)}
    assert found[(1,)].cause == "worker_died" and "exited" in found[(1,)].summary
    assert found[(3,)].cause == "hang" and "did not answer while its host's other workers did" in found[(3,)].summary
    assert found[(1,)].hosts == ["h0"]


def test_a_whole_silent_host_is_named_at_lower_confidence():
    reps = [answer(w) for w in range(4)]
    (f,) = diagnose_hang("j", "w", reps, 8, now=1.0)
    assert f.workers == [4, 5, 6, 7] and f.scope == "group" and f.confidence < 0.8
    assert "nor did any worker known to share its host" in f.summary


def test_every_worker_in_one_place_is_one_job_scope_finding_of_low_confidence():
    (f,) = diagnose_hang("j", "w", [answer(w) for w in range(8)], 8, now=1.0)
    assert f.scope == "job" and f.function == BACKWARD and f.confidence < 0.5
    assert "below Python" in f.summary


def test_replayed_and_duplicated_answers_give_the_same_findings():
    reps = [answer(w) for w in range(8)]
    reps[4] = answer(4, frame="x.py(3): spin", region="rank_specific_metrics")
    a = diagnose_hang("j", "w", reps, 8, now=1.0)
    b = diagnose_hang("j", "w", list(reversed(reps)) + reps[:3], 8, now=1.0)
    assert [f.id for f in a] == [f.id for f in b] and a[0].workers == [4]


def test_a_report_keeps_its_wire_contract():
    r = answer(0)
    raw = msgspec.json.decode(encode(r))
    assert raw["schema"] == "HangReport" and raw["v"] == 1
    assert decode(encode(r), HangReport) == r


def test_closing_agents_that_saw_a_host_worker_exit_name_it_and_no_other_host():
    reps = [answer(w, reason="exit", thread="gone", frame="", exited=[1], last_step=40 + w) for w in (0, 2, 3)]
    (f,) = diagnose_hang("j", "exit-r1-p77", reps, 8, now=1.0)
    assert (f.workers, f.cause, f.function) == ([1], "worker_died", "(process exited)")
    assert "closed after it" in f.summary
    nobody = [answer(w, reason="exit", thread="gone", frame="") for w in (0, 1, 2, 3)]
    assert diagnose_hang("j", "exit-x", nobody, 8, now=1.0) == []
