"""The diagnosis offline, on files (``lockstep diagnose``): profiler traces and op-event tables in, findings out.

Inputs (any mix):

1. PyTorch profiler Chrome traces, one file per worker (``.json`` / ``.json.gz``),
   as ``torch.profiler`` writes them, CPU-only or with GPU (CUDA, ROCm) or MTIA
   activity.  The rank comes from the trace, the caller (``--rank FILE=N``), the file
   name (``rank-3``, ``worker3``), or the order of the files; steps from
   ``ProfilerStep#N`` or, without them, inferred (``producers/agent/trace.py``).
   How a rank or the steps were found, when not from the trace, is a note.
2. Op-event tables (``.parquet`` / ``.csv``), one row per executed function:
   ``worker, step, function, kind, start_us, duration_us``, optional ``host``,
   ``device`` and label columns (peer-group keys).
3. A hardware-sample table ``worker, t_us, metric, value``.

Every worker's events go through the host-side summariser, every step through
the step stage, the whole set through the window stage: the same code the
processor runs, so the same findings.  Coverage counts the workers of the job
(``distributedInfo.world_size`` where a trace says it), not only those given.

Every input is opened without blocking and must be a regular file of at most
``max_bytes`` (after decompression, read in chunks): a FIFO, a device, a
gzip bomb or a nested or out-of-range trace is a one-line :class:`DiagnoseError`.
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..schemas.errors import LockstepError

if TYPE_CHECKING:
    from ..producers.agent.summarise import StepSummary
    from ..producers.agent.trace import TraceEvents
    from ..schemas.records import WorkerMeta

TRACE_SUFFIXES = (".json", ".gz")
TABLE_SUFFIXES = (".parquet", ".pq", ".csv")
MAX_INPUT_MB = 2048.0
#: fewer trace files than this, of fewer bytes in all, are read in the calling process (starting a pool costs ~1 s)
POOL_MIN_FILES = 16
POOL_MIN_BYTES = 32 << 20
#: how often the calling process relays what the pool processes say of their reads (at most), in seconds
POOL_STATUS_S = 0.1


class DiagnoseError(LockstepError, ValueError):
    """An input file is unreadable or breaks its contract; the message names the file."""


@dataclass
class Inputs:
    """Every worker's step summaries and metadata, read from the files."""

    workers: dict[int, WorkerMeta] = field(default_factory=dict)
    hardware: dict[int, str] = field(default_factory=dict)  # "host" where hardware samples came with it, else "none"
    summaries: list[StepSummary] = field(default_factory=list)
    files: int = 0
    expected_workers: int = 0  # the job's workers: the largest world_size a trace gives, at least those read
    notes: list[str] = field(default_factory=list)  # how ranks or steps were found where the files did not say
    connections: pa.Table | None = None  # the workers' TCP connections over the window (CONNECTION_SCHEMA), if given


def diagnose(inputs: Inputs, policy, job: str, *, now: float, keep: list | None = None):
    """Step stage for every step, then the window stage, exactly as in the processor; ``keep``, when given,
    receives the step results (for the report's deviation map)."""
    from ..streams.diagnosis import StepFrame, WindowInfo, analyze_step, diagnose_window
    from ..streams.diagnosis.collectives import Instances, by_worker_step, matched_waits, with_matched_waits

    # collectives the traces number: each instance matched across ranks by (process group, number), its wait exact
    waits = by_worker_step(
        matched_waits(
            [Instances(s.worker, s.step, s.collectives) for s in inputs.summaries if s.collectives is not None]
        )
    )
    by_step: dict[int, list] = {}
    for s in inputs.summaries:
        by_step.setdefault(s.step, []).append(s)
    steps = sorted(by_step)
    window = f"steps{steps[0]}-{steps[-1]}"
    results = []
    for step in steps:
        ss = sorted(by_step[step], key=lambda s: s.worker)
        frame = StepFrame.from_tables(
            job,
            window,
            step,
            [inputs.workers[s.worker] for s in ss],
            [s.step_time_us for s in ss],
            [with_matched_waits(s.functions, waits.get((s.worker, s.step))) for s in ss],
            policy.diagnosis.peer_group_keys,
            [inputs.hardware.get(s.worker, "none") for s in ss],
        )
        results.append(analyze_step(frame, policy.diagnosis))
    info = WindowInfo(
        job=job,
        window=window,
        start_step=steps[0],
        steps=len(steps),
        expected_workers=max(inputs.expected_workers, len(inputs.workers)),
    )
    if keep is not None:
        keep += results
    return diagnose_window(info, results, policy, now=now, connections=inputs.connections)


