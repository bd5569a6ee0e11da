"""How well the diagnosis does: every scenario of a suite through the stream processor's diagnosis code.

For each scenario the simulator renders each step of the profiling window as one
Arrow table of every worker's functions; :func:`analyze_step` and
:func:`diagnose_window` (the very functions the stream processor's step and
window stages call) turn them into findings, which are compared with the
scenario's ground truth (:meth:`Fault.truth`).  The wire encoding and Kafka are
skipped: they carry the same tables.

Definitions (per injected fault that should produce a finding):

* **localised**: a finding names exactly the culprit workers (for a fault of a
  link, host or switch, naming that device is enough); for a ``group`` fault, the
  group; for a ``job`` fault, scope ``job``.
* **accuracy**: localised *and* the finding's function is one the fault slows
  *and* its cause is the expected one.  **recall**: localised.
* **precision**: the share of findings that localise some injected fault.
* Faults that must produce *no* finding (``clock_skew``, ``missing_worker``) and
  healthy scenarios count in precision and in ``false_findings``; their
  ``accuracy`` is the share of scenarios that stayed silent.
* **impact error**: |estimated step-time share - true share|, the true share
  measured by re-simulating the window without the fault.
* **calibration**: findings binned by confidence, with the share that were right (culprit,
  function and cause of an injected fault).

This module sits beside ``lockstep/demo.py``: it wires a producer (the
simulator) to the diagnosis, which neither package may import from the other.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..producers.simulator.faults import Truth
from ..producers.simulator.fleet import FleetSimulator, Scenario, ScenarioError, Window
from ..producers.simulator.model import SimulatedStep
from ..schemas.records import Finding
from ..streams.diagnosis import (
    JobHistory,
    StepFrame,
    WindowDiagnosis,
    WindowInfo,
    analyze_step,
    diagnose_window,
    peer_group_key,
)
from ..streams.policy import Policy
from .data import SUITES

STANDARD_SUITE = SUITES / "standard"
CALIBRATION_BINS = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)


@dataclass
class FaultOutcome:
    truth: Truth
    finding: Finding | None = None
    worker: bool = False
    host: bool = False
    device: bool | None = None  # None: the fault names no device
    function: bool = False
    cause: bool = False

    @property
    def localised(self) -> bool:
        return self.worker or (self.truth.by_device and bool(self.device))

    @property
    def correct(self) -> bool:
        return self.localised and self.function and self.cause


@dataclass
class ScenarioResult:
    name: str
    category: str
    workers: int
    faults: list[FaultOutcome]  # faults that should produce a finding
    findings: list[Finding]
    true_findings: list[bool]  # per finding: it localises an injected fault
    silent_expected: bool  # no fault asks for a finding (healthy, clock skew, missing worker)
    healthy: bool  # no fault at all
    coverage: float
    seconds: float


class _Renderer:
    """Turns simulated steps into StepFrames: one Arrow table for all workers of a step, no per-worker loop."""

    def __init__(self, fleet: FleetSimulator, peer_keys: tuple[str, ...]):
        meta = fleet.meta
        self.fleet = fleet
        self.rank = np.array([m.rank for m in meta], dtype=np.int64)
        self.host = np.array([m.host for m in meta], dtype=object)
        self.device = np.array([m.device for m in meta], dtype=object)
        self.nic = np.array([m.nic for m in meta], dtype=object)
        self.switch = np.array([m.switch for m in meta], dtype=object)
        self.group = np.array([peer_group_key(m.labels, peer_keys) for m in meta], dtype=object)

    def frame(self, sim: SimulatedStep, window: str) -> StepFrame:
        table, row_worker = self.fleet.table(sim)
        live = np.flatnonzero(~sim.missing)
        position = np.cumsum(~sim.missing) - 1  # worker -> index among live workers
        return StepFrame(
            job=self.fleet.scenario.job,
            window=window,
            step=sim.step,
            rank=self.rank[live],
            host=self.host[live],
            device=self.device[live],
            nic=self.nic[live],
            switch=self.switch[live],
            group=self.group[live],
            step_time_us=sim.step_time_us[live],
            has_hardware=np.full(live.size, self.fleet.scenario.hardware != "none"),
            row_worker=position[row_worker].astype(np.int32),
            functions=table,
        )


def diagnose_one(
    fleet: FleetSimulator, policy: Policy, window: Window, history: JobHistory | None = None
) -> WindowDiagnosis:
    """Run one window of a scenario through the diagnosis, as the processor's step and window stages do."""
    sc = fleet.scenario
    render = _Renderer(fleet, policy.diagnosis.peer_group_keys)
    results = [analyze_step(render.frame(fleet.step(s), window.name), policy.diagnosis) for s in window.range]
    info = WindowInfo(
        sc.job, window.name, window.start_step, window.steps, sc.topology.workers, tenant=sc.tenant, policy=policy.ref
    )
    # simulated time, never the wall clock: the same scenario gives the same findings
    return diagnose_window(info, results, policy, now=float(window.start_step), history=history)


