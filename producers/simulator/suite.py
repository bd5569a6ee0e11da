"""The standard evaluation suite: scenarios across every fault type, job sizes from 2 to 4,096 workers.

Generated, not hand-written, so that it is reproducible and balanced: 12
scenarios per category (each fault type of the catalogue, two simultaneous
faults, healthy jobs, small jobs of 2 and 3 workers, and jobs whose samplers
see only the host or nothing), each with its own seed, topology (data, tensor
and pipeline parallelism, mixture-of-experts), hardware sampling rate (the
rates a window's sampler runs at: 1 to 10 kHz), culprits and a severity in a
range where the fault costs the job something real.  The repository keeps the
files (``suites/standard/*.yaml``); a test checks that they are exactly what
this module generates.  Regenerate with::

    python -m lockstep.producers.simulator.suite suites/standard

and write a held-out suite (same shape, other seeds) with ``--seed N FOLDER``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from .faults import CATALOGUE, FAULT_TYPES, Fault
from .fleet import FleetSimulator, Scenario, Window
from .model import Workload
from .topology import Topology

PER_CATEGORY = 12
CATEGORIES = FAULT_TYPES + ("two_faults", "healthy", "small_job", "no_samples")
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WINDOW = Window(start_step=60, steps=8)
BASELINE = Window(start_step=20, steps=8)
MIN_IMPACT = 0.01  # every single fault costs the job at least this share of the step

#: severity ranges: large enough to cost the job, small enough to be realistic
SEVERITY = {
    "gpu_throttle_thermal": (0.15, 0.5),
    "gpu_throttle_power": (0.15, 0.5),
    "gpu_slow": (0.1, 0.4),
    "nvlink": (1.0, 4.0),
    "pcie": (0.2, 0.8),
    "nic": (1.0, 4.0),
    "switch": (1.0, 4.0),
    "host_cpu_contention": (0.1, 0.5),
    "host_memory": (0.1, 0.5),
    "storage": (0.1, 0.5),
    "dataloader": (0.1, 0.5),
    "input_imbalance": (0.15, 0.4),
    "pipeline_imbalance": (0.2, 0.5),
    "rank_specific_code": (0.05, 0.2),
    "regression": (0.2, 0.5),  # doubled for a collective (a communication-library setting)
    "clock_skew": (0.01, 5.0),
    "missing_worker": (1.0, 1.0),
}
#: fault pairs of the two_faults category (different hosts)
PAIRS = (
    ("gpu_throttle_thermal", "nic"),
    ("gpu_slow", "host_cpu_contention"),
    ("pcie", "storage"),
    ("dataloader", "gpu_throttle_power"),
    ("gpu_throttle_thermal", "gpu_slow"),
    ("input_imbalance", "host_memory"),
    ("rank_specific_code", "gpu_throttle_thermal"),
    ("nvlink", "dataloader"),
)
REGRESSED = ("fwd.attention", "bwd.gemm", "optimizer.step", "nccl:all_reduce[dp]")
#: samples per second of a window's sampler (each scenario draws one)
RATES = (1000.0, 1000.0, 1000.0, 2000.0, 10000.0)
#: jobs of 2 and 3 workers, one per host (a z-score needs more peers): the fault of each, None for a healthy one
SMALL_JOBS = (
    "gpu_slow",
    "dataloader",
    "nic",
    "gpu_throttle_thermal",
    "rank_specific_code",
    "host_cpu_contention",
    "input_imbalance",
    None,
    "storage",
    "pcie",
    "nic",
    None,
)
#: (fault, what the samplers see): without the samples that decide, the expected cause is ``undetermined``
WITHOUT_SAMPLES = (
    ("gpu_throttle_thermal", "none"),
    ("dataloader", "host"),
    ("gpu_slow", "none"),
    ("host_cpu_contention", "host"),
    ("rank_specific_code", "none"),
    ("nic", "host"),
    ("pcie", "none"),
    ("gpu_throttle_power", "host"),
    ("dataloader", "none"),
    ("rank_specific_code", "host"),
    ("host_cpu_contention", "none"),
    ("input_imbalance", "none"),
)


def _topology(rng: np.random.Generator, category: str, workers: int) -> tuple[Topology, Workload]:
    """A parallel layout that fits the job size and lets the fault be localised."""
    hosts = workers // 8
    options = [(1, 1), (1, 2), (1, 8)]
    if hosts >= 8:
        options += [(4, 1), (2, 4)]
    if hosts >= 32:
        options += [(4, 8), (8, 8), (8, 4)]
    if category == "pipeline_imbalance":
        options = [(pp, tp) for pp, tp in options if pp >= 4] or [(4, 1)]
    elif category == "nvlink":
        options = [(pp, tp) for pp, tp in options if tp >= 2]
    elif category in ("host_cpu_contention", "host_memory", "storage", "two_faults"):
        # the culprit host must be a minority of its pipeline stage
        options = [(pp, tp) for pp, tp in options if hosts // pp >= 4] or [(1, 1)]
    pp, tp = options[int(rng.integers(len(options)))]
    # several switches, so that one of them is a minority
    per_switch = 4 if hosts >= 16 else 2 if hosts >= 8 else 1
    moe = bool(rng.random() < 0.2) and category != "input_imbalance"
    return Topology(
        workers=workers, gpus_per_host=8, nics_per_host=2, hosts_per_switch=per_switch, pp=pp, tp=tp
    ), Workload(moe=moe)


def _fault(rng: np.random.Generator, kind: str, topo: Topology, avoid_hosts: set[int], start: int) -> Fault:
    lo, hi = SEVERITY[kind]
    severity = round(float(rng.uniform(lo, hi)), 3)
    hosts = [h for h in range(topo.hosts) if h not in avoid_hosts]
    host = int(rng.choice(hosts))
    worker = host * topo.gpus_per_host + int(rng.integers(topo.gpus_per_host))
    target = CATALOGUE[kind].target
    if target == "workers":
        return Fault(type=kind, workers=(worker,), severity=severity, start_step=start)
    if target == "hosts":
        return Fault(type=kind, hosts=(host,), severity=severity, start_step=start)
    if target == "nics":
        return Fault(
            type=kind,
            nics=(topo.nic_name(host * topo.nics_per_host + int(rng.integers(topo.nics_per_host))),),
            severity=severity,
            start_step=start,
        )
    if target == "switches":
        return Fault(
            type=kind,
            switches=(topo.switch_name(int(rng.integers(topo.switches))),),
            severity=severity,
            start_step=start,
        )
    if target == "stage":
        return Fault(type=kind, stage=int(rng.integers(topo.pp)), severity=severity, start_step=start)
    function = str(rng.choice([f for f in REGRESSED if f != "nccl:all_reduce[dp]" or topo.dp > 1]))
    severity = severity * (2 if function.startswith("nccl:") else 1)
    return Fault(
        type=kind, function=function, severity=severity, start_step=max(start, BASELINE.start_step + BASELINE.steps)
    )


def _sizes(category: str) -> list[int]:
    """Job sizes of a category's scenarios: every size, the big ones less often (they cost the most time)."""
    if category == "small_job":
        return [2, 3] * (PER_CATEGORY // 2)
    if category == "no_samples":  # each fault's own sizes, in turn
        return [_sizes(kind)[i] for i, (kind, _) in enumerate(WITHOUT_SAMPLES)]
    small = [s for s in SIZES if s >= {"switch": 64, "pipeline_imbalance": 256, "two_faults": 32}.get(category, 16)]
    if category in ("host_cpu_contention", "host_memory", "storage"):
        small = [s for s in small if s >= 32]
    out = (small * 3)[:PER_CATEGORY]
    return sorted(out)


#: the standard suite's seed; another seed gives a held-out suite of the same shape (other jobs, culprits, severities)
STANDARD_SEED = 2024


def standard_suite(seed: int = STANDARD_SEED) -> list[Scenario]:
    scenarios = []
    for c_index, category in enumerate(CATEGORIES):
        rng = np.random.default_rng([seed, c_index])
        for i, workers in enumerate(_sizes(category)):
            hardware, group, kind = "nvml", "", category
            if category == "small_job":
                kind, group = SMALL_JOBS[i] or "healthy", category
                topo, workload = (
                    Topology(workers=workers, gpus_per_host=1, nics_per_host=1, hosts_per_switch=4),
                    Workload(),
                )
            else:
                if category == "no_samples":
                    (kind, hardware), group = WITHOUT_SAMPLES[i], category
                topo, workload = _topology(rng, kind, workers)
            start = int(rng.choice([0, 30, 45, WINDOW.start_step, WINDOW.start_step + 2]))
            if kind == "healthy":
                faults: tuple[Fault, ...] = ()
            elif kind == "two_faults":
                a, b = PAIRS[i % len(PAIRS)]
                first = _fault(rng, a, topo, set(), start)
                used = {int(h) for h in topo.arrays["host"][first.targets(topo)]}
                faults = (first, _fault(rng, b, topo, used, start))
            else:
                faults = (_fault(rng, kind, topo, set(), start),)
            hz = float(rng.choice(RATES))
            name = f"{category}-{i:02d}-{workers}w"
            sc = Scenario(
                job=name,
                seed=int(rng.integers(1 << 31)),
                topology=topo,
                workload=workload,
                faults=faults,
                window=WINDOW,
                baseline=BASELINE,
                hardware_hz=hz,
                hardware=hardware,
                name=name,
                group=group,
            )
            scenarios.append(_costly(sc) if len(faults) == 1 and faults[0].kind.cause else sc)
    return scenarios


def _costly(sc: Scenario) -> Scenario:
    """Raise the severity until removing the fault saves at least MIN_IMPACT of the step.

    Below that, the job's natural spread (the slowest of many workers sets the pace) hides
    the fault: a scenario should test finding a fault that costs something.
    """
    f = sc.faults[0]
    steps = [WINDOW.start_step + 3, WINDOW.start_step + 5]  # after every start step the suite uses
    while FleetSimulator(sc).saving(0, steps) < MIN_IMPACT and f.severity < 6.0:
        f = replace(f, severity=round(f.severity * 1.5, 3))
        sc = replace(sc, faults=(f,))
    return sc


def render(scenario: Scenario) -> str:
    """The scenario file's text."""
    head = f"# {scenario.category}: generated by `python -m lockstep.producers.simulator.suite`; do not edit by hand\n"
    return head + yaml.safe_dump(scenario.to_dict(), sort_keys=False, default_flow_style=None, width=120)


def write_suite(folder: Path, seed: int = STANDARD_SEED) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    suite = standard_suite(seed)
    names = {f"{s.name}.yaml" for s in suite}
    for stale in folder.glob("*.yaml"):
        if stale.name not in names:
            stale.unlink()
    for s in suite:
        (folder / f"{s.name}.yaml").write_text(render(s))
    return len(suite)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lockstep.producers.simulator.suite", description="write the evaluation suite's scenario files"
    )
    p.add_argument(
        "folder",
        type=Path,
        nargs="?",
        default=Path("suites/standard"),
        help="where to write them (default: suites/standard)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=STANDARD_SEED,
        help=f"another seed gives a held-out suite of the same shape (default: {STANDARD_SEED}, the standard suite)",
    )
    args = p.parse_args(argv)
    print(f"wrote {write_suite(args.folder, args.seed)} scenarios to {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
