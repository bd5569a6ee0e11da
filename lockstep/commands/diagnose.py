"""``lockstep diagnose FILES...``: the stream processor's diagnosis, offline, on files.

Inputs (any mix):

1. PyTorch profiler Chrome traces, one file per worker (``.json`` / ``.json.gz``),
   as ``torch.profiler`` writes them; CPU-only traces included.
2. Op-event tables (``.parquet`` / ``.csv``), one row per executed function:
   ``worker, step, function, kind, start_us, duration_us``, optional ``host``,
   ``device`` and label columns (peer-group keys: ``--peer-group COL``).
3. ``--samples FILE``: a hardware-sample table ``worker, t_us, metric, value``.

Every worker's events go through the host-side summariser, every step through
the step stage, the whole set through the window stage: the same code the
processor runs, so the same findings.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import config

if TYPE_CHECKING:
    from ..producers.agent.summarise import StepSummary
    from ..schemas.records import WorkerMeta

TRACE_SUFFIXES = (".json", ".gz")
TABLE_SUFFIXES = (".parquet", ".pq", ".csv")


class DiagnoseError(ValueError):
    """An input file is unreadable or breaks its contract; the message names the file."""


def register(sub) -> None:
    p = sub.add_parser("diagnose", help="diagnose profiler traces or op-event tables offline (the processor's engine)")
    p.add_argument("files", nargs="+", type=Path, metavar="FILES",
                   help="Chrome traces, one per worker (.json, .json.gz), and/or op-event tables (.parquet, .csv)")  # fmt: skip
    p.add_argument("--peer-group", action="append", default=[], metavar="COL",
                   help="label column of the op-event tables that defines peer groups (repeatable); "
                        "default: the policy's peer_group_keys that exist as columns")  # fmt: skip
    p.add_argument("--samples", type=Path, default=None, help="hardware-sample table (.parquet, .csv): worker, t_us, metric, value")
    config.add_arguments(p, ["policy"], only=True)
    p.add_argument("--job", default="offline", help="job name the findings carry (default: offline)")
    p.add_argument("--json", action="store_true", help="print the Finding records as a JSON list")
    p.set_defaults(func=run)


@dataclass
class Inputs:
    """Every worker's step summaries and metadata, read from the files."""

    workers: dict[int, WorkerMeta] = field(default_factory=dict)
    hardware: dict[int, str] = field(default_factory=dict)  # "host" where hardware samples came with it, else "none"
    summaries: list[StepSummary] = field(default_factory=list)
    files: int = 0


def run(args) -> int:
    from ..output import findings_table, plural, print_json
    from ..progress import Progress, wanted
    from ..schemas.records import to_builtins
    from ..streams.policy import load_policy

    policy = load_policy(config.load(args).policy)
    with Progress(wanted(args.json), "reading", total=len(args.files), unit="file") as bar:
        inputs = load_inputs(args.files, args.peer_group or None, args.samples, policy.diagnosis.peer_group_keys, progress=lambda _: bar.update())
    labels = sorted({k for w in inputs.workers.values() for k in w.labels})
    missing = [k for k in args.peer_group if k not in labels]
    if missing:
        raise DiagnoseError(f"--peer-group: no worker has the label {', '.join(missing)} (labels: {', '.join(labels) or 'none'}; "
                            "Chrome traces carry none: peer groups need label columns of op-event tables)")  # fmt: skip
    keys = tuple(args.peer_group) or tuple(k for k in policy.diagnosis.peer_group_keys if any(k in w.labels for w in inputs.workers.values()))
    policy = dataclasses.replace(policy, diagnosis=dataclasses.replace(policy.diagnosis, peer_group_keys=keys))
    d = diagnose(inputs, policy, args.job, now=time.time())
    found = [to_builtins(f) for f in d.findings]
    if args.json:
        print_json(found)
        return 0
    print(findings_table(found))
    r = d.report
    steps = sorted({s.step for s in inputs.summaries})
    print(f"\n{r.workers_seen} workers x {r.steps_seen} steps ({steps[0]}..{steps[-1]}) from {plural(inputs.files, 'file')}; "
          f"coverage {r.coverage:.0%}; peer groups by {', '.join(keys) or 'nothing (one group)'}")  # fmt: skip
    return 0


def diagnose(inputs: Inputs, policy, job: str, *, now: float):
    """Step stage for every step, then the window stage, exactly as in the processor."""
    from ..streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window

    by_step: dict[int, list] = {}
    for s in inputs.summaries:
        by_step.setdefault(s.step, []).append(s)
    steps = sorted(by_step)
    window = f"steps{steps[0]}-{steps[-1]}"
    results = []
    for step in steps:
        ss = sorted(by_step[step], key=lambda s: s.worker)
        frame = StepFrame.from_tables(
            job, window, step, [inputs.workers[s.worker] for s in ss], [s.step_time_us for s in ss], [s.functions for s in ss],
            policy.diagnosis.peer_group_keys, [inputs.hardware.get(s.worker, "none") for s in ss],
        )  # fmt: skip
        results.append(analyze_step(frame, policy.diagnosis))
    info = WindowInfo(job=job, window=window, start_step=steps[0], steps=len(steps), expected_workers=len(inputs.workers))
    return diagnose_window(info, results, policy, now=now)


# --------------------------------------------------------------------------- files


