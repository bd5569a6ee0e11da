"""Findings store: sink transactions (upserts + incidents + offsets) and tenant-restricted queries.

    .venv/bin/python benchmarks/store.py [--findings 20000] [--batch 500] [--tenants 10] [--repeat 5]

Writes ``--findings`` findings (jobs spread over ``--tenants`` tenants, a window report per finding)
in sink-sized batches to a fresh DuckDB file and prints the median findings per second of one
``FindingsStore.write`` (one transaction: known-id lookup, incidents, upserts, window checks,
offsets).  Then the median latency of one query, plain and with ``tenant=`` (which builds the
tenant sandbox: a copy of that tenant's rows), on the full file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lockstep.schemas.records import Evidence, Finding, Impact, WindowReport
from lockstep.sinks.store import Batch, FindingsStore, open_read_only, run_query


def records(i: int, tenants: int) -> tuple[Finding, WindowReport]:
    job, tenant, window = f"job{i % 200}", f"tenant{i % tenants}", f"w{i}"
    f = Finding(
        id=f"f{i}",
        job=job,
        window=window,
        steps=[i * 10, i * 10 + 1],
        scope="worker",
        workers=[i % 64],
        hosts=[f"h{i % 8}"],
        devices=[f"h{i % 8}/gpu{i % 64 % 8}"],
        function="bwd.gemm",
        function_kind="compute",
        cause="gpu_slow",
        confidence=0.9,
        evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=24.0),
        policy="p",
        created_at=1_800_000_000.0 + i,
        tenant=tenant,
    )
    w = WindowReport(
        job=job,
        window=window,
        start_step=i * 10,
        steps=2,
        steps_seen=2,
        expected_workers=64,
        workers_seen=64,
        coverage=1.0,
        bytes_per_worker=15000.0,
        findings=1,
        actionable=True,
        reached_device=True,
        closed="complete",
        closed_at=1_800_000_000.0 + i,
        tenant=tenant,
    )
    return f, w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--findings", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="lockstep-bench-")) / "f.duckdb"
    store = FindingsStore(path)
    rates = []
    for start in range(0, a.findings, a.batch):
        recs = [records(i, a.tenants) for i in range(start, min(a.findings, start + a.batch))]
        batch = Batch([f for f, _ in recs], [w for _, w in recs], {("bench.findings", 0): start + len(recs)})
        t0 = time.perf_counter()
        store.write(batch)
        rates.append(len(recs) / (time.perf_counter() - t0))
    incidents = store.con.execute("SELECT count(*) FROM incidents").fetchone()[0]
    store.close()
    print(
        f"sink write: median {statistics.median(rates):,.0f} findings/s per transaction of {a.batch} "
        f"(+{a.batch} window reports), {a.findings} findings, {incidents} incidents, {a.tenants} tenants"
    )

    con = open_read_only(path)
    sql = "SELECT cause, count(*) AS n, sum(gpu_hours_per_day) FROM findings GROUP BY cause"
    for tenant in (None, "tenant0"):
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            run_query(con, sql, tenant=tenant)
            times.append(time.perf_counter() - t0)
        what = "plain" if tenant is None else f"--tenant ({a.findings // a.tenants} of {a.findings} findings copied)"
        print(f"query {what}: median {statistics.median(times) * 1000:.1f} ms over {a.repeat}")
    con.close()


if __name__ == "__main__":
    main()
