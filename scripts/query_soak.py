"""The sink under hostile queries: the real ``lockstep sink`` (its own process, an embedded broker, a DuckDB store
with findings of three tenants) answers a rotating mix of hostile ``/query`` requests for a while, and its resident
memory is sampled throughout.

The mix (RELIABILITY.md, "Hostile input"): results too large in bytes (many wide rows, one huge value, a list of
millions, rows of 100 KB), results too large in rows, memory-hungry aggregates (``list(range)`` of 10^9), a query
that never ends, deep JSON text (made, cast, and stored), forbidden statements, a result at the bound (~61 MB, 100,000
rows), normal queries per tenant (their counts checked: tenant isolation), a bad token, a body that is not JSON and
one over the body limit; beside them, idle connections past the connection limit, slowloris connections that send
their headers a byte at a time, and ``/healthz`` polled every half second.  Every answer must be one of the expected
ones for its case (a refusal with its one-line reason, 503 "ask again" when both query slots are busy, or the
bounded answer); ``/healthz`` must answer 200 every time; the sink must stay up.

    python scripts/query_soak.py --seconds 600 --seed 1     # the 10-minute run RELIABILITY.md quotes

Prints one JSON line: requests by case and outcome, unexpected answers (the first few), health polls and failures,
peak RSS of the sink in MiB (sampled, and the kernel's high-water mark) and the bound.  Exit 0 when every answer was
expected, /healthz always answered and the peak stayed under ``--bound-mib``; 1 otherwise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lockstep.app.runtime import Pipeline
from lockstep.broker import EmbeddedBroker
from lockstep.config import Settings
from lockstep.schemas.records import Evidence, Finding, Impact
from lockstep.sinks.http import sidecar
from lockstep.sinks.store import Batch, FindingsStore

TENANTS = ("acme", "globex", None)
CAUSES = ("gpu_slow", "cpu_contention", "network_slow", "input_slow")


@dataclass(frozen=True)
class Answer:
    status: int
    size: int  # bytes of the body
    error: str  # the refusal's message ("" for 200)
    rows: int  # rows of a 200 answer (-1 when not parsed: a large answer is only counted)
    body: object = None


@dataclass(frozen=True)
class Case:
    name: str
    weight: float
    send: Callable[[Soak], Answer]
    accept: Callable[[Answer], bool]


def _refused(*needles: str) -> Callable[[Answer], bool]:
    return lambda a: a.status == 400 and any(n in a.error for n in needles) and "\n" not in a.error


def _busy(a: Answer) -> bool:
    """503, ask again: both query slots taken, the HTTP worker pool's queue full, or every connection held."""
    return a.status == 503 and any(
        n in a.error for n in ("queries are running", "too many requests at once", "too many connections")
    )


class Soak:
    def __init__(self, url: str, token: str, rng: random.Random, expected_counts: dict[str | None, dict[str, int]]):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.token = token
        self.rng = rng
        self.expected_counts = expected_counts

    def request(
        self, method: str, path: str, body: bytes | None = None, token: str | None = None, timeout_s: float = 60
    ) -> Answer:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=timeout_s)
        try:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token or self.token}"}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data, size = bytearray(), 0
            while chunk := resp.read(1 << 20):
                size += len(chunk)
                if size <= 1 << 20:  # a large answer is counted, not kept
                    data += chunk
            parsed: object = None
            if size <= 1 << 20:
                try:
                    parsed = json.loads(data)
                except ValueError:
                    parsed = None
            error = parsed.get("error", "") if isinstance(parsed, dict) else ""
            if resp.status != 200 and not error:
                error = bytes(data[:300]).decode(errors="replace")
            rows = len(parsed["rows"]) if isinstance(parsed, dict) and "rows" in parsed else -1
            return Answer(resp.status, size, error, rows, parsed)
        finally:
            conn.close()

    def query(self, sql: str, tenant: str | None = None, params: list | None = None) -> Answer:
        return self.request("POST", "/query", json.dumps({"sql": sql, "tenant": tenant, "params": params}).encode())


def _normal(s: Soak) -> Answer:
    tenant = s.rng.choice(TENANTS)
    a = s.query("SELECT cause, count(*) FROM findings GROUP BY cause ORDER BY cause", tenant)
    if a.status == 200 and isinstance(a.body, dict):  # the tenant sees its rows, and only those
        got = dict(a.body["rows"])
        return Answer(a.status, a.size, "" if got == s.expected_counts[tenant] else f"counts {got}", a.rows, None)
    return a


