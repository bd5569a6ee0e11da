"""The DuckDB store on a real file: upserts, offsets in the same transaction, read-only access."""

import json
import urllib.error
import urllib.request

import duckdb
import pytest

from lockstep.schemas.records import Evidence, Finding, Impact, WindowReport
from lockstep.sinks.http import query, sidecar
from lockstep.sinks.store import Batch, FindingsStore, StoreError, open_read_only, tenant_sandbox


def finding(fid="f1", conf=0.9, steps=(1, 2, 3), cause="gpu_slow", job="j"):
    return Finding(
        id=fid,
        job=job,
        window="w1",
        steps=list(steps),
        scope="worker",
        workers=[3],
        hosts=["h"],
        devices=["h/gpu3"],
        function="fwd",
        function_kind="compute",
        cause=cause,
        confidence=conf,
        evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=2.4),
        policy="p@h",
        created_at=1_800_000_000.0,
        group={"pp": "1"},
    )


def window(job="j"):
    return WindowReport(
        job=job,
        window="w1",
        start_step=1,
        steps=8,
        steps_seen=8,
        expected_workers=4,
        workers_seen=4,
        coverage=1.0,
        bytes_per_worker=10.0,
        findings=1,
        actionable=True,
        reached_device=True,
        closed="complete",
        closed_at=1_800_000_000.0,
    )


def test_replayed_findings_upsert_instead_of_duplicating(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([finding(conf=0.5)], [window()], {("t.findings", 0): 1}), now=100.0)
    store.write(Batch([finding(conf=0.8), finding(conf=0.9)], [window(), window()], {("t.findings", 0): 3}), now=200.0)
    rows = store.con.execute(
        "SELECT id, confidence, epoch(first_seen), epoch(updated_at), peer_group['pp'] FROM findings"
    ).fetchall()
    assert rows == [("f1", 0.9, 100.0, 200.0, "1")]
    assert store.con.execute("SELECT count(*) FROM windows").fetchone()[0] == 1
    assert store.offsets() == {("t.findings", 0): 3}
    record = json.loads(store.con.execute("SELECT record FROM findings").fetchone()[0])
    assert record["schema"] == "Finding" and record["window"] == "w1" and record["group"] == {"pp": "1"}


