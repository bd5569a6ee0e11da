"""``lockstep diagnose FILES...``: the stream processor's diagnosis, offline, on files (:mod:`lockstep.app.offline`).

How a rank or the steps were found, when not from the trace, is one line on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from .. import config
from ..app.offline import MAX_INPUT_MB, DiagnoseError, diagnose, expand_inputs, load_inputs, read_connections


def register(sub) -> None:
    p = sub.add_parser("diagnose", help="diagnose profiler traces or op-event tables offline (the processor's engine)")
    p.add_argument(
        "files",
        nargs="+",
        type=Path,
        metavar="FILES",
        help="Chrome traces, one per worker (.json, .json.gz), and/or op-event tables (.parquet, .csv); "
        "a folder stands for the trace and table files in it, a quoted glob for the files it matches",
    )
    p.add_argument(
        "--peer-group",
        action="append",
        default=[],
        metavar="COL",
        help="label column of the op-event tables that defines peer groups (repeatable); "
        "default: the policy's peer_group_keys that exist as columns",
    )
    p.add_argument(
        "--samples", type=Path, default=None, help="hardware-sample table (.parquet, .csv): worker, t_us, metric, value"
    )
    p.add_argument(
        "--connections",
        type=Path,
        default=None,
        metavar="FILE",
        help="the workers' TCP connections over the same steps (.parquet, .csv): worker, local, peer, segs_out, "
        "retrans (the agent's connection table): a worker whose link loses packets is named from them",
    )
    p.add_argument(
        "--rank",
        action="append",
        default=[],
        metavar="FILE=N",
        help="the rank of a trace file that does not say it (repeatable); "
        "default: distributedInfo.rank, else the file name (rank-3, rank3, worker3), else the order of the files",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="processes that read trace files at once, each one file at a time (default: one per core; 1: in this process)",
    )
    p.add_argument(
        "--max-input-mb",
        type=float,
        default=MAX_INPUT_MB,
        metavar="MB",
        help=f"largest input file, after decompression (default {MAX_INPUT_MB:g})",
    )
    config.add_arguments(p, command="diagnose")
    p.add_argument("--job", default="offline", help="job name the findings carry (default: offline)")
    p.add_argument("--json", action="store_true", help="print the Finding records as a JSON list")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="FILE.html",
        help="also write the live page's pictures of this window (step time per rank, worker x function deviation "
        "map, each finding's evidence) as one self-contained HTML file",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.output import findings_table, plural, print_json
    from ..app.progress import Progress, wanted
    from ..schemas.records import to_builtins
    from ..streams.policy import load_policy

    policy = load_policy(config.load(args).policy)
    if not args.max_input_mb > 0:
        raise DiagnoseError(f"--max-input-mb must be positive, got {args.max_input_mb:g}")
    files = expand_inputs(args.files)
    extra = [p for p in (args.samples, args.connections) if p]
    for path in (*files, *extra):
        if is_duckdb(path):
            raise DiagnoseError(
                f"{path} is a DuckDB file (a findings store?), not a trace or an op-event table: "
                f"list its findings with `lockstep findings --db {path}`"
            )
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    if jobs < 1:
        raise DiagnoseError(f"--jobs must be at least 1, got {jobs}")
    with Progress(wanted(args.json), "reading", total=len(files), unit="file") as bar:
        inputs = load_inputs(
            files,
            args.peer_group or None,
            args.samples,
            policy.diagnosis.peer_group_keys,
            ranks=_given_ranks(args.rank, files),
            max_bytes=int(args.max_input_mb * 2**20),
            progress=lambda _: bar.update(),
            status=bar.status,
            jobs=jobs,
        )
    if args.connections:
        inputs.connections = read_connections(args.connections, int(args.max_input_mb * 2**20))
    for note in inputs.notes:
        print(f"lockstep diagnose: {note}", file=sys.stderr)
    labels = sorted({k for w in inputs.workers.values() for k in w.labels})
    missing = [k for k in args.peer_group if k not in labels]
    if missing:
        raise DiagnoseError(
            f"--peer-group: no worker has the label {', '.join(missing)} (labels: {', '.join(labels) or 'none'}; "
            "Chrome traces carry none: peer groups need label columns of op-event tables)"
        )
    keys = tuple(args.peer_group) or tuple(
        k for k in policy.diagnosis.peer_group_keys if any(k in w.labels for w in inputs.workers.values())
    )
    policy = dataclasses.replace(policy, diagnosis=dataclasses.replace(policy.diagnosis, peer_group_keys=keys))
    results: list = []
    now = time.time()
    d = diagnose(inputs, policy, args.job, now=now, keep=results)
    if args.report is not None:
        from ..app.offlinereport import offline_report, write_report

        write_report(args.report, offline_report(inputs, d, results, args.job, now), inputs.files)
    found = [to_builtins(f) for f in d.findings]
    if args.json:
        print_json(found)
        return 0
    print(findings_table(found))
    r = d.report
    steps = sorted({s.step for s in inputs.summaries})
    print(
        f"\n{r.workers_seen} workers x {r.steps_seen} steps ({steps[0]}..{steps[-1]}) from {plural(inputs.files, 'file')}; "
        f"coverage {r.coverage:.0%} of {plural(inputs.expected_workers, 'worker')}; peer groups by {', '.join(keys) or 'nothing (one group)'}"
    )
    return 0


def is_duckdb(path: Path) -> bool:
    """Whether ``path`` is a DuckDB database file (its header's magic ``DUCK`` at byte 8); only a regular file is
    opened (a FIFO would block, a device never end: the reader says what is wrong with those)."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(12)[8:12] == b"DUCK"
    except OSError:
        return False  # the reader says what is wrong with it


def _given_ranks(specs: list[str], files: list[Path]) -> dict[Path, int]:
    """``--rank FILE=N`` options, each naming one of the files."""
    from ..schemas.events import MAX_WORKER

    out: dict[Path, int] = {}
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        match = [f for f in files if f.resolve() == Path(name).resolve()] or [f for f in files if f.name == name]
        if not sep or not value.isdigit() or len(value) > 8 or int(value) > MAX_WORKER:
            raise DiagnoseError(f"--rank {spec}: expected FILE=N with N a rank 0..{MAX_WORKER}")
        if len(match) != 1:
            raise DiagnoseError(
                f"--rank {spec}: {name} is {'not one of the files given' if not match else 'more than one of the files given'}"
            )
        out[match[0]] = int(value)
    return out