# --------------------------------------------------------------------------- files


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Folders as the trace and table files in them (else the JAX profiles in them), and globs the shell did not expand (quoted, or too many
    files for one command line) as the files they match, each sorted; other paths as given."""
    import glob

    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(
                f for f in p.iterdir() if f.is_file() and f.name.lower().endswith(TRACE_SUFFIXES + TABLE_SUFFIXES)
            )
            if not found:  # the JAX profiler's log folder(s): its trace(s) under plugins/profile/<run>/
                from ..producers.agent.jaxtrace import jax_profiles

                found = jax_profiles(p)
            if not found:
                raise DiagnoseError(f"{p}: a folder without trace or table files")
            out += found
        elif not p.exists() and any(c in str(p) for c in "*?["):
            found = sorted(Path(f) for f in glob.glob(str(p)))
            if not found:
                raise DiagnoseError(f"{p}: no file matches")
            out += found
        else:
            out.append(p)
    return out


def load_inputs(
    files: list[Path],
    peer_cols: list[str] | None,
    samples_path: Path | None,
    policy_keys: tuple[str, ...] = (),
    *,
    ranks: dict[Path, int] | None = None,
    max_bytes: int = int(MAX_INPUT_MB * 2**20),
    progress=None,
    status=None,
    jobs: int = 1,
) -> Inputs:
    """``progress(path)`` hears every file read (the CLI's progress bar), ``status(text)`` how far a large trace has
    got (its parts' steps), read in this process or in a pool process.  ``jobs`` > 1: trace files are read
    and summarised by that many processes (:func:`_read_in_pool`)."""
    from ..producers.agent.summarise import summarise
    from ..schemas.records import WorkerMeta

    ranks = ranks or {}
    samples, sampled = _read_samples(samples_path, max_bytes)
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

    traces: list[tuple[Path, TraceEvents]] = []
    pooled = _read_pooled(files, ranks, samples_path, max_bytes, jobs, progress, status)  # (progress heard there)
    read = dict(pooled)  # each trace file: the trace and its summaries
    for path in files:
        with _about(path, samples_path):
            if path in read:
                traces.append((path, read[path][0]))
                continue
            if _is_trace(path, max_bytes):
                read[path] = read_summarised(path, ranks.get(path), samples, max_bytes, status)
                traces.append((path, read[path][0]))
            elif path in ranks:
                raise DiagnoseError(
                    f"{path}: --rank is for trace files; an op-event table names its workers in its worker column"
                )
            else:
                table = _read_table(path, max_bytes)
                add(path, _table_workers(path, table, peer_cols, policy_keys), summarise(table, samples))
        if progress and path not in pooled:
            progress(path)
        if status and path in read and path not in pooled:
            status("reading")
    inputs.notes += _number_unranked(traces, set(owner))
    inputs.notes += _trace_notes(traces)
    for path, te in traces:
        worker = cast(int, te.worker)  # every trace has a rank now (numbered above)
        with _about(path, samples_path):
            host = te.meta.host or f"worker{worker}"
            meta = WorkerMeta(rank=worker, host=host, device=te.meta.device or f"{host}/cpu")
            done = read.get(path, (None, None))[1]
            if done is not None and te.meta.rank_from == "numbered":  # summarised before it had a number
                done = [replace(s, worker=worker) for s in done]
            add(path, {worker: meta}, done if done is not None else summarise(te.events, samples, te.step_bounds))
            if te.meta.world_size:
                inputs.expected_workers = max(inputs.expected_workers, te.meta.world_size)
    if not inputs.summaries:
        raise DiagnoseError(f"{files[0]}{' ...' if len(files) > 1 else ''}: no events inside any step")
    inputs.expected_workers = max(inputs.expected_workers, len(inputs.workers))
    return inputs


def _read_samples(samples_path: Path | None, max_bytes: int) -> tuple[pa.Table | None, set[int]]:
    """The hardware-sample table (None without one) and the workers it has samples of."""
    samples = _read_table(samples_path, max_bytes) if samples_path else None
    sampled: set[int] = set()
    if samples is not None:
        if "worker" not in samples.column_names:
            raise DiagnoseError(f"{samples_path}: sample table lacks column worker; needs worker, t_us, metric, value")
        sampled = set(pc.unique(samples.column("worker")).to_pylist())
    return samples, sampled


def read_connections(path: Path, max_bytes: int = int(MAX_INPUT_MB * 2**20)) -> pa.Table:
    """A connection table (.parquet, .csv; ``CONNECTION_SCHEMA``: what ``--connections`` reads), its columns cast to
    the schema's types; a file that lacks a required column or whose values do not fit says so in one line."""
    from ..schemas.events import CONNECTION_REQUIRED, CONNECTION_SCHEMA

    t = _read_table(path, max_bytes)
    missing = [c for c in CONNECTION_REQUIRED if c not in t.column_names]
    if missing:
        raise DiagnoseError(
            f"{path}: connection table lacks column {', '.join(missing)}; needs {', '.join(CONNECTION_REQUIRED)}"
        )
    cols = []
    for f in CONNECTION_SCHEMA:
        col = t.column(f.name) if f.name in t.column_names else pa.nulls(t.num_rows, f.type)
        try:
            col = col.cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise DiagnoseError(f"{path}: column {f.name} of the connection table is not {f.type}") from None
        if not f.nullable and col.null_count:
            raise DiagnoseError(f"{path}: column {f.name} of the connection table has empty values")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=CONNECTION_SCHEMA)


def _read_pooled(
    files: list[Path], ranks: dict[Path, int], samples_path: Path | None, max_bytes: int, jobs: int, progress, status
) -> dict[Path, tuple]:
    """With ``jobs`` > 1 and POOL_MIN_FILES trace files or more (or more than one, of over POOL_MIN_BYTES on disk):
    the trace files read by a pool (:func:`_read_in_pool`).  Otherwise none (read in this process)."""
    trace_files = []
    if jobs > 1:
        for path in files:
            with _about(path, samples_path):
                if _is_trace(path, max_bytes):
                    trace_files.append(path)
    on_disk = sum(p.stat().st_size for p in trace_files)
    if len(trace_files) >= POOL_MIN_FILES or (len(trace_files) > 1 and on_disk > POOL_MIN_BYTES):
        # one process per core, each reading one file at a time, summaries sent back
        return _read_in_pool(trace_files, ranks, samples_path, max_bytes, jobs, progress, status)
    return {}


def _number_unranked(traces: list[tuple[Path, TraceEvents]], taken: set[int]) -> list[str]:
    """Traces that name no rank take the next free numbers (not ``taken`` by a table nor named by a trace), in the
    order given; in place.  The note that says so, if any trace was numbered."""
    taken = taken | {te.worker for _, te in traces if te.worker is not None}
    free = (n for n in range(len(taken) + len(traces) + 1) if n not in taken)
    unranked = [i for i, (_, te) in enumerate(traces) if te.worker is None]
    for i in unranked:
        traces[i] = (traces[i][0], traces[i][1].with_worker(next(free), "numbered"))
    if not unranked:
        return []
    return [
        _note(
            "no rank in the trace or its file name",
            [traces[i] for i in unranked],
            lambda te: f"numbered {te.worker} in the order given",
        )
        + " (--rank FILE=N to set one)"
    ]


def _trace_notes(traces: list[tuple[Path, TraceEvents]]) -> list[str]:
    """How ranks were found where the traces did not say them (their file names), and how their steps were found
    where they have no ``ProfilerStep#N``."""
    notes = []
    by_name = [(p, te) for p, te in traces if te.meta.rank_from == "file name"]
    if by_name:
        notes.append(_note("no distributedInfo.rank", by_name, lambda te: f"rank {te.worker} from the file name"))
    for how in sorted({te.meta.steps_from for _, te in traces} - {"ProfilerStep"}):
        which = [(p, te) for p, te in traces if te.meta.steps_from == how]
        what = (
            "the whole trace is one step (no optimizer step or repeating region to tell iterations by)"
            if how == "whole trace"
            else f"{{n}} iterations inferred, each ending with an {how}"
            if how == "Optimizer.step"
            else f"{{n}} iterations inferred from the repeating top-level {how}"
        )
        notes.append(_note("no ProfilerStep#N", which, lambda te, what=what: what.format(n=len(te.step_bounds))))
    return notes


def _read_in_pool(
    files: list[Path], ranks: dict[Path, int], samples_path: Path | None, max_bytes: int, jobs: int, progress, status
) -> dict[Path, tuple]:
    """Trace files read by ``jobs`` processes (spawned: nothing of this process is shared), one file at a time
    each, so that each holds one trace's columns at most.  A trace whose rank is known comes back summarised
    (its function tables: a few hundred kilobytes, whatever the trace's size) with its events left out; one
    whose rank is not known yet comes back whole, to be numbered and summarised here.

    ``status(text)`` hears, here, what each process's reads say after each part (:func:`read_summarised`), as for a
    trace read in this process: they write it to a pipe (:func:`_tell`) that this process drains while it waits for
    the files, every POOL_STATUS_S at most and whenever a file is done (so before that file's ``progress``).  While
    several files are being read at once, each status says how many others are (``(and 2 more file(s) being
    read)``).  The processes read in parts of this process's ``trace.PART_EVENTS``."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from ..producers.agent import trace

    out: dict[Path, tuple] = {}
    ctx = multiprocessing.get_context("spawn")
    heard, told = ctx.Pipe(duplex=False)
    try:
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(files)),
            mp_context=ctx,
            initializer=_pool_process,
            initargs=(told if status else None, trace.PART_EVENTS),
        ) as pool:
            futures = {
                pool.submit(_read_one, path, ranks.get(path), samples_path, max_bytes, i): path
                for i, path in enumerate(files)
            }
            order = {fut: i for i, fut in enumerate(futures)}
            pending = set(futures)
            reading: set[int] = set()  # the files (by number) that have said how far they are and are not done
            try:
                while pending:
                    done, pending = wait(pending, timeout=POOL_STATUS_S, return_when=FIRST_COMPLETED)
                    while status and heard.poll():  # what the processes said so far (a file's before its result)
                        i, _, said = heard.recv_bytes().decode(errors="replace").partition(" ")
                        reading.add(int(i))
                        others = f" (and {len(reading) - 1} more file(s) being read)" if len(reading) > 1 else ""
                        status(said + others)
                    for fut in sorted(done, key=order.__getitem__):
                        path = futures[fut]
                        reading.discard(order[fut])
                        with _about(path, samples_path):
                            out[path] = fut.result()
                        if progress:
                            progress(path)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        heard.close()
        told.close()
    if status:
        status("reading")
    return out


_SAMPLES: dict[Path, pa.Table] = {}
_TOLD = None  # in a pool process: the write end of the calling process's status pipe (:func:`_pool_process`)


def _pool_process(told, part_events: int) -> None:
    """A pool process's start: its reads' statuses go to ``told`` (None: nowhere), written without blocking
    (:func:`_tell`); parts of the calling process's size."""
    global _TOLD
    from ..producers.agent import trace

    trace.PART_EVENTS = part_events
    if told is not None:
        os.set_blocking(told.fileno(), False)
        _TOLD = told


def _tell(text: str) -> None:
    """In a pool process: one status to the calling process.  One message of at most PIPE_BUF bytes is one write,
    which a pipe takes whole or not at all (POSIX), so the processes need no lock and none ever waits: a message
    that finds the pipe full (the caller is behind) is dropped, the next one says more."""
    if _TOLD is None:
        return
    try:  # (send_bytes writes its 4-byte length and a short text at once)
        _TOLD.send_bytes(text.encode()[: select.PIPE_BUF - 4])
    except (BlockingIOError, BrokenPipeError):
        pass


def _read_one(path: Path, rank: int | None, samples_path: Path | None, max_bytes: int, i: int) -> tuple:
    """In a pool process: one trace read, and summarised when its rank is known (:func:`read_summarised`), its
    statuses told to the calling process after the file's number ``i`` (which files are still being read)."""
    samples = None
    if samples_path is not None:
        if samples_path not in _SAMPLES:  # once per process
            _SAMPLES[samples_path] = _read_table(samples_path, max_bytes)
        samples = _SAMPLES[samples_path]
    return read_summarised(path, rank, samples, max_bytes, lambda text: _tell(f"{i} {text}"))


def read_summarised(
    path: Path, rank: int | None, samples: pa.Table | None, max_bytes: int, status=None
) -> tuple[TraceEvents, list[StepSummary] | None]:
    """One trace file read and summarised a part at a time (:func:`~lockstep.producers.agent.trace.read_chrome_trace_parts`:
    a large trace in bounded memory): the trace with its events left out, and its step summaries.  A trace whose rank
    is not known yet is summarised as worker 0's (the caller numbers it, and its summaries with it); with a sample
    table, whose rows are matched by worker, it comes back whole and not summarised (None), to be numbered and
    summarised by the caller.  ``status(text)`` hears how many steps are read after each part of a trace read in
    parts."""
    from ..producers.agent.jaxtrace import read_trace_parts
    from ..producers.agent.summarise import summarise
    from ..schemas.events import OP_EVENT_SCHEMA

    summaries: list[StepSummary] = []
    bounds: dict[int, tuple[float, float]] = {}
    for te in read_trace_parts(path, rank, max_bytes=max_bytes, anonymous_as=None if samples is not None else 0):
        if te.worker is None and samples is not None:  # read whole (one part)
            return te, None
        summaries += summarise(te.events, samples, te.step_bounds)
        bounds.update(te.step_bounds)
        if status:
            status(f"reading {path.name}: {len(bounds):,} steps")
    return replace(te, events=OP_EVENT_SCHEMA.empty_table(), step_bounds=bounds), summaries


@contextlib.contextmanager
def _about(path: Path, samples_path: Path | None):
    """A reader's or the summariser's error as the command's, naming the file it is about."""
    from ..producers.agent.summarise import SummaryError
    from ..producers.agent.trace import TraceError

    try:
        yield
    except (TraceError, SummaryError) as exc:
        raise DiagnoseError(f"{samples_path if str(exc).startswith('sample') else path}: {exc}") from None


def _note(what: str, traces: list, how) -> str:
    """One line for the traces read the same way: ``what: a.json: how; b.json: how`` (at most 4 named)."""
    named = "; ".join(f"{p.name}: {how(te)}" for p, te in traces[:4])
    more = f"; and {len(traces) - 4} more file(s)" if len(traces) > 4 else ""
    return f"{what}: {named}{more}"


def _is_trace(path: Path, max_bytes: int) -> bool:
    """By its name, else by its first byte (opened as a regular file only: ``open_regular`` raises otherwise)."""
    from ..producers.agent.trace import open_regular

    name = path.name.lower()
    if name.endswith(TABLE_SUFFIXES):
        return False
    if name.endswith(TRACE_SUFFIXES):
        return True
    with open_regular(path, max_bytes) as fh:
        return fh.read(1) in (b"{", b"\x1f")


def _read_table(path: Path, max_bytes: int) -> pa.Table:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from ..producers.agent.trace import TraceError, open_regular

    try:
        fh = open_regular(path, max_bytes, "table")
    except TraceError as exc:
        raise DiagnoseError(f"{path}: {exc}") from None
    with fh:
        head = fh.read(4)
        fh.seek(0)
        try:
            if head == b"PAR1":
                return pq.read_table(fh)
            types = {
                "worker": pa.int64(),
                "step": pa.int64(),
                "start_us": pa.float64(),
                "duration_us": pa.float64(),
                "t_us": pa.float64(),
                "value": pa.float64(),
                "bytes": pa.float64(),
            }
            return pcsv.read_csv(fh, convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=True))
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
            raise DiagnoseError(
                f"{path}: no column {', '.join(missing)} for --peer-group; columns: {', '.join(t.column_names)}"
            )
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
        have = np.not_equal(values, None)  # type: ignore[call-overload]  # numpy's stubs: an object array against None
        pairs = (
            np.unique(np.stack([inv[have].astype(str), values[have].astype(str)], axis=1), axis=0)
            if have.any()
            else np.empty((0, 2), dtype=str)
        )
        if c in label_cols:
            n = (
                np.bincount(pairs[:, 0].astype(np.int64), minlength=ranks.size)
                if pairs.size
                else np.zeros(ranks.size, dtype=np.int64)
            )
            if np.any(n > 1):
                w = int(ranks[np.flatnonzero(n > 1)[0]])
                raise DiagnoseError(
                    f"{path}: label column {c} must hold one value per worker; worker {w} has {int(n.max())}"
                )
        out = np.full(ranks.size, "", dtype=object)
        if pairs.size:
            out[pairs[::-1, 0].astype(np.int64)] = pairs[::-1, 1]  # first value (in sort order) per worker
        per[c] = out
    metas = {}
    for i, rank in enumerate(ranks.tolist()):  # one WorkerMeta per worker: the record the processor gets too
        host = per["host"][i] if "host" in per and per["host"][i] else f"worker{rank}"
        metas[int(rank)] = WorkerMeta(
            rank=int(rank),
            host=host,
            device=per["device"][i] if "device" in per else "",
            labels={c: per[c][i] for c in label_cols if per[c][i] != ""},
        )
    return metas