def test_an_undetermined_finding_is_stored_with_its_unmeasured_evidence(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    f = finding(cause="undetermined")
    f.evidence.append(Evidence(feature="sm_clock_mhz", value=None, peer_value=None, deviation=None))
    store.write(Batch([f], [window()], {("t.findings", 0): 1}))
    cause, evidence = store.con.execute("SELECT cause, evidence FROM findings").fetchone()
    assert cause == "undetermined" and json.loads(evidence)[1] == {
        "feature": "sm_clock_mhz",
        "value": None,
        "peer_value": None,
        "deviation": None,
    }
    assert store.con.execute("SELECT count(*) FROM incidents WHERE cause = 'undetermined'").fetchone()[0] == 1


def test_rows_and_offsets_commit_together(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    store.write(Batch([finding()], [], {("t.findings", 0): 1}))
    bad = finding(fid="f2")
    bad.steps = "not a list"  # makes the Arrow conversion fail mid-transaction
    with pytest.raises(TypeError):
        store.write(Batch([bad], [], {("t.findings", 0): 2}))
    assert store.offsets() == {("t.findings", 0): 1}
    assert store.con.execute("SELECT count(*) FROM findings").fetchone()[0] == 1


def test_migrations_are_versioned_and_idempotent(tmp_path):
    path = tmp_path / "f.duckdb"
    FindingsStore(path).close()
    store = FindingsStore(path)
    assert store.con.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall() == [
        (1,),
        (2,),
        (3,),
        (4,),
        (5,),
        (6,),
        (7,),
    ]


def test_query_refuses_writes(tmp_path):
    path = tmp_path / "f.duckdb"
    FindingsStore(path).close()
    for sql in (
        "DELETE FROM findings",
        "INSERT INTO findings (id) VALUES ('x')",
        "DROP TABLE findings",
        "COPY findings TO 'x.csv'",
        "SELECT 1; DELETE FROM findings",
    ):
        with pytest.raises(StoreError, match="read-only"):
            query(path, sql)
    with pytest.raises(StoreError, match="does not parse"):
        query(path, "SELEC nonsense")


WRITER = """
import importlib.util, signal, sys, time, threading
spec = importlib.util.spec_from_file_location("store_test", {this!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
finding, window = mod.finding, mod.window
from lockstep.metrics import Metrics
from lockstep.sinks.http import QueryServer
from lockstep.sinks.store import Batch, FindingsStore

store = FindingsStore({path!r})
store.write(Batch([finding()], [window()], {{}}))

class Holder:  # what the query server needs of a sink
    def __init__(self):
        self.store, self.metrics, self.assigned = store, Metrics(), True

server = QueryServer(Holder(), {path!r}).start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
print("ready", flush=True)
i = 0
while not stop.is_set():  # keep writing while readers read
    store.write(Batch([finding(fid=f"g{{i}}")], [], {{}}))
    i += 1
    time.sleep(0.02)
server.stop()
store.close()
"""


@pytest.mark.slow  # a sink in another process
def test_query_works_while_another_process_holds_the_file(tmp_path):
    import pathlib
    import signal
    import subprocess
    import sys

    path = tmp_path / "f.duckdb"
    script = WRITER.format(this=str(pathlib.Path(__file__).resolve()), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path), read_only=True)  # what a second process meets without the sink's help
        cols, rows = query(path, "SELECT id, cause FROM findings WHERE id = 'f1'")
        assert cols == ["id", "cause"] and rows == [["f1", "gpu_slow"]]
        with pytest.raises(StoreError, match="read-only"):
            query(path, "DELETE FROM findings")
        url = json.loads(sidecar(path).read_text())["url"]
        with urllib.request.urlopen(url + "/healthz") as r:
            assert json.loads(r.read())["status"] == "ok"
        counts = [query(path, "SELECT count(*) FROM findings")[1][0][0] for _ in range(5)]
        assert counts == sorted(counts) and counts[0] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert not sidecar(path).exists()
    final = query(path, "SELECT count(*) FROM findings")[1][0][0]  # directly, once the sink is gone
    assert final >= counts[-1]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_read_only(tmp_path / "nope.duckdb")


# ------------------------------------------------------------------ version 2: triggers, incidents, views, tenants


def test_migrates_a_version_1_file_and_builds_its_incidents(tmp_path):
    from lockstep.sinks.store import MIGRATIONS, findings_table, windows_table

    path = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(path))  # a file exactly as version 1 of the sink left it
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)"
    )
    con.execute(MIGRATIONS[0][2])
    con.execute("INSERT INTO schema_migrations VALUES (1, ?, now())", [MIGRATIONS[0][1]])
    v1_findings = [c[0] for c in con.execute("DESCRIBE findings").fetchall()]
    v1_windows = [c[0] for c in con.execute("DESCRIBE windows").fetchall()]
    ftab = findings_table([finding()], 100.0).select(v1_findings)  # noqa: F841
    wtab = windows_table([window()]).select(v1_windows)  # noqa: F841
    con.execute("INSERT INTO findings SELECT * FROM ftab")
    con.execute("INSERT INTO windows SELECT * FROM wtab")
    con.close()

    store = FindingsStore(path)
    assert store.con.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall() == [
        (1,),
        (2,),
        (3,),
        (4,),
        (5,),
        (6,),
        (7,),
    ]
    inc = store.con.execute("SELECT id, status, first_finding, windows FROM incidents").fetchall()
    assert len(inc) == 1 and inc[0][1:] == ("open", "f1", 1)
    # migration 5: the first window and step of each incident, from its first finding
    assert store.con.execute("SELECT first_window, first_step, resolved_reason FROM incidents").fetchall() == [
        (finding().window, min(finding().steps), None)
    ]
    assert store.con.execute("SELECT incident_id FROM findings").fetchall() == [(inc[0][0],)]
    assert store.con.execute("SELECT profiling_overhead, incidents_checked FROM windows").fetchall() == [(None, True)]
    assert store.con.execute("SELECT count(*) FROM incident_events").fetchone()[0] == 0  # history is not paged
    assert store.con.execute("SELECT id FROM open_findings").fetchall() == [("f1",)]
    store.write(Batch([finding(fid="f2")], [], {}))  # and it keeps working
    store.close()
    assert FindingsStore(path).con.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] == len(MIGRATIONS)


