"""The simulated fleet: a job's workers producing the same records real agents produce."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import yaml

from ...schemas import functions as ft
from ...schemas.errors import LockstepError
from ...schemas.records import (
    SHARD_WORKERS,
    Echo,
    FeatureBatch,
    HeartbeatBatch,
    ProfileTrigger,
    Sampling,
    StepHeartbeat,
    WindowFeatures,
    WorkerMeta,
)
from .faults import Fault, FaultError, Truth, effects
from .model import KIND, NAMES, SAMPLED, SimulatedStep, Static, Workload, simulate_step, step_rng
from .topology import Topology, TopologyError


class ScenarioError(LockstepError, ValueError):
    """A scenario file is malformed."""


@dataclass(frozen=True)
class Window:
    """A profiling window: ``steps`` steps from ``start_step``."""

    start_step: int = 60
    steps: int = 8

    @property
    def range(self) -> range:
        return range(self.start_step, self.start_step + self.steps)

    @property
    def name(self) -> str:
        return f"w{self.start_step}"


@dataclass(frozen=True)
class Scenario:
    """A simulated job, its faults and the window to profile.  Scenario files are YAML or JSON of this shape."""

    job: str = "demo-job"
    seed: int = 7
    topology: Topology = field(default_factory=Topology)
    workload: Workload = field(default_factory=Workload)
    faults: tuple[Fault, ...] = ()
    window: Window = field(default_factory=Window)
    baseline: Window | None = None  # an earlier window of the same job, before any fault (job-wide regressions)
    hardware_hz: float = 100.0  # hardware samples per second during a window
    hardware: str = "nvml"  # what the samplers see: nvml (NVML and the host's counters), host (the host's only), none
    tenant: str = ""
    name: str = ""
    group: str = ""  # the suite category it belongs to, when not its fault's (e.g. small_job)

    @property
    def category(self) -> str:
        """What the scenario tests: its ``group``, else ``healthy``, the fault type, or ``two_faults``."""
        if self.group:
            return self.group
        if not self.faults:
            return "healthy"
        return self.faults[0].type if len(self.faults) == 1 else "two_faults"

    @classmethod
    def load(cls, path: Path | str) -> Scenario:
        path = Path(path)
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except OSError as exc:
            raise ScenarioError(f"scenario {path}: {exc.strerror}") from None
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ScenarioError(
                f"scenario {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({str(exc).splitlines()[0]})"
            ) from None
        return cls.from_dict(data, str(path), default_name=path.stem)

    @classmethod
    def from_dict(cls, data: object, where: str = "scenario", default_name: str = "") -> Scenario:
        if not isinstance(data, dict):
            raise ScenarioError(f"{where}: expected a mapping")
        known = {
            "name",
            "group",
            "job",
            "seed",
            "topology",
            "workload",
            "faults",
            "window",
            "baseline",
            "hardware_hz",
            "hardware",
            "tenant",
        }
        unknown = set(data) - known
        if unknown:
            raise ScenarioError(f"{where}: unknown key(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        try:
            topo = Topology(**(data.get("topology") or {}))
            workload = Workload(**(data.get("workload") or {}))
            faults = tuple(_fault(f) for f in data.get("faults") or [])
            window = Window(**(data.get("window") or {}))
            baseline = Window(**data["baseline"]) if data.get("baseline") else None
            sc = cls(
                job=str(data.get("job", "demo-job")),
                seed=int(data.get("seed", 7)),
                topology=topo,
                workload=workload,
                faults=faults,
                window=window,
                baseline=baseline,
                hardware_hz=float(data.get("hardware_hz", 100.0)),
                hardware=str(data.get("hardware", "nvml")),
                tenant=str(data.get("tenant", "")),
                name=str(data.get("name", default_name)),
                group=str(data.get("group", "")),
            )
            sc.check()
            return sc
        except (TopologyError, FaultError) as exc:
            raise ScenarioError(f"{where}: {exc}") from None
        except (TypeError, KeyError, ValueError) as exc:
            raise ScenarioError(f"{where}: bad value ({exc})") from None

    def check(self) -> None:
        """Cross-field checks; raises FaultError / ValueError."""
        if self.workload.layers_per_stage < 1 or self.workload.microbatches < 0:
            raise ValueError("workload.layers_per_stage must be >= 1 and microbatches >= 0")
        if self.window.steps < 1 or self.window.start_step < 0 or not 0 < self.hardware_hz <= 10_000:
            raise ValueError("window needs steps >= 1 and start_step >= 0; hardware_hz in (0, 10000]")
        if self.hardware not in SAMPLED:
            raise ValueError(f"hardware must be one of {', '.join(SAMPLED)}, got {self.hardware!r}")
        for f in self.faults:
            f.targets(self.topology)  # raises on targets outside the topology
        if self.baseline and any(
            f.start_step < self.baseline.start_step + self.baseline.steps for f in self.faults if f.type == "regression"
        ):
            raise ValueError("a regression must start after the baseline window")

    def to_dict(self) -> dict:
        out: dict = {"name": self.name, "job": self.job, "seed": self.seed}
        if self.group:
            out["group"] = self.group
        out["topology"] = {k: getattr(self.topology, k) for k in self.topology.__dataclass_fields__}
        wl = _nondefault(self.workload, Workload())
        if wl:
            out["workload"] = wl
        out["window"] = {"start_step": self.window.start_step, "steps": self.window.steps}
        if self.baseline:
            out["baseline"] = {"start_step": self.baseline.start_step, "steps": self.baseline.steps}
        if self.hardware_hz != 100.0:
            out["hardware_hz"] = self.hardware_hz
        if self.hardware != "nvml":
            out["hardware"] = self.hardware
        if self.tenant:
            out["tenant"] = self.tenant
        out["faults"] = [f.to_dict() for f in self.faults]
        return out

    def truths(self) -> list[Truth]:
        return [f.truth(self.topology, self.hardware) for f in self.faults]


def _nondefault(obj, default) -> dict:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__ if getattr(obj, k) != getattr(default, k)}


def _fault(f: object) -> Fault:
    if not isinstance(f, dict):
        raise ValueError("each fault must be a mapping with a type")
    return Fault(
        type=f["type"],
        workers=tuple(int(x) for x in f.get("workers", ())),
        hosts=tuple(int(x) for x in f.get("hosts", ())),
        nics=tuple(str(x) for x in f.get("nics", ())),
        switches=tuple(str(x) for x in f.get("switches", ())),
        stage=None if f.get("stage") is None else int(f["stage"]),
        function=str(f.get("function", "")),
        severity=float(f.get("severity", 0.3)),
        start_step=int(f.get("start_step", 0)),
    )


class FleetSimulator:
    """Steps a simulated job and renders its heartbeats and feature batches.

    The same seed gives the same records: one RNG stream per (seed, step), so the
    records of a step do not depend on which steps were simulated before it.
    """

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.topology = scenario.topology
        self.meta: list[WorkerMeta] = self.topology.meta()
        self.static = Static.draw(self.topology, scenario.workload, scenario.seed)
        self._ranks = np.array([m.rank for m in self.meta], dtype=np.int64)
        self._hosts = (
            np.unique([m.host for m in self.meta], return_inverse=True)[1].reshape(-1)
            if self.meta
            else np.zeros(0, dtype=np.int64)
        )

    def step(
        self,
        step: int,
        faults: tuple[Fault, ...] | None = None,
        readings: bool = True,
        hardware_hz: float | None = None,
    ) -> SimulatedStep:
        """Simulate one step; ``faults`` overrides the scenario's (re-simulation without a fault),
        ``readings=False`` skips the hardware readings (the times stay the same), ``hardware_hz`` the scenario's
        sampling rate (a live window's trigger asks for its own)."""
        sc = self.scenario
        fx = effects(self.topology, sc.faults if faults is None else faults, step, sc.workload.layers_per_stage)
        hz = sc.hardware_hz if hardware_hz is None else hardware_hz
        return simulate_step(
            self.topology, sc.workload, self.static, step, step_rng(sc.seed, step), fx, hz, readings, sc.hardware
        )

    def saving(self, index: int, steps: range | list[int]) -> float:
        """The share of the synchronised step time that removing fault ``index`` saves over ``steps``
        (mean over steps), measured by re-simulating the same steps without it: the true impact."""
        others = tuple(f for i, f in enumerate(self.scenario.faults) if i != index)
        with_fault = np.array([self.step(s, readings=False).sync_step_us for s in steps])
        without = np.array([self.step(s, others, readings=False).sync_step_us for s in steps])
        return float(np.mean((with_fault - without) / with_fault))

    def trigger(self, window: Window | None = None, *, created_at: float = 0.0) -> ProfileTrigger:
        """The profiling trigger of a window of this scenario (the scenario's own window by default)."""
        w = window or self.scenario.window
        return ProfileTrigger(
            job=self.scenario.job,
            window=w.name,
            start_step=w.start_step,
            steps=w.steps,
            expected_workers=self.topology.workers,
            sampling=Sampling(hardware_hz=self.scenario.hardware_hz),
            reason="simulated",
            created_at=created_at,
            tenant=self.scenario.tenant,
        )

    def heartbeats(self, sim: SimulatedStep, sent_at: float | None = None) -> list[StepHeartbeat]:
        """One heartbeat per live worker; ``sent_at`` on each host's own (possibly skewed) clock."""
        now = time.time() if sent_at is None else sent_at
        job, tenant = self.scenario.job, self.scenario.tenant
        return [
            StepHeartbeat(
                job=job,
                worker=m.rank,
                step=sim.step,
                step_time_s=float(sim.step_time_us[i]) / 1e6,
                host=m.host,
                sent_at=now + float(sim.clock_offset_s[i]),
                tenant=tenant,
            )
            for i, m in enumerate(self.meta)
            if not sim.missing[i]
        ]

    def heartbeat_batches(
        self,
        sim: SimulatedStep,
        sent_at: float | None = None,
        shard_workers: int = SHARD_WORKERS,
        echo: tuple[str, float] | None = None,
        final: bool = False,
    ) -> list[HeartbeatBatch]:
        """The live workers' heartbeats of one step as hosts with a relay send them: one ``HeartbeatBatch`` per host
        and shard (``worker // shard_workers``), ``sent_at`` on each host's own clock; ``echo`` (window, latency):
        every worker echoes the trigger it received; ``final``: every row is its worker's last heartbeat (the job
        ends, as agents say when they close)."""
        now = time.time() if sent_at is None else sent_at
        live = np.flatnonzero(~sim.missing)
        ranks, hosts = self._ranks[live], self._hosts[live]
        group = hosts.astype(np.int64) * (int(ranks.max(initial=0)) // shard_workers + 1) + ranks // shard_workers
        cuts = np.flatnonzero(np.diff(group)) + 1
        times, sent = (sim.step_time_us[live] / 1e6).tolist(), (now + sim.clock_offset_s[live]).tolist()
        out = []
        for lo, hi in zip(np.r_[0, cuts].tolist(), np.r_[cuts, live.size].tolist()):
            workers = ranks[lo:hi].tolist()
            out.append(
                HeartbeatBatch(
                    job=self.scenario.job,
                    tenant=self.scenario.tenant,
                    shard=workers[0] // shard_workers,
                    shard_workers=shard_workers,
                    host=self.meta[int(live[lo])].host,
                    worker=workers,
                    step=[sim.step] * len(workers),
                    step_time_s=times[lo:hi],
                    sent_at=sent[lo:hi],
                    echoes=[Echo(worker=w, window=echo[0], latency_s=echo[1]) for w in workers] if echo else [],
                    final=list(range(len(workers))) if final else [],
                )
            )
        return out

    def table(self, sim: SimulatedStep) -> tuple[pa.Table, np.ndarray]:
        """Every live worker's function table of one step as one Arrow table, and the worker of each row.

        Rows are grouped by worker (ascending) in catalogue order; the table conforms to
        :data:`lockstep.schemas.functions.SCHEMA`.
        """
        keep = sim.present & ~sim.missing[:, None]
        w_idx, f_idx = np.nonzero(keep)
        calls = sim.calls[keep]
        total = sim.total_us[keep]
        mean = total / np.maximum(calls, 1)
        spread = np.where(np.isin(KIND[f_idx], ("collective", "p2p")), 0.5, 0.1)
        cols: dict[str, object] = {
            "function": NAMES[f_idx],
            "kind": KIND[f_idx],
            "resource": sim.resource[keep],
            "calls": calls,
            "total_us": total,
            "critical_us": sim.critical_us[keep],
            "wait_us": sim.wait_us[keep],
            "first_start_us": sim.first_start_us[keep],
            "mean_us": mean,
            "p50_us": mean * (1.0 - spread / 10),
            "p95_us": mean * (1.0 + spread),
            "max_us": mean * (1.0 + 2 * spread),
            "bytes": sim.bytes[keep],
            "samples": sim.samples[keep],
            "clock_events": sim.clock_events[keep],
        }
        for name, arr in sim.hw.items():
            cols[name] = arr[keep]
        return ft.make_table(cols), w_idx

    def feature_batches(
        self, sim: SimulatedStep, trigger: ProfileTrigger, sent_at: float | None = None
    ) -> list[FeatureBatch]:
        """One feature batch per live worker, as its agent would publish it."""
        now = time.time() if sent_at is None else sent_at
        table, row_worker = self.table(sim)
        counts = np.bincount(row_worker, minlength=self.topology.workers)
        offsets = np.cumsum(counts) - counts
        return [
            FeatureBatch(
                job=self.scenario.job,
                window=trigger.window,
                step=sim.step,
                window_start=trigger.start_step,
                window_steps=trigger.steps,
                expected_workers=trigger.expected_workers,
                worker=m,
                step_time_us=float(sim.step_time_us[i]),
                functions=ft.pack(table.slice(int(offsets[i]), int(counts[i]))),
                hardware=self.scenario.hardware,  # type: ignore[arg-type]
                policy=trigger.policy_ref,
                sent_at=now + float(sim.clock_offset_s[i]),
                tenant=self.scenario.tenant,
            )
            for i, m in enumerate(self.meta)
            if not sim.missing[i]
        ]

    def window_features(
        self, sims: list[SimulatedStep], trigger: ProfileTrigger, sent_at: float | None = None
    ) -> list[WindowFeatures]:
        """One record per worker with the window's steps ``sims`` (those it was live in), as its agent publishes it
        when the window ends."""
        now = time.time() if sent_at is None else sent_at
        n = self.topology.workers
        parts, owners = [], []
        for sim in sims:
            table, row_worker = self.table(sim)
            parts.append(ft.window_table(np.full(1, sim.step), [table]))
            owners.append(row_worker)
        owner = np.concatenate(owners)
        order = np.argsort(owner, kind="stable")  # by worker, then step
        t = pa.concat_tables(parts).take(pa.array(order)).combine_chunks()
        counts = np.bincount(owner, minlength=n)
        offsets = np.cumsum(counts) - counts
        live = np.stack([~sim.missing for sim in sims])  # (steps, workers)
        step_of = np.array([sim.step for sim in sims])
        step_time = np.stack([sim.step_time_us for sim in sims])
        sw = trigger.shard_workers
        return [
            WindowFeatures(
                job=self.scenario.job,
                window=trigger.window,
                window_start=trigger.start_step,
                window_steps=trigger.steps,
                expected_workers=trigger.expected_workers,
                shard=m.rank // sw,
                shard_workers=sw,
                worker=m,
                steps=step_of[live[:, i]].tolist(),
                step_time_us=step_time[live[:, i], i].tolist(),
                functions=ft.pack_window(t.slice(int(offsets[i]), int(counts[i]))),
                hardware=self.scenario.hardware,  # type: ignore[arg-type]
                policy=trigger.policy_ref,
                sent_at=now + float(sims[-1].clock_offset_s[i]),
                tenant=self.scenario.tenant,
            )
            for i, m in enumerate(self.meta)
            if live[:, i].any()
        ]