def load_inputs(files: list[Path], peer_cols: list[str] | None, samples_path: Path | None, policy_keys: tuple[str, ...] = (),
                progress=None) -> Inputs:  # fmt: skip
    from ..producers.agent.summarise import SummaryError, summarise
    from ..producers.agent.trace import TraceError, read_chrome_trace
    from ..schemas.records import WorkerMeta

    samples = _read_table(samples_path) if samples_path else None
    sampled: set[int] = set()
    if samples is not None:
        if "worker" not in samples.column_names:
            raise DiagnoseError(f"{samples_path}: sample table lacks column worker; needs worker, t_us, metric, value")
        sampled = set(pc.unique(samples.column("worker")).to_pylist())
    inputs = Inputs(files=len(files))
    owner: dict[int, Path] = {}

    def add(path: Path, metas: dict[int, WorkerMeta], summaries: list) -> None:
        for rank, meta in metas.items():
            if rank in owner:
                raise DiagnoseError(f"{path}: worker {rank} is also in {owner[rank]}")
            owner[rank] = path
            inputs.workers[rank] = meta
            inputs.hardware[rank] = "host" if rank in sampled else "none"
        inputs.summaries += summaries

    for path in files:
        try:
            if _is_trace(path):
                tr = read_chrome_trace(path)
                host = tr.meta.host or f"worker{tr.worker}"
                meta = WorkerMeta(rank=tr.worker, host=host, device=tr.meta.device or f"{host}/cpu")
                add(path, {tr.worker: meta}, summarise(tr.events, samples, tr.step_bounds))
            else:
                table = _read_table(path)
                add(path, _table_workers(path, table, peer_cols, policy_keys), summarise(table, samples))
        except (TraceError, SummaryError) as exc:
            where = samples_path if str(exc).startswith("sample") else path
            raise DiagnoseError(f"{where}: {exc}") from None
        if progress:
            progress(path)
    if not inputs.summaries:
        raise DiagnoseError(f"{files[0]}{' ...' if len(files) > 1 else ''}: no events inside any step")
    return inputs


def _is_trace(path: Path) -> bool:
    name = path.name.lower()
    if name.endswith(TABLE_SUFFIXES):
        return False
    if name.endswith(TRACE_SUFFIXES):
        return True
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise DiagnoseError(f"{path}: cannot read it: {exc.strerror}") from None
    return head[:1] in (b"{", b"\x1f")


def _read_table(path: Path) -> pa.Table:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise DiagnoseError(f"{path}: cannot read it: {exc.strerror}") from None
    try:
        if head == b"PAR1":
            return pq.read_table(path)
        types = {"worker": pa.int64(), "step": pa.int64(), "start_us": pa.float64(), "duration_us": pa.float64(),
                 "t_us": pa.float64(), "value": pa.float64(), "bytes": pa.float64()}  # fmt: skip
        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=True))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        kind = "Parquet" if head == b"PAR1" else "CSV"
        raise DiagnoseError(f"{path}: not a readable {kind} table ({str(exc).splitlines()[0]})") from None


def _table_workers(path: Path, t: pa.Table, peer_cols: list[str] | None, policy_keys: tuple[str, ...]) -> dict:
    """Worker metadata from an op-event table: host, device and the peer-group label columns."""
    from ..schemas.records import WorkerMeta

    if "worker" not in t.column_names:
        raise DiagnoseError(f"{path}: op-event table lacks column worker")
    if peer_cols:
        missing = [c for c in peer_cols if c not in t.column_names]
        if missing:
            raise DiagnoseError(f"{path}: no column {', '.join(missing)} for --peer-group; columns: {', '.join(t.column_names)}")
        label_cols = list(peer_cols)
    else:
        label_cols = [c for c in policy_keys if c in t.column_names]
    worker = t.column("worker").to_numpy(zero_copy_only=False)
    ranks, inv = np.unique(worker, return_inverse=True)
    per: dict[str, np.ndarray] = {}
    for c in ("host", "device", *label_cols):
        if c not in t.column_names:
            continue
        values = np.asarray(t.column(c).cast(pa.string()).to_pylist(), dtype=object)
        have = np.not_equal(values, None)
        pairs = np.unique(np.stack([inv[have].astype(str), values[have].astype(str)], axis=1), axis=0) if have.any() else np.empty((0, 2), dtype=str)
        if c in label_cols:
            n = np.bincount(pairs[:, 0].astype(np.int64), minlength=ranks.size) if pairs.size else np.zeros(ranks.size, dtype=np.int64)
            if np.any(n > 1):
                w = int(ranks[np.flatnonzero(n > 1)[0]])
                raise DiagnoseError(f"{path}: label column {c} must hold one value per worker; worker {w} has {int(n.max())}")
        out = np.full(ranks.size, "", dtype=object)
        if pairs.size:
            out[pairs[::-1, 0].astype(np.int64)] = pairs[::-1, 1]  # first value (in sort order) per worker
        per[c] = out
    metas = {}
    for i, rank in enumerate(ranks.tolist()):  # one WorkerMeta per worker: the record the processor gets too
        host = per["host"][i] if "host" in per and per["host"][i] else f"worker{rank}"
        metas[int(rank)] = WorkerMeta(rank=int(rank), host=host, device=per["device"][i] if "device" in per else "",
                                      labels={c: per[c][i] for c in label_cols if per[c][i] != ""})  # fmt: skip
    return metas