def test_profiling_triggers_are_stored(tmp_path):
    from lockstep.schemas.records import ProfileTrigger

    store = FindingsStore(tmp_path / "f.duckdb")
    t = ProfileTrigger(
        job="j",
        window="w1",
        start_step=100,
        steps=8,
        expected_workers=64,
        policy="default",
        policy_hash="abc",
        reason="step time +25%",
        created_at=1_800_000_000.0,
        tenant="acme",
        kind="baseline",
    )
    store.write(Batch([], [], {("t.control", 0): 1}, triggers=[t, t]))
    row = store.con.execute(
        "SELECT job, window_id, tenant, start_step, steps, policy, reason, hardware_hz, epoch(created_at), kind FROM triggers"
    ).fetchall()
    assert row == [("j", "w1", "acme", 100, 8, "default@abc", "step time +25%", 100.0, 1_800_000_000.0, "baseline")]


def test_a_version_2_file_learns_each_triggers_kind_from_its_reason(tmp_path):
    from lockstep.sinks.store import MIGRATIONS

    path = tmp_path / "v2.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)"
    )
    for version, description, sql in MIGRATIONS[:2]:
        con.execute(sql)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, now())", [version, description])
    for window, reason in (
        ("w1", "slowdown: median of last 5 steps ..."),
        ("w2", "manual (by ops)"),
        ("w3", "hang: no progress"),
        ("w4", "odd"),
    ):
        con.execute("INSERT INTO triggers (job, window_id, tenant, reason) VALUES ('j', ?, '', ?)", [window, reason])
    con.close()
    store = FindingsStore(path)
    kinds = store.con.execute("SELECT window_id, kind FROM triggers ORDER BY window_id").fetchall()
    assert kinds == [("w1", "slowdown"), ("w2", "manual"), ("w3", "hang"), ("w4", None)]


def fnd(
    fid,
    job="j",
    window_="w1",
    steps=(100, 101),
    workers=(3,),
    devices=("h1/gpu3",),
    hosts=("h1",),
    cause="gpu_slow",
    function="fwd",
    tenant="acme",
    gpu_hours=24.0,
    created_at=1_800_000_000.0,
):
    return Finding(
        id=fid,
        job=job,
        window=window_,
        steps=list(steps),
        scope="worker",
        workers=list(workers),
        hosts=list(hosts),
        devices=list(devices),
        function=function,
        function_kind="compute",
        cause=cause,
        confidence=0.9,
        evidence=[Evidence(feature="work_us", value=2.0, peer_value=1.0, deviation=5.0)],
        impact=Impact(step_time_share=0.1, gpu_hours_per_day=gpu_hours),
        policy="p",
        created_at=created_at,
        tenant=tenant,
    )


def win(job, window_, start, findings=0, coverage=1.0, tenant="acme", overhead=None):
    return WindowReport(
        job=job,
        window=window_,
        start_step=start,
        steps=2,
        steps_seen=2,
        expected_workers=8,
        workers_seen=8,
        coverage=coverage,
        bytes_per_worker=1024.0,
        findings=findings,
        actionable=findings > 0,
        reached_device=findings > 0,
        closed="complete",
        closed_at=1_800_000_000.0 + start,
        tenant=tenant,
        profiling_overhead=overhead,
    )