def diagnose(fleet: FleetSimulator, policy: Policy) -> tuple[list[Finding], float]:
    """The scenario's profiling window: (findings, coverage).

    When the scenario has an earlier ``baseline`` window, it is diagnosed first and
    the job history it leaves (folded in only if that window was healthy, exactly as
    in the processor) is what the profiling window is compared with.
    """
    sc = fleet.scenario
    history = diagnose_one(fleet, policy, sc.baseline).history if sc.baseline else None
    d = diagnose_one(fleet, policy, sc.window, history)
    return d.findings, d.report.coverage


def _device_match(expected: list[str], named: list[str]) -> bool:
    """Each expected device is named (``node0001/gpu5`` matches ``node0001/gpu5/pcie``) and nothing else is."""
    hit = lambda e, n: n == e or n.startswith(e + "/")  # noqa: E731
    return (
        bool(named)
        and all(any(hit(e, n) for n in named) for e in expected)
        and all(any(hit(e, n) for e in expected) for n in named)
    )


def judge(truth: Truth, f: Finding) -> FaultOutcome:
    """How far one finding gets on one fault."""
    if truth.scope == "job":
        worker = host = f.scope == "job"
    elif truth.group is not None and f.group:
        # a group-scope finding names the group's labels, which stand for its workers and hosts
        worker = host = all(f.group.get(k) == v for k, v in truth.group.items())
    else:
        worker = set(f.workers) == set(truth.workers)
        host = set(f.hosts) == set(truth.hosts)
    return FaultOutcome(
        truth=truth,
        finding=f,
        worker=worker,
        host=host,
        device=_device_match(truth.devices, f.devices) if truth.devices else None,
        function=f.function in truth.functions,
        cause=f.cause == truth.cause,
    )


def _rank(o: FaultOutcome) -> tuple:
    overlap = len(set(o.finding.workers) & set(o.truth.workers)) if o.finding else 0
    return (o.correct, o.localised, o.cause, o.function, bool(o.device), overlap)


def run_scenario(scenario: Scenario, policy: Policy) -> ScenarioResult:
    t0 = time.perf_counter()
    fleet = FleetSimulator(scenario)
    findings, coverage = diagnose(fleet, policy)
    outcomes = []
    expected = [(i, t) for i, t in enumerate(scenario.truths()) if t.cause is not None]
    for i, truth in expected:
        truth.impact = fleet.saving(i, scenario.window.range)
        judged = [judge(truth, f) for f in findings]
        outcomes.append(max(judged, key=_rank) if judged else FaultOutcome(truth=truth))
    true_findings = [any(judge(t, f).localised for _, t in expected) for f in findings]
    return ScenarioResult(
        name=scenario.name or scenario.job,
        category=scenario.category,
        workers=scenario.topology.workers,
        faults=outcomes,
        findings=findings,
        true_findings=true_findings,
        silent_expected=not expected,
        healthy=not scenario.faults,
        coverage=coverage,
        seconds=time.perf_counter() - t0,
    )