CASES = [
    Case(
        "wide_rows",
        3,
        lambda s: s.query("SELECT repeat('x', 30000) || range FROM range(100000)", s.rng.choice(TENANTS)),
        lambda a: _refused("larger than 64 MiB")(a),
    ),
    Case(
        "rows_of_100kb",
        1,
        lambda s: s.query("SELECT repeat('x', 100000) || range FROM range(100000)", s.rng.choice(TENANTS)),
        lambda a: _refused("larger than 64 MiB", "needs more than")(a),
    ),
    Case(
        "one_huge_value",
        1,
        lambda s: s.query("SELECT repeat('x', 200000000) AS s", s.rng.choice(TENANTS)),
        lambda a: _refused("larger than 64 MiB", "needs more than")(a),
    ),
    Case(
        "list_of_millions",
        1,
        lambda s: s.query("SELECT list(range) FROM range(20000000)", s.rng.choice(TENANTS)),
        lambda a: _refused("larger than 64 MiB", "needs more than")(a),
    ),
    Case(
        "list_of_1e9",
        1,
        lambda s: s.query(
            s.rng.choice(
                (
                    "SELECT list(range) FROM range(1000000000)",
                    "SELECT k, list(range) FROM (SELECT range % 1000 AS k, range FROM range(1000000000)) GROUP BY k",
                )
            ),
            s.rng.choice(TENANTS),
        ),
        lambda a: _refused("needs more than 1024 MiB", "longer than 20 s")(a),
    ),
    Case(
        "never_ends",
        0.3,
        lambda s: s.query("SELECT count(*) FROM range(1000000000000)", s.rng.choice(TENANTS)),
        lambda a: _refused("longer than 20 s")(a),
    ),
    Case(
        "too_many_rows",
        2,
        lambda s: s.query("SELECT range FROM range(100001)", s.rng.choice(TENANTS)),
        lambda a: _refused("more than 100000 rows")(a),
    ),
    Case(
        "at_the_bound",
        1,
        lambda s: s.query("SELECT repeat('x', 600) || range AS s FROM range(100000)", s.rng.choice(TENANTS)),
        lambda a: a.status == 200 and 60_000_000 < a.size < 80_000_000,
    ),
    Case(
        "deep_json",
        2,
        lambda s: s.query(
            s.rng.choice(
                (
                    "SELECT repeat('[', 50000) AS s",
                    "SELECT json_extract(repeat('[', 50000), '$') AS s",
                    "SELECT function, evidence FROM findings WHERE function LIKE '[[[%'",
                )
            ),
            s.rng.choice(TENANTS),
        ),
        lambda a: a.status == 200 or (a.status == 400 and "\n" not in a.error),
    ),
    Case(
        "forbidden",
        2,
        lambda s: s.query(
            s.rng.choice(
                (
                    "SELECT * FROM read_text('/proc/self/environ')",
                    "COPY findings TO '/tmp/lockstep-soak-copy.csv'",
                    "PRAGMA database_list",
                    "ATTACH '/tmp/lockstep-soak.duckdb' AS x",
                    "SELECT 1; DELETE FROM findings",
                    "EXPLAIN ANALYZE DELETE FROM findings",
                )
            ),
            s.rng.choice(TENANTS),
        ),
        lambda a: a.status == 400 and "\n" not in a.error and a.error != "",
    ),
    Case("normal", 4, _normal, lambda a: a.status == 200 and a.error == ""),
    Case("bad_token", 0.5, lambda s: s.request("POST", "/query", b"{}", token="wrong"), lambda a: a.status == 401),
    Case("not_json", 0.5, lambda s: s.request("POST", "/query", b"SELECT 1"), lambda a: a.status == 400),
    Case(
        "body_over_the_limit",
        0.3,
        lambda s: s.request("POST", "/query", json.dumps({"sql": "SELECT 1" + " " * (2 << 20)}).encode()),
        lambda a: a.status in (400, 413),
    ),
]


def _seed(db: Path, n: int, rng: random.Random) -> dict[str | None, dict[str, int]]:
    """Findings of three tenants (one whose function is 50,000 ``[``); the counts by cause each tenant must see."""
    findings, counts = [], {t: Counter() for t in TENANTS}
    for i in range(n):
        tenant, cause = TENANTS[i % 3], rng.choice(CAUSES)  # the third: no tenant
        findings.append(
            Finding(
                id=f"f{i}",
                job=f"job{i % 50}",
                window=f"w{i}",
                steps=[i],
                scope="worker",
                workers=[i % 64],
                hosts=[f"h{i % 8}"],
                devices=[f"h{i % 8}/gpu0"],
                function="[" * 50_000 if i == 0 else f"fn{i % 97}",
                function_kind="compute",
                cause=cause,
                confidence=0.9,
                evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
                impact=Impact(step_time_share=0.1, gpu_hours_per_day=1.0),
                policy="p",
                created_at=1.7e9 + i,
                tenant=tenant or "",
            )
        )
        counts[tenant][cause] += 1
    store = FindingsStore(db)
    try:
        store.write(Batch(findings=findings, windows=[], offsets={}))
    finally:
        store.close()
    counts[None] = sum((Counter(c) for c in counts.values()), Counter())  # no tenant: every row
    return {t: dict(c) for t, c in counts.items()}


def _rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _idle_wave(host: str, port: int, n: int, hold_s: float, stop: threading.Event) -> None:
    """``n`` connections that send nothing, held ``hold_s``: past the connection limit (64) the others are refused."""
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection((host, port), timeout=5))
        stop.wait(hold_s)
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()