def test_a_window_report_that_arrives_before_its_findings_resolves_nothing(tmp_path):
    store = FindingsStore(tmp_path / "f.duckdb")
    events = store.write(Batch([fnd("a1", window_="w1")], [win("j", "w1", 100, findings=1)], {}))
    assert [e.action for e in events] == ["trigger"]
    # w2's report comes first (other topic); its finding, the same problem, comes in the next batch
    assert store.write(Batch([], [win("j", "w2", 200, findings=1)], {})) == []
    events = store.write(Batch([fnd("a2", window_="w2", steps=(200, 201), function="bwd")], [], {}))
    assert [e.action for e in events] == ["update"]  # the same incident: a device cause ignores which kernel
    assert store.con.execute("SELECT status, windows, last_finding FROM incidents").fetchall() == [("open", 2, "a2")]
    # a window that is complete and does not show it resolves it
    events = store.write(Batch([], [win("j", "w3", 300)], {}))
    assert [(e.action, e.reason) for e in events] == [("resolve", "w3")]


def test_stale_incidents_resolve_after_the_timeout(tmp_path):
    from lockstep.sinks.paging.incidents import IncidentPolicy

    store = FindingsStore(tmp_path / "f.duckdb", IncidentPolicy(stale_after_s=3600))
    store.write(Batch([fnd("a1", created_at=1_000_000.0)], [], {}))
    assert store.expire(now=1_000_000.0 + 3599) == []
    (ev,) = store.expire(now=1_000_000.0 + 3600)
    assert (ev.action, ev.reason) == ("resolve", "stale")
    assert store.con.execute("SELECT status, resolved_by FROM incidents").fetchall() == [("resolved", "stale")]


def two_tenants(path):
    store = FindingsStore(path)
    store.write(
        Batch(
            [
                fnd("a1", job="ja", cause="gpu_throttle_thermal", gpu_hours=48.0),
                fnd(
                    "a2",
                    job="ja",
                    workers=(9, 10),
                    devices=("h2/gpu1", "h2/gpu2"),
                    hosts=("h2",),
                    cause="pcie",
                    gpu_hours=12.0,
                ),
                fnd("a3", job="ja", window_="w2", steps=(200, 201), cause="gpu_throttle_thermal", gpu_hours=50.0),
                fnd(
                    "b1",
                    job="jb",
                    workers=(1,),
                    devices=("x9/gpu1",),
                    hosts=("x9",),
                    cause="dataloader",
                    function="secret_loader",
                    tenant="globex",
                ),
            ],
            [
                win("ja", "w1", 100, findings=2, overhead=0.01),
                win("ja", "w2", 200, findings=1, overhead=0.03),
                win("ja", "w3", 300, coverage=0.95),
                win("jb", "v1", 100, findings=1, tenant="globex"),
            ],
            {("t.findings", 0): 4},
        )
    )
    return store


def test_views(tmp_path):
    store = two_tenants(tmp_path / "f.duckdb")
    q = lambda sql: store.con.execute(sql).fetchall()  # noqa: E731
    # w2 saw the throttled GPU again but not the PCIe link; w3 (95% coverage) saw neither
    assert q("SELECT cause, status, windows, resolved_by FROM incidents ORDER BY cause") == [
        ("dataloader", "open", 1, None),
        ("gpu_throttle_thermal", "resolved", 2, "w3"),
        ("pcie", "resolved", 1, "w2"),
    ]
    assert q("SELECT id, tenant, windows_seen FROM open_findings") == [("b1", "globex", 1)]
    assert q(
        "SELECT tenant, host, device, incidents, open_incidents, findings, causes FROM top_culprits ORDER BY findings DESC, device"
    ) == [
        ("acme", "h1", "h1/gpu3", 1, 0, 2, ["gpu_throttle_thermal"]),
        ("acme", "h2", "h2/gpu1", 1, 0, 1, ["pcie"]),
        ("acme", "h2", "h2/gpu2", 1, 0, 1, ["pcie"]),
        ("globex", "x9", "x9/gpu1", 1, 1, 1, ["dataloader"]),
    ]
    lost = {
        r[1]: r
        for r in q(
            "SELECT tenant, cause, incidents, open_incidents, gpu_hours_per_day, round(gpu_hours_lost, 6) FROM gpu_hours_lost_by_cause"
        )
    }
    # the throttle: 50 GPU-h/day from the first finding (t=1.8e9) to w3's close (t=1.8e9+300 s)
    assert lost["gpu_throttle_thermal"] == ("acme", "gpu_throttle_thermal", 1, 0, 0.0, round(50.0 * 300 / 86400, 6))
    assert lost["dataloader"][3:5] == (1, 24.0)
    cov = q(
        "SELECT job, windows, mean_coverage, min_coverage, mean_bytes_per_worker, round(mean_profiling_overhead, 3), timed_out FROM coverage_by_job ORDER BY job"
    )
    assert cov == [
        ("ja", 3, pytest.approx((1 + 1 + 0.95) / 3), 0.95, 1024.0, 0.02, 0),
        ("jb", 1, 1.0, 1.0, 1024.0, None, 0),
    ]
    assert q(
        "SELECT job, windows, actionable_windows, round(actionable_share, 3) FROM actionable_share ORDER BY job"
    ) == [("ja", 3, 2, 0.667), ("jb", 1, 1, 1.0)]


