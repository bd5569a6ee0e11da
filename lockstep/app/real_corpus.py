"""The real-fault corpus: small fixtures of real multi-process jobs with a fault, and their manifests.

Each case of ``tests/data/real/corpus/`` is two files: ``ID.parquet``, the fixture (what the diagnosis reads
of the run: every worker's function table per step with ``worker``, ``step``, ``step_time_us``, ``host``,
``device`` and ``hardware`` columns, written by ``tests/integration/real_faults.py``), and ``ID.json``, its
:class:`Manifest` (the fault's mechanism, resource class, severity intended and measured, culprits, the
function it slows, the causes that are right for it, and the case's part of the split, ``dev`` or ``test``; the
cases of ``tests/data/real/holdout/``, recorded later, ``holdout``).
``lockstep evaluate --real`` (:func:`lockstep.app.evaluate.evaluate_real`) diagnoses every case and scores it.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import msgspec
import numpy as np
import pyarrow.parquet as pq

from ..producers.agent.summarise import StepSummary
from ..schemas import functions as ft
from ..schemas.errors import LockstepError
from ..schemas.records import WorkerMeta
from .data import CORPUS, CORPUS_HOLDOUT
from .offline import Inputs

#: the manifest format's version (add fields, never rename)
FORMAT = 1
#: the held-out part (split ``holdout``), recorded after the dev/test split had been tuned on: its own folder, so
#: that scoring the corpus while developing never shows it
HOLDOUT = CORPUS_HOLDOUT
META = ("worker", "step", "step_time_us", "host", "device", "hardware")
PARTS = ("dev", "test", "holdout")


class CorpusError(LockstepError, ValueError):
    """A corpus folder or one of its manifests is unusable (the message names the file)."""


class Measured(msgspec.Struct, kw_only=True):
    """The fault's cost, measured from the recording."""

    healthy_step_us: (
        float  # the job's healthy step: its fastest warm-up step after the first (the slowest rank's), before the fault
    )
    step_us: float  # the profiled steps' mean step time (the median worker's)
    step_slowdown: float  # step_us / healthy_step_us - 1 (the profiler's own cost included: compare healthy jobs')
    function: str | None  # the culprits' function (matching the manifest's) whose time exceeds the peers' most
    excess_share: float  # that excess (culprits' mean - the other workers' median), summed over steps, / step time


class Manifest(msgspec.Struct, kw_only=True):
    format: int
    case: str  # the case id: MECHANISM-SEVERITY-wRANKS[-two], healthy[-neighbour]-wRANKS
    mechanism: str  # how the fault was made (README's table), or "healthy"
    resource: str  # cpu | memory | storage | network | software | input | none
    severity: str  # mild | strong | none
    intended_share: float  # what the fault was meant to cost: a share of the healthy step
    measured: Measured
    ranks: int
    culprits: list[int]  # the faulty workers (empty: a healthy job)
    function: str  # a regular expression: the functions the fault slows ("" for a healthy job)
    causes: list[str]  # the causes that are right for it ("undetermined" where the evidence may support none)
    split: str  # dev | test | holdout (tests/data/real/holdout/), fixed when the case was first written
    neighbour: bool  # a healthy job with a noisy neighbour process on the host
    knobs: dict[str, float]  # the fault's settings (quota, duty, nice, rate_mbit, severity, ...)
    fixture: str  # the Parquet file beside the manifest
    recorded: str  # UTC time of the recording
    record_seconds: float


def write_manifest(m: Manifest, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n")


def read_manifest(path: Path) -> Manifest:
    try:
        m = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError) as exc:
        raise CorpusError(f"{path}: {exc}") from None
    if m.split not in PARTS:
        raise CorpusError(f"{path}: split must be one of {PARTS}, got {m.split!r}")
    return m


def load_corpus(folder: Path = CORPUS) -> list[tuple[Manifest, Path]]:
    """Every case of the folder, by case id: (manifest, fixture path)."""
    if not folder.is_dir():
        raise CorpusError(f"{folder}: no such corpus folder")
    out = []
    for p in sorted(folder.glob("*.json")):
        m = read_manifest(p)
        fixture = folder / m.fixture
        if not fixture.exists():
            raise CorpusError(f"{p}: its fixture {fixture.name} is missing")
        out.append((m, fixture))
    if not out:
        raise CorpusError(f"{folder}: no case manifests (*.json) in it")
    return out


def load_fixture(path: Path) -> Inputs:
    """A fixture -> the inputs of :func:`lockstep.app.offline.diagnose`."""
    t = pq.read_table(path).sort_by([("worker", "ascending"), ("step", "ascending")])
    worker, step = t.column("worker").to_numpy(), t.column("step").to_numpy()
    starts = [0, *(i for i in range(1, t.num_rows) if (worker[i], step[i]) != (worker[i - 1], step[i - 1])), t.num_rows]
    inputs = Inputs(files=1)
    host, device, hardware = (t.column(c).to_pylist() for c in ("host", "device", "hardware"))
    step_time = t.column("step_time_us").to_numpy()
    functions = t.drop_columns(list(META)).combine_chunks()
    for a, b in itertools.pairwise(starts):
        w = int(worker[a])
        inputs.workers.setdefault(w, WorkerMeta(rank=w, host=host[a], device=device[a]))
        inputs.hardware[w] = hardware[a]
        inputs.summaries.append(
            StepSummary(w, int(step[a]), float(step_time[a]), ft.conform(functions.slice(a, b - a)))
        )
    return inputs


def measure(inputs: Inputs, culprits: list[int], function: str, healthy_step_us: float) -> Measured:
    """The fault's cost in the recording: the job's slowdown against its own warm-up, and the culprits' excess over
    their peers in the matching function that exceeds most."""
    by_step: dict[int, dict[int, StepSummary]] = {}
    for s in inputs.summaries:
        by_step.setdefault(s.step, {})[s.worker] = s
    step_us = float(np.mean([np.median([s.step_time_us for s in ws.values()]) for ws in by_step.values()]))
    total_step = step_us * len(by_step)
    excess: dict[str, float] = {}
    if culprits and function:
        pattern = re.compile(function)
        for ws in by_step.values():
            times: dict[str, dict[int, float]] = {}
            for w, s in ws.items():
                names = s.functions.column("function").to_pylist()
                totals = s.functions.column("total_us").to_pylist()
                for name, us in zip(names, totals, strict=True):
                    if pattern.search(name):
                        times.setdefault(name, {})[w] = times.get(name, {}).get(w, 0.0) + float(us)
            for name, per in times.items():
                mine = [per.get(c, 0.0) for c in culprits if c in ws]
                peers = [per.get(w, 0.0) for w in ws if w not in culprits]
                if mine and peers:
                    excess[name] = excess.get(name, 0.0) + float(np.mean(mine)) - float(np.median(peers))
    top = max(excess, key=excess.__getitem__) if excess else None
    return Measured(
        healthy_step_us=round(healthy_step_us, 1),
        step_us=round(step_us, 1),
        step_slowdown=round(step_us / healthy_step_us - 1, 4) if healthy_step_us > 0 else 0.0,
        function=top,
        excess_share=round(excess[top] / total_step, 4) if top is not None and total_step > 0 else 0.0,
    )