def _slowloris(host: str, port: int, n: int, seconds: float, stop: threading.Event) -> None:
    """``n`` connections sending a request's headers a byte at a time, every 0.5 s, for ``seconds``."""
    request = b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 200
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection((host, port), timeout=5))
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end and i < len(request) and not stop.is_set():
            for s in list(socks):
                try:
                    s.send(request[i : i + 1])
                except OSError:
                    socks.remove(s)  # the server closed it (its header timeout)
            i += 1
            stop.wait(0.5)
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()


def run(seconds: float, seed: int, workers: int, bound_mib: float, findings: int, log_dir: Path) -> dict:
    rng = random.Random(seed)
    db = log_dir / "findings.duckdb"
    expected = _seed(db, findings, rng)
    with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
        settings = Settings(
            bootstrap_servers=broker.bootstrap_servers,
            topic_prefix="soak",
            sink_group="soak-sink",
            partitions=1,
            db=db,
        )
        pipeline = Pipeline(settings, log_dir)
        sink = pipeline.start("sink", timeout_s=120)
        pid = sink.proc.pid
        announced = json.loads(sidecar(db).read_text())
        url = announced["url"]
        host, port = url.removeprefix("http://").split(":")
        base_rss = _rss_mb(pid, "VmRSS")
        stop = threading.Event()
        lock = threading.Lock()
        outcomes: Counter[str] = Counter()
        unexpected: list[dict] = []
        health = Counter()
        peak = [base_rss]

        def worker(i: int) -> None:
            soak = Soak(url, announced["token"], random.Random(seed * 1000 + i), expected)
            weights = [c.weight for c in CASES]
            while not stop.is_set():
                case = soak.rng.choices(CASES, weights)[0]
                try:
                    answer = case.send(soak)
                    ok = case.accept(answer) or _busy(answer)  # any request may be told to ask again
                    what = f"{answer.status}"
                except (OSError, http.client.HTTPException) as exc:
                    ok, what, answer = False, type(exc).__name__, Answer(0, 0, str(exc), -1)
                with lock:
                    outcomes[f"{case.name} {what}"] += 1
                    if not ok and len(unexpected) < 20:
                        unexpected.append({"case": case.name, "status": answer.status, "error": answer.error[:300]})
                    if not ok:
                        outcomes["unexpected"] += 1
                if answer.status == 503:
                    stop.wait(1.0)  # its Retry-After

        def poll_health() -> None:
            soak = Soak(url, announced["token"], random.Random(seed), expected)
            while not stop.is_set():
                try:
                    a = soak.request("GET", "/healthz", timeout_s=10)
                    health["ok" if a.status == 200 else f"status {a.status}"] += 1
                except (OSError, http.client.HTTPException) as exc:
                    health[type(exc).__name__] += 1
                stop.wait(0.5)

        def sample_rss() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], _rss_mb(pid, "VmRSS"))
                except OSError:
                    return
                stop.wait(0.2)

        def connections() -> None:
            r = random.Random(seed + 7)
            while not stop.is_set():
                if r.random() < 0.5:
                    _idle_wave(host, int(port), 70, 20.0, stop)
                else:
                    _slowloris(host, int(port), 20, 20.0, stop)
                stop.wait(5.0)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
        threads += [threading.Thread(target=f, daemon=True) for f in (poll_health, sample_rss, connections)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - t0 < seconds and sink.alive():
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(90)
        alive = sink.alive()
        final = Soak(url, announced["token"], rng, expected).query("SELECT count(*) FROM findings") if alive else None
        hwm = _rss_mb(pid, "VmHWM") if alive else 0.0
        pipeline.stop()
    health_failures = sum(n for k, n in health.items() if k != "ok")
    result = {
        "seconds": round(time.monotonic() - t0, 1),
        "seed": seed,
        "workers": workers,
        "requests": sum(n for k, n in outcomes.items() if k != "unexpected"),
        "outcomes": dict(sorted(outcomes.items())),
        "unexpected": unexpected,
        "health_polls": dict(health),
        "sink_alive": alive,
        "final_query_rows": final.body["rows"] if final is not None and isinstance(final.body, dict) else None,
        "rss_start_mib": round(base_rss),
        "peak_rss_mib": round(max(peak[0], hwm)),
        "bound_mib": bound_mib,
    }
    result["ok"] = bool(
        alive
        and outcomes["unexpected"] == 0
        and health_failures == 0
        and result["final_query_rows"] == [[findings]]
        and result["peak_rss_mib"] <= bound_mib
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4, help="clients sending queries at once (the sink runs 2)")
    p.add_argument("--bound-mib", type=float, default=4096.0, help="the most resident memory the sink may reach")
    p.add_argument("--findings", type=int, default=3000, help="findings in the store (three tenants)")
    p.add_argument("--log-dir", type=Path, help="keep the sink's and the broker's logs and the store here")
    args = p.parse_args(argv)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        result = run(args.seconds, args.seed, args.workers, args.bound_mib, args.findings, args.log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="lockstep-soak-") as d:
            result = run(args.seconds, args.seed, args.workers, args.bound_mib, args.findings, Path(d))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