BYPASSES = [
    "SELECT * FROM findings WHERE tenant <> 'acme'",
    "SELECT * FROM top_culprits WHERE tenant <> 'acme'",
    "SELECT * FROM incidents WHERE tenant <> 'acme'",
]
REFUSED = [
    ("SELECT * FROM sink_offsets", "sink_offsets"),
    ("SELECT * FROM query('SELECT * FROM findings') WHERE tenant <> 'acme'", "disabled"),
    ("SELECT * FROM read_blob('{path}')", "disabled"),
    ("SELECT * FROM read_csv('{path}')", "disabled"),
    ("ATTACH '{path}' AS other", "read-only"),
    ("SET enable_external_access = true", "read-only"),
]


def check_tenant_restriction(path, ask):
    _, rows = ask("SELECT id, tenant FROM findings ORDER BY id", "acme")
    assert rows == [["a1", "acme"], ["a2", "acme"], ["a3", "acme"]]
    assert ask("SELECT id FROM findings ORDER BY id", None)[1] == [["a1"], ["a2"], ["a3"], ["b1"]]
    assert ask("SELECT id FROM open_findings", "globex")[1] == [["b1"]]
    assert ask("SELECT count(*) FROM windows", "globex")[1] == [[1]]
    for sql in BYPASSES:
        assert ask(sql, "acme")[1] == [], sql
    assert ask("SELECT count(*) FROM findings WHERE function = 'secret_loader'", "acme")[1] == [[0]]
    assert "sink_offsets" not in {r[0] for r in ask("SELECT table_name FROM duckdb_tables()", "acme")[1]}
    for sql, needle in REFUSED:
        with pytest.raises(StoreError, match=needle):
            ask(sql.format(path=path), "acme")


def test_tenant_restriction_on_the_file(tmp_path):
    from lockstep.sinks.store import tenant_sandbox

    path = tmp_path / "f.duckdb"
    two_tenants(path).close()
    check_tenant_restriction(path, lambda sql, tenant: query(path, sql, tenant=tenant))
    src = open_read_only(path)
    box = tenant_sandbox(src, "acme")
    everything = src.sql("SELECT * FROM findings").to_arrow_table()  # noqa: F841 - what a replacement scan would find
    with pytest.raises(duckdb.CatalogException, match="everything"):
        box.execute("SELECT * FROM everything")


TENANT_SINK = """
import importlib.util, signal, threading
spec = importlib.util.spec_from_file_location("store_test", {this!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
from lockstep.metrics import Metrics
from lockstep.sinks.http import QueryServer

store = mod.two_tenants({path!r})

class Holder:  # what the query server needs of a sink
    def __init__(self):
        self.store, self.metrics, self.assigned = store, Metrics(), True

server = QueryServer(Holder(), {path!r}).start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
print("ready", flush=True)
stop.wait()
server.stop()
store.close()
"""


