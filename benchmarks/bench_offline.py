"""Offline trace reading at scale: speed and peak memory of ``lockstep diagnose``'s reader against HolisticTraceAnalysis.

    python benchmarks/bench_offline.py speed [--mb 200] [--no-hta] [--repeats 3]  # MB/s per core, peak RSS, vs HTA
    python benchmarks/bench_offline.py big [--mb 2048 ...]           # peak RSS of a 2 GB trace (or of each size), and of a gzip bomb
    python benchmarks/bench_offline.py ranks [--files 1024]          # 1,024 rank files, one slowed, all cores
    python benchmarks/bench_offline.py decoders [--mb 100]           # the reader's decoding vs a columnar JSON decoder

Traces are made from the real ones in ``tests/data/traces/`` (``a100_rank0_of16.json.gz``: 2 steps of an A100
NCCL job) by repeating their steps with shifted timestamps, step numbers and correlation ids, written to a
temporary folder (``--tmp``; removed at the end).  Whole-microsecond timestamps stay integers, as the trace writes
them (``1683564902201308.0``, 17 significant digits, is a number msgspec parses on its slow path: ~15% more of the
reader's CPU time at 100 MB, a cost that traces as profilers write them do not have).  Every reader runs in a fresh child process, which reports
its CPU time (user + system: MB/s *per core*, whatever else the machine is doing) and its own peak RSS
(``ru_maxrss``); ``speed`` runs the readers ``--repeats`` times each, alternating, and reports the median
of each figure (and each run's CPU time), the ratios between medians.  HolisticTraceAnalysis (``pip install -e '.[bench]'``) runs ``parse_trace_dataframe`` with its
default backend (``json``, what a plain install uses) and with ``ijson_batch_and_compress`` (its
low-memory one, yajl2_c); the lockstep reader runs ``lockstep diagnose``'s ``read_summarised`` (``read_chrome_trace_parts``, each part summarised: it reads
*and* summarises, HTA only parses), and runs it again with its native scanner switched off (every run of events
decoded by msgspec: the baseline the scanner is measured against, in the same run).  ``decoders`` measures in one
process, alternating, the reader's own decoding into columns (``trace_json.read_file``: with the native scanner,
then without it, msgspec and a Python object per event turned into numpy columns) against DuckDB's ``read_json``
(C++, columns without a Python object per event, one thread) on the same events.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "a100_rank0_of16.json.gz"

LOCKSTEP_CHILD = """
import json, resource, sys, time
from pathlib import Path
from lockstep.app.offline import read_summarised
from lockstep.producers.agent import trace_json
from lockstep.producers.agent.trace import TraceError
if sys.argv[3:] == ["msgspec"]:
    trace_json.native_scan = None  # the baseline: every run decoded by msgspec
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
try:
    te, rows = read_summarised(Path(sys.argv[1]), 0, None, int(sys.argv[2]))
    out = {"steps": len(te.step_bounds), "functions": sum(r.functions.num_rows for r in rows),
           "summary_mib": sum(r.functions.nbytes + (r.collectives.nbytes if r.collectives is not None else 0)
                              for r in rows) / 2**20}
except TraceError as exc:
    out = {"error": str(exc)}
ru = resource.getrusage(resource.RUSAGE_SELF)
cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
out.update(wall_s=time.perf_counter() - t0, cpu_s=cpu, maxrss_mib=ru.ru_maxrss / 1024, native=trace_json.native_scan is not None)
print(json.dumps(out))
"""

HTA_CHILD = """
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
from hta.common.trace_parser import parse_trace_dataframe
from hta.configs.parser_config import ParserConfig, ParserBackend
cfg = ParserConfig()
cfg.parser_backend = ParserBackend(sys.argv[2])
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
meta, df, symbols = parse_trace_dataframe(sys.argv[1], cfg)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rows": len(df), "wall_s": time.perf_counter() - t0,
                  "cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, "maxrss_mib": ru.ru_maxrss / 1024}))
