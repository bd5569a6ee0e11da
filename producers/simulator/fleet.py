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
from ...schemas.records import FeatureBatch, ProfileTrigger, StepHeartbeat, WorkerMeta
from .faults import Fault, FaultError, effects
from .model import FUNCTIONS, SimulatedStep, simulate_step
from .topology import Topology, TopologyError


class ScenarioError(ValueError):
    """A scenario file is malformed."""


@dataclass(frozen=True)
class Scenario:
    job: str = "demo-job"
    seed: int = 7
    topology: Topology = field(default_factory=Topology)
    faults: tuple[Fault, ...] = ()
    tenant: str = ""

    @classmethod
    def load(cls, path: Path | str) -> Scenario:
        path = Path(path)
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except OSError as exc:
            raise ScenarioError(f"scenario {path}: {exc.strerror}") from None
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ScenarioError(f"scenario {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({str(exc).splitlines()[0]})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, where: str = "scenario") -> Scenario:
        if not isinstance(data, dict):
            raise ScenarioError(f"{where}: expected a mapping")
        try:
            topo = Topology(**(data.get("topology") or {}))
            faults = tuple(
                Fault(
                    type=f["type"],
                    workers=tuple(f.get("workers", ())),
                    hosts=tuple(f.get("hosts", ())),
                    severity=float(f.get("severity", 0.3)),
                    start_step=int(f.get("start_step", 0)),
                )
                for f in data.get("faults") or []
            )
            return cls(job=str(data.get("job", "demo-job")), seed=int(data.get("seed", 7)), topology=topo, faults=faults, tenant=str(data.get("tenant", "")))
        except (TopologyError, FaultError) as exc:
            raise ScenarioError(f"{where}: {exc}") from None
        except (TypeError, KeyError, ValueError) as exc:
            raise ScenarioError(f"{where}: bad value ({exc})") from None


class FleetSimulator:
    """Steps a simulated job and renders its heartbeats and feature batches.

    The same seed gives the same records: one RNG stream per step, derived from
    (seed, step), so the records of a step do not depend on which steps were
    simulated before it.
    """

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.topology = scenario.topology
        self.meta: list[WorkerMeta] = self.topology.meta()
        self._fn = pa.array([f.name for f in FUNCTIONS])
        self._kind = pa.array([f.kind for f in FUNCTIONS])
        self._res = pa.array([f.resource for f in FUNCTIONS])

    def step(self, step: int) -> SimulatedStep:
        rng = np.random.default_rng([self.scenario.seed, step])
        fx = effects(self.topology, list(self.scenario.faults), step)
        return simulate_step(self.topology, step, rng, fx)

    def heartbeats(self, sim: SimulatedStep, sent_at: float | None = None) -> list[StepHeartbeat]:
        now = time.time() if sent_at is None else sent_at
        job, tenant = self.scenario.job, self.scenario.tenant
        return [
            StepHeartbeat(job=job, worker=m.rank, step=sim.step, step_time_s=float(st) / 1e6, host=m.host, sent_at=now, tenant=tenant)
            for m, st in zip(self.meta, sim.step_time_us)
        ]

    def function_table(self, sim: SimulatedStep, worker: int) -> pa.Table:
        cols: dict[str, object] = {
            "function": self._fn,
            "kind": self._kind,
            "resource": self._res,
            "calls": sim.calls[worker],
            "total_us": sim.total_us[worker],
            "critical_us": sim.critical_us[worker],
            "wait_us": sim.wait_us[worker],
            "first_start_us": sim.first_start_us[worker],
            "mean_us": sim.total_us[worker] / sim.calls[worker],
            "p50_us": sim.total_us[worker] / sim.calls[worker],
            "p95_us": sim.total_us[worker] / sim.calls[worker] * 1.1,
            "max_us": sim.total_us[worker] / sim.calls[worker] * 1.2,
            "bytes": sim.bytes[worker],
            "samples": np.maximum(1, (sim.total_us[worker] / 10_000).astype(np.int32)),
            "clock_events": sim.clock_events[worker],
        }
        for name, arr in sim.hw.items():
            cols[name] = arr[worker]
        return ft.make_table(cols)

    def feature_batches(self, sim: SimulatedStep, trigger: ProfileTrigger, sent_at: float | None = None) -> list[FeatureBatch]:
        now = time.time() if sent_at is None else sent_at
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
                functions=ft.pack(self.function_table(sim, i)),
                hardware="nvml",
                policy=trigger.policy_ref,
                sent_at=now,
                tenant=self.scenario.tenant,
            )
            for i, m in enumerate(self.meta)
        ]