@pytest.mark.slow  # a sink in another process
def test_tenant_restriction_through_the_running_sink(tmp_path):
    import pathlib
    import signal
    import stat
    import subprocess
    import sys

    path = tmp_path / "f.duckdb"
    script = TENANT_SINK.format(this=str(pathlib.Path(__file__).resolve()), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path), read_only=True)  # so every query below goes through the sink
        check_tenant_restriction(path, lambda sql, tenant: query(path, sql, tenant=tenant))
        side = sidecar(path)
        assert stat.S_IMODE(side.stat().st_mode) == 0o600
        req = urllib.request.Request(json.loads(side.read_text())["url"] + "/query", data=b'{"sql": "SELECT 1"}')
        with pytest.raises(urllib.error.HTTPError) as err:  # no token, no SQL
            urllib.request.urlopen(req)
        assert err.value.code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_step_series_upserts_by_job_and_step_and_keeps_each_jobs_last_steps(tmp_path):
    from lockstep.schemas.records import StepSeries

    store = FindingsStore(tmp_path / "f.duckdb", series_keep_steps=10)

    def points(job, steps, t=100.0, tenant=""):
        return StepSeries(
            job=job,
            tenant=tenant,
            steps=list(steps),
            step_time_us=[t] * len(steps),
            median_us=[t / 2] * len(steps),
            workers=[4] * len(steps),
        )

    store.write(Batch([], [], {}, series=[points("a", range(30)), points("b", range(5), tenant="acme")]))
    store.write(
        Batch([], [], {}, series=[points("a", [29], t=250.0)])
    )  # a step sent again (a replay): the last one wins
    rows = dict(store.con.execute("SELECT step, step_time_us FROM step_series WHERE job = 'a'").fetchall())
    assert len(rows) == 30 and rows[29] == 250.0 and rows[28] == 100.0
    store.expire()
    assert store.con.execute(
        "SELECT job, min(step), max(step), count(*) FROM step_series GROUP BY job ORDER BY job"
    ).fetchall() == [("a", 20, 29, 10), ("b", 0, 4, 5)]
    box = tenant_sandbox(store.con, "acme")  # the series carries its tenant like every other table
    assert box.execute("SELECT DISTINCT job FROM step_series").fetchall() == [("b",)]


def test_a_windows_deviation_map_replaces_its_previous_one(tmp_path):
    from lockstep.schemas.records import DeviationMap

    store = FindingsStore(tmp_path / "f.duckdb")

    def dmap(workers, z):
        return DeviationMap(
            job="j",
            window="w1",
            start_step=8,
            steps=8,
            workers=workers,
            functions=["f", "g"],
            z=z,
            flagged=[[8 if x is not None else 0 for x in row] for row in z],
            workers_total=len(workers),
            functions_total=2,
        )

    store.write(Batch([], [], {}, maps=[dmap([3, 5], [[9.0, None], [None, -4.5]])]))
    store.write(Batch([], [], {}, maps=[dmap([3], [[7.0, 1.5]])]))
    assert store.con.execute(
        "SELECT worker, function, worker_rank, function_rank, z, flagged_steps FROM window_deviations ORDER BY 3, 4"
    ).fetchall() == [(3, "f", 0, 0, 7.0, 8), (3, "g", 0, 1, 1.5, 8)]


def test_later_window_reports_alone_do_not_count_an_earlier_window_whose_findings_are_still_coming(tmp_path):
    """A sink restarted mid-stream: the reports of w2 and w3 are stored before w2's finding (another topic); w3's
    report alone must not count w2, nor may w2 resolve the problem its own finding is still bringing."""
    store = FindingsStore(tmp_path / "f.duckdb")
    assert [e.action for e in store.write(Batch([fnd("a1", window_="w1")], [win("j", "w1", 100, findings=1)], {}))] == [
        "trigger"
    ]
    assert store.write(Batch([], [win("j", "w2", 200, findings=1), win("j", "w3", 300, findings=1)], {})) == []
    events = store.write(Batch([fnd("a2", window_="w2", steps=(200, 201))], [], {}))
    assert [e.action for e in events] == ["update"]  # before: w3's report had counted w2, which resolved the incident
    events = store.write(Batch([fnd("a3", window_="w3", steps=(300, 301))], [], {}))
    assert [e.action for e in events] == ["update"]
    assert store.con.execute("SELECT count(*), min(status) FROM incidents").fetchall() == [(1, "open")]