"""


def _template() -> tuple[dict, list[dict], float, int]:
    trace = json.loads(gzip.decompress(TRACE.read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e.get("dur", 0) for e in events) - t0
    corr = 1 + max(e.get("args", {}).get("correlation", 0) for e in events)
    return trace, events, span, corr


def write_trace(path: Path, mb: float, *, slow_us: float = 0.0, world_size: int | None = None) -> int:
    """A trace of about ``mb`` MB: the real one's steps repeated; ``slow_us`` more on one region per step.
    ``world_size``: of that job, the rank left to the file name."""
    trace, events, span, corr = _template()
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    if world_size is not None:
        dist = {k: v for k, v in head.get("distributedInfo", {}).items() if k != "rank"}
        head["distributedInfo"] = {**dist, "world_size": world_size}
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    opener = gzip.open if path.suffix == ".gz" else open
    written = 0
    with opener(path, "wt") as fh:
        fh.write(json.dumps(head)[:-1] + ', "traceEvents": [' + json.dumps(meta)[1:-1])
        i = 0
        while written < mb * 1e6:
            out = []
            shift = i * (span + slow_us)
            shift = int(shift) if float(shift).is_integer() else shift  # whole µs stay written as the trace wrote them
            for e in events:
                e = {**e, "ts": e["ts"] + shift}
                if "correlation" in e.get("args", {}):
                    e["args"] = {**e["args"], "correlation": e["args"]["correlation"] + i * corr}
                if e["name"].startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{int(e['name'][13:]) + 2 * i}"
                    e["dur"] = e["dur"] + slow_us if slow_us else e["dur"]
                out.append(e)
            if slow_us:  # a slow region at the end of each step: the slowed rank's own function
                for s in (e for e in out if e["name"].startswith("ProfilerStep#")):
                    out.append(
                        {**s, "name": "slow_rank_region", "ts": s["ts"] + s["dur"] - slow_us, "dur": slow_us * 0.99}
                    )
            chunk = ", " + json.dumps(out)[1:-1]
            fh.write(chunk)
            written += len(chunk)
            i += 1
        fh.write("]}")
    return path.stat().st_size


def write_bomb(path: Path, content_gib: float = 4.0) -> None:
    """A gzip file whose content is ``content_gib`` GiB + 12 bytes of JSON (a trace object padded with
    whitespace), so that the size in its trailer wraps to a small number and passes the announced-size check."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b" " * (64 << 20)
    with open(path, "wb") as fh:
        fh.write(comp.compress(b'{"traceEvents": [' + b" " * 0))
        for _ in range(int(content_gib * 16)):
            fh.write(comp.compress(block))
        fh.write(comp.compress(b"]}"))
        fh.write(comp.flush())


def child(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["exit " + str(r.returncode)])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _row(what: str, size: int, r: dict) -> str:
    if "error" in r and "cpu_s" not in r:
        return f"{what:44s} failed: {r['error']}"
    rate = size / 1e6 / r["cpu_s"] if r.get("cpu_s") else float("nan")
    extra = f"  ({r['error']})" if "error" in r else ""
    if "summary_mib" in r:
        extra += f"  ({r['steps']:,} steps; their function tables {r['summary_mib']:.0f} MiB)"
    if "runs" in r:
        extra += f"  (cpu of each run: {', '.join('-' if x is None else f'{x:.2f}' for x in r['runs'])} s)"
    return f"{what:44s} {rate:7.1f} MB/s per core  cpu {r['cpu_s']:6.1f} s  wall {r['wall_s']:6.1f} s  peak RSS {r['maxrss_mib']:7.0f} MiB{extra}"


