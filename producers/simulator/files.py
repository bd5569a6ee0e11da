"""``lockstep simulate SCENARIO --out DIR``: a scenario's records as Parquet files, and its ground truth.

Files (every timestamp is *simulated* time: the same scenario writes the same bytes):

``heartbeats.parquet``  one row per ``StepHeartbeat`` (every step from 0 to the window's end)
``features.parquet``    one row per (step, worker, function) of every profiling window: the
                        ``FeatureBatch`` fields (worker metadata flattened, ``labels`` a map) and
                        the columns of its function table (``lockstep.schemas.functions``)
``triggers.parquet``    one row per ``ProfileTrigger`` (the baseline window, if any, and the window)

As in the DuckDB findings store, the records' ``window`` field is the column ``window_id``
(``window`` is reserved in SQL).
``truth.json``          the scenario, and per fault what a perfect diagnosis says
                        (``Truth``: cause, scope, workers, devices, functions, impact)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...schemas.records import to_builtins
from .fleet import FleetSimulator, Scenario

EPOCH = 1_700_000_000.0  # simulated wall clock of step 0 (unix seconds)
TAIL_STEPS = 2  # heartbeats after the window's last step


@dataclass
class Written:
    heartbeats: int
    feature_rows: int
    feature_batches: int
    windows: list[str]
    folder: Path


def write_records(scenario: Scenario, folder: Path, progress=None) -> Written:
    """``progress(step, last)`` hears every simulated step (the CLI's progress bar)."""
    folder.mkdir(parents=True, exist_ok=True)
    fleet = FleetSimulator(scenario)
    topo = fleet.topology
    windows = [w for w in (scenario.baseline, scenario.window) if w is not None]
    profiled = {s: w for w in windows for s in w.range}
    last = max(w.start_step + w.steps for w in windows) + TAIL_STEPS
    meta = fleet.meta
    ranks = np.array([m.rank for m in meta], dtype=np.int64)
    hosts = np.array([m.host for m in meta], dtype=object)
    labels = pa.array([sorted(m.labels.items()) for m in meta], type=pa.map_(pa.string(), pa.string()))
    worker_cols = {
        "worker": pa.array(ranks),
        "host": pa.array(hosts, type=pa.string()),
        "device": pa.array([m.device for m in meta], type=pa.string()),
        "local_rank": pa.array([m.local_rank for m in meta], type=pa.int64()),
        "nic": pa.array([m.nic for m in meta], type=pa.string()),
        "switch": pa.array([m.switch for m in meta], type=pa.string()),
        "labels": labels,
    }
    heartbeats, features, triggers = [], [], []
    batches = 0
    clock = EPOCH
    for step in range(last):
        if progress:
            progress(step, last)
        sim = fleet.step(step, readings=step in profiled)
        clock += sim.sync_step_us / 1e6
        for w in windows:
            if step == w.start_step - 2:  # the detector asks two steps ahead
                trig = to_builtins(fleet.trigger(w, created_at=round(clock, 6)))
                triggers.append({("window_id" if k == "window" else k): v for k, v in trig.items()})
        live = np.flatnonzero(~sim.missing)
        sent = np.round(clock + sim.clock_offset_s[live], 6)
        heartbeats.append(
            pa.table(
                {
                    "job": pa.array([scenario.job] * live.size, type=pa.string()),
                    "worker": pa.array(ranks[live]),
                    "step": pa.array(np.full(live.size, step)),
                    "step_time_s": pa.array(sim.step_time_us[live] / 1e6),
                    "host": pa.array(hosts[live], type=pa.string()),
                    "sent_at": pa.array(sent),
                    "tenant": pa.array([scenario.tenant] * live.size, type=pa.string()),
                }
            )
        )
        if step in profiled:
            w = profiled[step]
            table, row_worker = fleet.table(sim)
            n = table.num_rows
            batches += live.size
            head = {
                "job": pa.array([scenario.job] * n, type=pa.string()),
                "window_id": pa.array([w.name] * n, type=pa.string()),
                "step": pa.array(np.full(n, step)),
                "window_start": pa.array(np.full(n, w.start_step)),
                "window_steps": pa.array(np.full(n, w.steps)),
                "expected_workers": pa.array(np.full(n, topo.workers)),
                **{k: v.take(pa.array(row_worker)) for k, v in worker_cols.items()},
                "step_time_us": pa.array(sim.step_time_us[row_worker]),
                "hardware": pa.array([scenario.hardware] * n, type=pa.string()),
                "sent_at": pa.array(np.round(clock + sim.clock_offset_s[row_worker], 6)),
                "tenant": pa.array([scenario.tenant] * n, type=pa.string()),
            }
            features.append(pa.table({**head, **{c: table[c] for c in table.column_names}}))
    hb = pa.concat_tables(heartbeats)
    ft_table = pa.concat_tables(features)
    pq.write_table(hb, folder / "heartbeats.parquet", compression="zstd")
    pq.write_table(ft_table, folder / "features.parquet", compression="zstd")
    pq.write_table(pa.Table.from_pylist(triggers), folder / "triggers.parquet", compression="zstd")
    truths = scenario.truths()
    for i, t in enumerate(truths):
        if t.cause is not None:
            t.impact = round(fleet.saving(i, scenario.window.range), 6)
    truth = {
        "scenario": scenario.to_dict(),
        "category": scenario.category,
        "window": scenario.window.name,
        "baseline": scenario.baseline.name if scenario.baseline else None,
        "faults": [{**t.to_dict(), "impact": None if t.cause is None else t.impact} for t in truths],
    }
    (folder / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    return Written(hb.num_rows, ft_table.num_rows, batches, [w.name for w in windows], folder)
