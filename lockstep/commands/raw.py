"""``lockstep raw JOB --workers 2,5``: fetch a slice of the raw profiler trace the agents kept.

Sends a ``RawRequest`` on the control topic; each named worker's agent answers
with a ``RawTrace`` on the raw topic: a bounded, redacted, zstd-compressed slice
of its last window's Chrome trace (or the reason it has none).  The slices are
written as ``<out>/<job>.<window>.rank<N>.trace.json`` (``last`` for the window
when none was named), which Perfetto and chrome://tracing open.

Anything that can write to the raw topic (every training process) can answer, so an
answer counts only when it carries this request's id, job, window and one of its
workers (:func:`lockstep.app.operator.request_raw`); file names are built from the
request's own values only, never from an answer's; and an answer's trace may expand
to at most :data:`EXPANSION` times the request's byte bound.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from .. import config
from ._kafka import reach_kafka

#: an answer's trace may expand to this many times the request's ``max_bytes`` (JSON traces compress ~10x)
EXPANSION = 32


def trace_file(out: Path, req, worker: int) -> Path:
    """Where a worker's slice is written: from the request's values only (an answer names no path)."""
    from ..producers.agent.retention import safe_file_name

    return out / f"{safe_file_name(req.job)}.{safe_file_name(req.window or 'last')}.rank{int(worker)}.trace.json"


def _ints(text: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise config.ConfigError(f"expected comma-separated numbers, got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser("raw", help="fetch a slice of the raw profiler trace that named workers kept")
    config.add_arguments(p, command="raw")
    p.add_argument("job", help="the job")
    p.add_argument("--workers", required=True, help="ranks that should send their slice, e.g. 2,5")
    p.add_argument("--window", default="", help="the window (default: the last one each worker kept)")
    p.add_argument("--steps", default="", help="steps to include, e.g. 41,42 (default: the whole window)")
    p.add_argument("--max-bytes", type=int, default=512 << 10, help="bound of each compressed slice (default 512 KiB)")
    p.add_argument("--out", type=Path, default=Path("."), help="directory for the trace files (default: here)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answers (default 30)")
    p.add_argument("--json", action="store_true", help="print the answers (without their payload) as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.operator import RawError, request_raw
    from ..app.output import print_json, table
    from ..producers.agent.retention import decompress
    from ..schemas.compression import CompressionError
    from ..schemas.records import RawRequest, to_builtins

    settings = config.load(args)
    if not settings.bootstrap_servers:
        raise config.ConfigError("bootstrap_servers: `lockstep raw` talks to running agents; pass --bootstrap-servers")
    workers = _ints(args.workers)
    if not workers:
        raise config.ConfigError("--workers: name at least one rank")
    if not 1024 <= args.max_bytes <= 16 << 20:
        raise config.ConfigError(f"--max-bytes: {args.max_bytes} is not in 1024..{16 << 20}")
    req = RawRequest(
        job=args.job,
        request=uuid.uuid4().hex,
        workers=workers,
        window=args.window,
        steps=_ints(args.steps),
        max_bytes=args.max_bytes,
        created_at=time.time(),
    )
    reach_kafka(settings)
    answers = request_raw(settings, req, args.timeout)
    if not answers:
        raise RawError(
            f"no worker of {args.job} answered within {args.timeout:g}s (are the agents running, with this --topic-prefix?)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    rows, out = [], []
    unreadable = 0
    for w in workers:
        a = answers.get(w)
        if a is None:
            rows.append([w, "-", "-", "-", "-", "no answer"])
            continue
        path, error = "", a.error
        if a.trace:
            try:
                data = decompress(a.trace, EXPANSION * req.max_bytes)
            except CompressionError as exc:
                unreadable += 1
                error = f"unreadable answer: {exc}"
            else:
                path = str(trace_file(args.out, req, w))
                _write_new(Path(path), data)
        rows.append(
            [
                w,
                a.window or "-",
                ",".join(map(str, a.steps)) or "-",
                f"{a.events}/{a.events_total}" + (" (cut)" if a.truncated else ""),
                len(a.trace),
                path or error,
            ]
        )
        out.append(
            {
                **{k: v for k, v in to_builtins(a).items() if k not in ("trace", "error")},
                "error": error,
                "bytes": len(a.trace),
                "file": path,
            }
        )
    if args.json:
        print_json(out)
    else:
        print(table(["worker", "window", "steps", "events", "bytes", "file / error"], rows, max_width=90))
    return 0 if len(answers) == len(workers) and not unreadable else 1


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, replacing a file there but never following a link planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
