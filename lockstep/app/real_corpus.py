"""The real-fault corpus: small fixtures of real multi-process jobs with a fault, and their manifests.

Each case of ``tests/data/real/corpus/`` is two files: ``ID.parquet``, the fixture (what the diagnosis reads
of the run: every worker's function table per step with ``worker``, ``step``, ``step_time_us``, ``host``,
``device`` and ``hardware`` columns, written by ``tests/integration/real_faults.py``), and ``ID.json``, its
:class:`Manifest` (the fault's mechanism, resource class, severity intended and measured, culprits, the
function it slows, the causes that are right for it, and the case's part of the split, ``dev`` or ``test``; the
cases of ``tests/data/real/holdout/``, recorded later, ``holdout``).
``lockstep evaluate --real`` (:func:`lockstep.app.evaluate.evaluate_real`) diagnoses every case and scores it,
beside whether the recording shows the fault at all (:func:`visibility`, from the fixture and the manifest only).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
#: a fault is visible where each culprit's work in the fault's functions is above the other workers' median in at
#: least this share of the steps that run them (by chance: 1 in 2 a step at any job size, >= 7 of 10 steps 17%, >= 17
#: of 24 3%; a fault in the data may lose 3 of 10 steps, or 7 of 24, to the host's noise; docs/real-faults.md, "Which
#: faults the recordings show")
VISIBLE_ABOVE = 0.7
#: ... and its median excess over the other workers' median is at least this share of the step (the smallest cost
#: issue 21 asks the diagnosis to find: a kernel costing 1% of the step)
VISIBLE_EXCESS = 0.01
#: the columns :func:`visibility` reads
VISIBILITY_COLUMNS = ("worker", "step", "step_time_us", "function", "critical_us")


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
    mechanism: str  # how the fault was made (the corpus README's table), or "healthy"
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
    # added after the first recordings: the connection table beside the manifest (the workers' TCP connections over
    # the fixture's steps, CONNECTION_SCHEMA), "" where the case was recorded without one
    connections: str = ""
    # added with it: the host's 1-minute load average as the recording began (-1: not recorded); this machine has
    # 2 cores, and a loaded host hides a fault in the others' noise
    host_load: float = -1.0


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


def read_fixture(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """A fixture's table (its ``columns`` only, if given), as recorded."""
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CorpusError(f"{path}: {exc}") from None


def connections_path(fixture: Path) -> Path:
    """Where a fixture's connection table lies: ``ID.connections.parquet`` beside ``ID.parquet``."""
    return fixture.with_name(f"{fixture.stem}.connections.parquet")


def fixture_connections(fixture: Path) -> pa.Table | None:
    """The fixture's connection table, None where it was recorded without one."""
    from .offline import DiagnoseError, read_connections

    path = connections_path(fixture)
    if not path.exists():
        return None
    try:
        return read_connections(path)
    except DiagnoseError as exc:
        raise CorpusError(str(exc)) from None


def load_fixture(path: Path) -> Inputs:
    """A fixture (and its connection table, if it has one) -> the inputs of :func:`lockstep.app.offline.diagnose`."""
    inputs = fixture_inputs(read_fixture(path))
    inputs.connections = fixture_connections(path)
    return inputs


def fixture_inputs(table: pa.Table) -> Inputs:
    """A fixture's table (:func:`read_fixture`) -> the inputs of :func:`lockstep.app.offline.diagnose`."""
    t = table.sort_by([("worker", "ascending"), ("step", "ascending")])
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


class Visibility(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a faulty case's recording shows its fault (:func:`visibility`), per culprit in the manifest's order."""

    visible: bool
    steps: int  # the steps in which some worker ran a function the fault slows (its occurrences)
    above: list[int]  # per culprit: of those steps, how many its work there is above the other workers' median
    excess: list[float]  # per culprit: median over those steps of (its work - the others' median) / the step time
    reason: str  # "" where visible; else one line: the culprits that fall short, and of which bar


def visibility(table: pa.Table, culprits: Sequence[int], function: str) -> Visibility | None:
    """Whether the recording shows the fault, from the fixture and the ground truth alone (never the diagnosis).

    A worker's *work* in the fault's functions at a step is its ``critical_us`` (time not under a child: nested
    matches are not counted twice) summed over the functions that ``function`` (the manifest's regular expression,
    ``re.search``) matches. Over the steps where some worker has such work (a function that runs every k-th step
    counts at its occurrences), the fault is *visible* when every culprit's work is above the non-culprits' median
    work in at least :data:`VISIBLE_ABOVE` of those steps and its median excess over that median, as a share of the
    step time (the workers' median), is at least :data:`VISIBLE_EXCESS`. ``None`` for a healthy job.

    ``table`` needs the columns ``worker``, ``step``, ``step_time_us``, ``function`` and ``critical_us``.
    """
    if not culprits:
        return None
    workers, w_idx = np.unique(table.column("worker").to_numpy(), return_inverse=True)
    steps, s_idx = np.unique(table.column("step").to_numpy(), return_inverse=True)
    wanted = np.asarray(culprits, dtype=workers.dtype)
    if not np.isin(wanted, workers).all() or len(set(culprits)) == len(workers):
        raise CorpusError(f"culprits {list(culprits)} are not some of the fixture's workers {workers.tolist()}")
    names = table.column("function")
    pattern = re.compile(function)
    hits = pa.array([n for n in pc.unique(names).to_pylist() if n is not None and pattern.search(n)], pa.string())
    mask = pc.fill_null(pc.is_in(names, value_set=hits), False).to_numpy(zero_copy_only=False)
    work = np.zeros((len(workers), len(steps)))
    critical = table.column("critical_us").to_numpy(zero_copy_only=False).astype(float)
    np.add.at(work, (w_idx[mask], s_idx[mask]), critical[mask])
    step_time = np.full((len(workers), len(steps)), np.nan)
    step_time[w_idx, s_idx] = table.column("step_time_us").to_numpy(zero_copy_only=False)
    occurs = (work > 0).any(axis=0)
    n = int(occurs.sum())
    if n == 0:
        return Visibility(
            visible=False,
            steps=0,
            above=[0] * len(culprits),
            excess=[0.0] * len(culprits),
            reason=f"no worker ran a function matching {function!r}",
        )
    is_culprit = np.isin(workers, wanted)
    mine = work[np.searchsorted(workers, wanted)][:, occurs]
    others = work[~is_culprit][:, occurs]
    step_us = np.nanmedian(step_time[:, occurs], axis=0)
    typical = np.median(others, axis=0)
    above = (mine > typical).sum(axis=1)
    excess = np.median((mine - typical) / step_us, axis=1)
    need = math.ceil(VISIBLE_ABOVE * n - 1e-9)
    short = [
        f"w{c}: above the others' median in {a}/{n} steps{'' if a >= need else f' (< {VISIBLE_ABOVE:.0%})'}, median excess "
        f"{e:+.1%} of the step{'' if e >= VISIBLE_EXCESS else f' (< {VISIBLE_EXCESS:.0%})'}"
        for c, a, e in zip(culprits, above.tolist(), excess.tolist(), strict=True)
        if a < need or e < VISIBLE_EXCESS
    ]
    return Visibility(
        visible=not short,
        steps=n,
        above=above.tolist(),
        excess=[round(e, 4) for e in excess.tolist()],
        reason="; ".join(short),
    )