def load_suite(path: Path | str) -> list[Scenario]:
    """A scenario file, or a folder of them (``*.yaml``, ``*.yml``, ``*.json``, sorted by name)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
        if not files:
            raise ScenarioError(f"suite {path}: no scenario files (*.yaml, *.json) in it")
        return [Scenario.load(p) for p in files]
    if not path.exists():
        raise ScenarioError(f"suite {path}: no such file or folder")
    return [Scenario.load(path)]


# --------------------------------------------------------------------------- summary


@dataclass
class _Tally:
    scenarios: int = 0
    faults: list[FaultOutcome] = field(default_factory=list)
    findings: int = 0
    true_findings: int = 0
    silent_scenarios: int = 0
    silent_ok: int = 0
    coverage: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, r: ScenarioResult) -> None:
        self.scenarios += 1
        self.faults += r.faults
        self.findings += len(r.findings)
        self.true_findings += sum(r.true_findings)
        if r.silent_expected:
            self.silent_scenarios += 1
            self.silent_ok += not r.findings
        self.coverage.append(r.coverage)
        self.seconds += r.seconds

    def figures(self) -> dict:
        n = len(self.faults)
        share = lambda k: _share(sum(bool(k(o)) for o in self.faults), n)  # noqa: E731
        with_device = [o for o in self.faults if o.truth.devices]
        localised = [o for o in self.faults if o.localised]
        errors = [abs(o.finding.impact.step_time_share - o.truth.impact) for o in localised]  # type: ignore[union-attr]
        out = {
            "scenarios": self.scenarios,
            "faults": n,
            "accuracy": share(lambda o: o.correct) if n else _share(self.silent_ok, self.silent_scenarios),
            "recall": share(lambda o: o.localised) if n else None,
            "precision": _share(self.true_findings, self.findings),
            "findings": self.findings,
            "false_findings": self.findings - self.true_findings,
            "worker": share(lambda o: o.worker),
            "host": share(lambda o: o.host),
            "device": _share(sum(bool(o.device) for o in with_device), len(with_device)),
            "function": share(lambda o: o.function),
            "cause": share(lambda o: o.cause),
            "confidence": _mean([o.finding.confidence for o in localised]),  # type: ignore[union-attr]
            "impact_true": _mean([o.truth.impact for o in self.faults]),
            "impact_abs_error": _mean(errors),
            "coverage": _mean(self.coverage),
            "seconds": round(self.seconds, 2),
        }
        if not n:
            for k in ("worker", "host", "device", "function", "cause", "confidence", "impact_true", "impact_abs_error"):
                out[k] = None
        return out


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return round(float(np.mean(xs)), 4) if xs else None


def summarise(results: list[ScenarioResult]) -> dict:
    """The ``--json`` shape: {"overall": {...}, "by_fault": {category: {...}}, "calibration": [...]}."""
    overall, by = _Tally(), dict[str, _Tally]()
    for r in results:
        overall.add(r)
        by.setdefault(r.category, _Tally()).add(r)
    o = overall.figures()
    healthy = [r for r in results if r.healthy]
    o["healthy_false_findings"] = sum(len(r.findings) for r in healthy)
    o["healthy_scenarios"] = len(healthy)
    o["silent_ok"] = _share(overall.silent_ok, overall.silent_scenarios)
    # a finding is right when it is the correct answer (culprit, function, cause) for an injected fault
    right = {id(o_.finding) for r in results for o_ in r.faults if o_.correct}
    pairs = [(f.confidence, id(f) in right) for r in results for f in r.findings]
    calibration: list[dict[str, Any]] = []
    for lo, hi in itertools.pairwise(CALIBRATION_BINS):
        inside = [(c, ok) for c, ok in pairs if lo <= c < hi or c == hi == 1.0]
        calibration.append(
            {
                "confidence": [lo, hi],
                "findings": len(inside),
                "mean_confidence": _mean([c for c, _ in inside]),
                "right": _share(sum(ok for _, ok in inside), len(inside)),
            }
        )
    o["calibration_error"] = (
        round(
            sum(
                b["findings"] / len(pairs) * abs(b["mean_confidence"] - b["right"])
                for b in calibration
                if b["findings"]
            ),
            4,
        )
        if pairs
        else None
    )
    return {"overall": o, "by_fault": {k: by[k].figures() for k in sorted(by)}, "calibration": calibration}


def evaluate(scenarios: list[Scenario], policy: Policy, progress=None) -> tuple[dict, list[ScenarioResult]]:
    results = []
    for i, sc in enumerate(scenarios):
        results.append(run_scenario(sc, policy))
        if progress:
            progress(i + 1, len(scenarios), results[-1])
    return summarise(results), results


# --------------------------------------------------------------------------- the real-fault corpus (``--real``)


@dataclass
class RealCaseResult:
    """One corpus case through the diagnosis (``lockstep diagnose``'s :func:`lockstep.app.offline.diagnose`)."""

    manifest: Any  # lockstep.app.real_corpus.Manifest
    findings: list[Finding]
    named: list[Finding | None]  # per culprit: the best finding that names it (and no worker that is not a culprit)
    seconds: float
    #: lockstep.app.real_corpus.Visibility: whether the fixture shows the fault at all (None: a healthy job), from the
    #: fixture and the manifest only
    visibility: Any = None

    @property
    def visible(self) -> bool:
        """A faulty case whose recording shows its fault (:func:`lockstep.app.real_corpus.visibility`)."""
        return self.visibility is not None and self.visibility.visible

    @property
    def healthy(self) -> bool:
        return not self.manifest.culprits

    def right(self, f: Finding) -> bool:
        """The finding names culprits only, a function the fault slows and a cause that is right for it."""
        import re

        m = self.manifest
        return (
            bool(f.workers)
            and set(f.workers) <= set(m.culprits)
            and re.search(m.function, f.function or "") is not None
            and f.cause in m.causes
        )

    def function_right(self, f: Finding | None) -> bool:
        import re

        return f is not None and re.search(self.manifest.function, f.function or "") is not None

    @property
    def worker(self) -> bool:
        """Every culprit is named."""
        return not self.healthy and all(f is not None for f in self.named)

    @property
    def worker_function(self) -> bool:
        """Every culprit is named, with a function the fault slows."""
        return not self.healthy and all(self.function_right(f) for f in self.named)

    @property
    def cause(self) -> bool:
        """Every culprit is named with a function the fault slows and a cause that is right for it."""
        return not self.healthy and all(f is not None and self.right(f) for f in self.named)

    @property
    def paging(self) -> bool:
        """Worker and function right, each at confidence >= 0.5."""
        return self.worker_function and all(f is not None and f.confidence >= PAGING for f in self.named)

    @property
    def false_findings(self) -> list[Finding]:
        """Findings that name a worker that is not a culprit (on a healthy job: every finding)."""
        return [f for f in self.findings if not f.workers or not set(f.workers) <= set(self.manifest.culprits)]

    @property
    def job_wide(self) -> list[Finding]:
        """On a job with culprits: the findings of job scope."""
        return [] if self.healthy else [f for f in self.findings if f.scope == "job"]


#: the confidence from which a finding pages
PAGING = 0.5


def _best(r_findings: list[Finding], culprit: int, culprits: list[int], judge) -> Finding | None:
    names = [f for f in r_findings if culprit in f.workers and set(f.workers) <= set(culprits)]
    return max(names, key=lambda f: (judge(f), f.confidence), default=None)


def run_real_case(manifest, fixture: Path, policy: Policy) -> RealCaseResult:
    from .offline import diagnose as diagnose_inputs
    from .real_corpus import fixture_connections, fixture_inputs, read_fixture

    t0 = time.perf_counter()
    table = read_fixture(fixture)
    inputs = fixture_inputs(table)
    inputs.connections = fixture_connections(fixture)
    # a fixed clock: the same fixture gives the same findings
    findings = diagnose_inputs(inputs, policy, manifest.case, now=0.0).findings
    r = judge_real(manifest, findings, table)
    r.seconds = time.perf_counter() - t0
    return r


def judge_real(manifest, findings: list[Finding], table) -> RealCaseResult:
    """A case's findings against its manifest; ``table``: the fixture's rows they came from (its visibility)."""
    from .real_corpus import VISIBILITY_COLUMNS, visibility

    r = RealCaseResult(manifest, findings, [], 0.0)
    r.named = [
        _best(findings, c, manifest.culprits, lambda f: (r.right(f), r.function_right(f))) for c in manifest.culprits
    ]
    r.visibility = visibility(table.select(list(VISIBILITY_COLUMNS)), manifest.culprits, manifest.function)
    return r


@dataclass
class _RealTally:
    results: list[RealCaseResult] = field(default_factory=list)

    def figures(self) -> dict:
        faults = [r for r in self.results if not r.healthy]
        healthy = [r for r in self.results if r.healthy]
        n = len(faults)
        share = lambda k: _share(sum(bool(k(r)) for r in faults), n)  # noqa: E731
        named = [f for r in faults if r.worker_function for f in r.named if f is not None]
        healthy_findings = [f for r in healthy for f in r.findings]
        wrong = [f for r in faults for f in r.false_findings]
        pairs = [(f.confidence, r.right(f)) for r in self.results for f in r.findings]
        visible = [r for r in faults if r.visible]
        shown = lambda k: _share(sum(bool(k(r)) for r in visible), len(visible))  # noqa: E731
        return {
            "cases": len(self.results),
            "faults": n,
            "worker": share(lambda r: r.worker),
            "worker_function": share(lambda r: r.worker_function),
            "cause": share(lambda r: r.cause),
            "paging": share(lambda r: r.paging),
            "confidence": _mean([f.confidence for f in named]),
            "healthy": len(healthy),
            "healthy_findings": len(healthy_findings),
            "healthy_confident": sum(f.confidence >= PAGING for f in healthy_findings),
            "false_confident": sum(f.confidence >= PAGING for f in wrong),
            "job_wide": sum(bool(r.job_wide) for r in faults),
            "job_wide_confident": sum(any(f.confidence >= PAGING for f in r.job_wide) for r in faults),
            "findings": len(pairs),
            "calibration_error": _calibration(pairs)[1],
            "seconds": round(sum(r.seconds for r in self.results), 2),
            # added with the fixtures' visibility (lockstep.app.real_corpus.visibility): faults whose recording shows
            # the fault, and worker+fn and paging over those faults only
            "visible": len(visible),
            "worker_function_visible": shown(lambda r: r.worker_function),
            "paging_visible": shown(lambda r: r.paging),
        }


def _calibration(pairs: list[tuple[float, bool]]) -> tuple[list[dict[str, Any]], float | None]:
    """(bins of confidence with the share of their findings that were right, expected calibration error)."""
    bins: list[dict[str, Any]] = []
    for lo, hi in itertools.pairwise(CALIBRATION_BINS):
        inside = [(c, ok) for c, ok in pairs if lo <= c < hi or c == hi == 1.0]
        bins.append(
            {
                "confidence": [lo, hi],
                "findings": len(inside),
                "mean_confidence": _mean([c for c, _ in inside]),
                "right": _share(sum(ok for _, ok in inside), len(inside)),
            }
        )
    error = (
        round(
            sum(b["findings"] / len(pairs) * abs(b["mean_confidence"] - b["right"]) for b in bins if b["findings"]), 4
        )
        if pairs
        else None
    )
    return bins, error


REAL_PARTS = ("dev", "test", "holdout", "all")


def summarise_real(results: list[RealCaseResult], part: str = "all") -> dict:
    """The ``--real --json`` shape: {"parts": {PART: {"overall", "by_mechanism", "by_size", "by_culprits",
    "calibration"}}} (``by_culprits``: by the number of culprits, 0 for healthy jobs; added in issue 21's ninth pass).

    ``part`` ``all`` gives the parts dev, test and all (both together; holdout too where the folder has holdout
    cases); ``dev``, ``test`` or ``holdout`` that part alone.
    """
    if part not in REAL_PARTS:
        raise ValueError(f"part must be one of {REAL_PARTS}, got {part!r}")
    parts: dict[str, dict] = {}
    present = {r.manifest.split for r in results}
    names = [n for n in REAL_PARTS if n != "holdout" or n in present] if part == "all" else [part]
    for name in names:
        mine = [r for r in results if name == "all" or r.manifest.split == name]
        by_mech: dict[str, _RealTally] = {}
        by_size: dict[int, _RealTally] = {}
        by_culprits: dict[int, _RealTally] = {}
        for r in mine:
            by_mech.setdefault(r.manifest.mechanism, _RealTally()).results.append(r)
            by_size.setdefault(r.manifest.ranks, _RealTally()).results.append(r)
            by_culprits.setdefault(len(r.manifest.culprits), _RealTally()).results.append(r)
        pairs = [(f.confidence, r.right(f)) for r in mine for f in r.findings]
        parts[name] = {
            "overall": _RealTally(mine).figures(),
            "by_mechanism": {k: by_mech[k].figures() for k in sorted(by_mech)},
            "by_size": {str(k): by_size[k].figures() for k in sorted(by_size)},
            "by_culprits": {str(k): by_culprits[k].figures() for k in sorted(by_culprits)},
            "calibration": _calibration(pairs)[0],
        }
    return {"parts": parts}


def evaluate_real(folder: Path, policy: Policy, part: str = "all", progress=None) -> tuple[dict, list[RealCaseResult]]:
    """Every case of the corpus in ``folder`` (of the part asked for) diagnosed and scored."""
    from .real_corpus import load_corpus

    cases = [(m, p) for m, p in load_corpus(folder) if part == "all" or m.split == part]
    results = []
    for i, (m, p) in enumerate(cases):
        results.append(run_real_case(m, p, policy))
        if progress:
            progress(i + 1, len(cases), results[-1])
    return summarise_real(results, part), results
