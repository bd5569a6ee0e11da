"""The real-fault corpus's files: fixtures read back as the diagnosis's inputs, manifests, the measured cost."""

from __future__ import annotations

import pyarrow as pa
import pytest

from lockstep.app.offline import Inputs
from lockstep.app.real_corpus import (
    CORPUS,
    CorpusError,
    Manifest,
    Measured,
    load_corpus,
    load_fixture,
    measure,
    read_manifest,
    write_manifest,
)
from lockstep.producers.agent.summarise import StepSummary
from lockstep.schemas import functions as ft
from lockstep.schemas.records import WorkerMeta


def inputs(times: dict[int, dict[str, float]], steps: int = 4, step_us: float = 10_000.0) -> Inputs:
    out = Inputs(files=1)
    for w, funcs in times.items():
        out.workers[w] = WorkerMeta(rank=w, host=f"node{w}", device="cpu")
        for s in range(steps):
            t = pa.table(
                {
                    "function": list(funcs),
                    "kind": ["compute"] * len(funcs),
                    "calls": [1] * len(funcs),
                    "total_us": list(funcs.values()),
                    "critical_us": list(funcs.values()),
                }
            )
            out.summaries.append(StepSummary(w, s, step_us, ft.conform(t)))
    return out


def test_measure_finds_the_culprits_excess_in_the_matching_function():
    peers = {"forward": 1000.0, "backward": 3000.0, "log_metrics": 100.0}
    job = inputs({0: peers, 1: peers, 2: {**peers, "log_metrics": 2100.0}, 3: {**peers, "forward": 1500.0}})
    m = measure(job, [2], r"log_metrics|forward", healthy_step_us=8000.0)
    assert m.function == "log_metrics"
    assert m.excess_share == pytest.approx(2000 / 10_000)
    assert m.step_us == 10_000.0 and m.step_slowdown == pytest.approx(0.25)
    # a function only the culprit runs: the peers' time in it is none
    only = inputs({0: peers, 1: {**peers, "evaluate": 500.0}})
    assert measure(only, [1], "evaluate", 10_000.0).excess_share == pytest.approx(0.05)
    # a healthy job: nothing to measure but its steps
    h = measure(job, [], "", 10_000.0)
    assert h.function is None and h.excess_share == 0.0 and h.step_slowdown == 0.0


def test_a_manifest_round_trips_and_a_bad_split_is_refused(tmp_path):
    m = Manifest(
        format=1,
        case="x-mild-w2",
        mechanism="x",
        resource="software",
        severity="mild",
        intended_share=0.04,
        measured=Measured(healthy_step_us=1.0, step_us=1.0, step_slowdown=0.0, function=None, excess_share=0.0),
        ranks=2,
        culprits=[1],
        function="forward",
        causes=["undetermined"],
        split="dev",
        neighbour=False,
        knobs={"severity": 0.04},
        fixture="x-mild-w2.parquet",
        recorded="2026-12-01T00:00:00Z",
        record_seconds=1.0,
    )
    write_manifest(m, tmp_path / "x.json")
    assert read_manifest(tmp_path / "x.json") == m
    with pytest.raises(CorpusError, match="its fixture"):
        load_corpus(tmp_path)
    (tmp_path / "x.json").write_text((tmp_path / "x.json").read_text().replace('"dev"', '"both"'))
    with pytest.raises(CorpusError, match="split"):
        read_manifest(tmp_path / "x.json")


def test_every_fixture_reads_back_as_every_worker_at_every_step():
    for m, path in load_corpus(CORPUS):
        got = load_fixture(path)
        assert sorted(got.workers) == list(range(m.ranks)), m.case
        steps = {s.step for s in got.summaries}
        assert len(got.summaries) == m.ranks * len(steps) and len(steps) >= 8, m.case