def speed(a, tmp: Path) -> None:
    path = tmp / "trace.json"
    size = write_trace(path, a.mb)
    print(f"trace: {size / 1e6:.0f} MB of JSON, {TRACE.name}'s steps repeated")
    backends = () if a.no_hta else ("json", "ijson_batch_and_compress")
    print(
        f"each figure the median of {a.repeats} run(s), each run a fresh child process"
        + (", the readers alternating" if backends else "")
    )
    runs: dict[str, list[dict]] = {"lockstep": [], "msgspec": [], **{b: [] for b in backends}}
    for _ in range(a.repeats):
        runs["lockstep"].append(child(LOCKSTEP_CHILD, str(path), str(1 << 40)))
        runs["msgspec"].append(child(LOCKSTEP_CHILD, str(path), str(1 << 40), "msgspec"))
        for backend in backends:
            runs[backend].append(child(HTA_CHILD, str(path), backend))
    ours = _median(runs["lockstep"])
    if not all(r.get("native") for r in runs["lockstep"]):
        print("the native scanner is not built here (no C compiler at install?): msgspec decoded every run")
    print(_row("lockstep diagnose's reader + summariser", size, ours))
    base = _median(runs["msgspec"])
    print(_row("the same, the native scanner off (msgspec)", size, base))
    if "cpu_s" in base and "cpu_s" in ours:
        print(f"{'':44s} the scanner makes the read {base['cpu_s'] / ours['cpu_s']:.1f}x faster per core (medians)")
    for backend in backends:
        hta = _median(runs[backend])
        print(_row(f"HTA parse_trace_dataframe ({backend})", size, hta))
        if "cpu_s" in hta and "cpu_s" in ours:
            print(f"{'':44s} lockstep is {hta['cpu_s'] / ours['cpu_s']:.1f}x faster per core (medians)")


def _median(runs: list[dict]) -> dict:
    """The median of each figure over the runs that gave one (CPU and wall time, peak RSS) and, with more than
    one run, each run's CPU time; the first error a run reported (all of a failed run when none gave figures)."""
    done = [r for r in runs if "cpu_s" in r]
    if not done:
        return runs[0]
    out = {k: statistics.median(r[k] for r in done) for k in ("cpu_s", "wall_s", "maxrss_mib")}
    if len(runs) > 1:
        out["runs"] = [round(r["cpu_s"], 2) if "cpu_s" in r else None for r in runs]
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        out["error"] = errors[0]
    return out


def big(a, tmp: Path) -> None:
    """Peak RSS against trace size (it should stay flat once a trace is read in parts), then the bomb."""
    for mb in a.mb:
        path = tmp / "big.json"
        size = write_trace(path, mb)
        print(f"trace: {size / 1e6:.0f} MB of JSON, {TRACE.name}'s steps repeated")
        print(_row("lockstep diagnose's reader + summariser", size, child(LOCKSTEP_CHILD, str(path), str(1 << 40))))
        path.unlink()
    bomb = tmp / "bomb.json.gz"
    write_bomb(bomb, a.bomb_gib)
    limit = 2048 << 20
    r = child(LOCKSTEP_CHILD, str(bomb), str(limit))
    print(
        f"gzip bomb: {bomb.stat().st_size / 1e6:.1f} MB of gzip, {a.bomb_gib:g} GiB of content, trailer says "
        f"{int.from_bytes(bomb.read_bytes()[-4:], 'little'):,} bytes; limit 2,048 MiB (the default --max-input-mb)"
    )
    print(_row("lockstep on the bomb (refused)", limit, r))


def ranks(a, tmp: Path) -> None:
    folder = tmp / "ranks"
    folder.mkdir()
    t = time.perf_counter()
    base = folder / "base.json.gz"
    slow = folder / "slow.json.gz"
    write_trace(base, a.mb, world_size=a.files)
    write_trace(slow, a.mb, slow_us=20_000.0, world_size=a.files)
    for r in range(a.files):  # the same bytes for every rank but the slowed one; the rank from the file name
        os.link(slow if r == a.slow else base, folder / f"rank-{r}.json.gz")
    base.unlink()
    slow.unlink()
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(
        f"{a.files} rank files ({size / 1e6:.0f} MB of gzip), rank {a.slow} slowed, made in {time.perf_counter() - t:.0f} s"
    )
    cmd = [sys.executable, "-m", "lockstep", "diagnose", str(folder), "--jobs", str(a.jobs)]
    t = time.perf_counter()
    r = subprocess.run(
        ["/usr/bin/time", "-f", "%M KiB peak RSS (largest process)", *cmd], capture_output=True, text=True, check=False
    )
    print(r.stdout[-3000:])
    print(r.stderr[-1500:])
    print(f"wall {time.perf_counter() - t:.0f} s with --jobs {a.jobs} on {os.cpu_count()} cores")


DUCKDB_EVENT_COLUMNS = (
    "{ph: 'VARCHAR', cat: 'VARCHAR', name: 'VARCHAR', pid: 'VARCHAR', tid: 'VARCHAR', ts: 'DOUBLE', dur: 'DOUBLE', "
    "args: 'STRUCT(correlation BIGINT, device BIGINT, bytes DOUBLE, \"Process Group Name\" VARCHAR)'}"
)


def decoders(a, tmp: Path) -> None:
    import duckdb

    from lockstep.producers.agent import trace_json
    from lockstep.producers.agent.trace_json import read_file

    path = tmp / "trace.json"
    size = write_trace(path, a.mb)
    raw = path.read_bytes()
    events = tmp / "events.json"  # the same events as a top-level array, which DuckDB reads record by record
    events.write_bytes(b"[" + raw[raw.index(b"[", raw.index(b'"traceEvents"')) + 1 : raw.rindex(b"]")] + b"]")
    del raw
    con = duckdb.connect()
    con.execute("SET threads = 1")
    query = (
        f"SELECT cat, name, ts, dur, pid, tid, args.correlation, args.device, args.bytes FROM read_json("
        f"'{events}', format = 'array', columns = {DUCKDB_EVENT_COLUMNS}, maximum_object_size = 67108864)"
    )
    ours, plain, duck = [], [], []
    native = trace_json.native_scan
    for _ in range(a.repeats):
        for scanner, times in ((native, ours), (None, plain)):
            trace_json.native_scan = scanner
            t = time.process_time()
            with path.open("rb") as fh:
                read_file(fh, 1 << 40)
            times.append(time.process_time() - t)
        trace_json.native_scan = native
        t = time.process_time()
        rows = con.sql(query).to_arrow_table().num_rows
        duck.append(time.process_time() - t)
    o, p, d = statistics.median(ours), statistics.median(plain), statistics.median(duck)
    print(
        f"trace: {size / 1e6:.0f} MB of JSON, {rows:,} events; CPU time, median of {a.repeats}, alternating in one process"
    )
    what = "native scanner" if native is not None else "native scanner NOT BUILT: msgspec"
    print(f"{f'lockstep trace_json.read_file ({what})':44s} {size / 1e6 / o:7.1f} MB/s per core  cpu {o:6.2f} s")
    print(
        f"{'lockstep trace_json.read_file (msgspec)':44s} {size / 1e6 / p:7.1f} MB/s per core  cpu {p:6.2f} s  ({p / o:.1f}x slower)"
    )
    print(
        f"{'DuckDB read_json, threads=1 (columns only)':44s} {size / 1e6 / d:7.1f} MB/s per core  cpu {d:6.2f} s  ({o / d:.1f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--mb", type=float, default=200)
    s.add_argument("--repeats", type=int, default=1)
    s.add_argument("--no-hta", action="store_true")
    b = sub.add_parser("big")
    b.add_argument("--mb", type=float, nargs="+", default=[2048], help="trace sizes, each measured in turn")
    b.add_argument("--bomb-gib", type=float, default=4.0)
    r = sub.add_parser("ranks")
    r.add_argument("--files", type=int, default=1024)
    r.add_argument("--mb", type=float, default=1.0, help="size of each rank's trace")
    r.add_argument("--slow", type=int, default=7)
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    d = sub.add_parser("decoders")
    d.add_argument("--mb", type=float, default=100)
    d.add_argument("--repeats", type=int, default=5)
    for p in (s, b, r, d):
        p.add_argument("--tmp", type=Path, default=None, help="where to write the traces (default: a temporary folder)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-bench-", dir=a.tmp))
    try:
        {"speed": speed, "big": big, "ranks": ranks, "decoders": decoders}[a.what](a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
