"""`lockstep diagnose` on op-event tables (CSV, Parquet) and hardware samples; bad files."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from lockstep.commands.cli import main
from lockstep.schemas.records import Finding


def op_events(workers=16, steps=6, slow=None, factor=1.4, skew=True, seed=0):
    """A synchronous data-parallel job as op events: each worker on its own clock (hosts' clocks disagree by seconds)."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(steps):
        dur = {"loader.next": 3000.0, "fwd": 40000.0, "bwd": 80000.0}
        before = {
            w: {
                f: d * rng.lognormal(0, 0.004) * (factor if (w == slow and f == "bwd") else 1.0) for f, d in dur.items()
            }
            for w in range(workers)
        }
        arrival = {w: sum(v.values()) for w, v in before.items()}
        last = max(arrival.values())
        for w in range(workers):
            clock = (1e12 + w * 3.7e6 if skew else 0.0) + s * 400_000.0  # another host, another clock
            t = clock
            for f, kind in (("loader.next", "dataloader"), ("fwd", "compute"), ("bwd", "compute")):
                rows.append((w, s, f, kind, t, before[w][f], f"host{w // 4}", f"host{w // 4}/gpu{w % 4}", str(w % 2)))
                t += before[w][f]
            rows.append(
                (
                    w,
                    s,
                    "nccl:all_reduce",
                    "collective",
                    t,
                    last - arrival[w] + 20000.0,
                    f"host{w // 4}",
                    None,
                    str(w % 2),
                )
            )
            rows.append(
                (w, s, "optimizer.step", "optimizer", clock + last + 20000.0, 5000.0, f"host{w // 4}", None, str(w % 2))
            )
    cols = list(zip(*rows))
    return pa.table(
        {
            "worker": cols[0],
            "step": cols[1],
            "function": cols[2],
            "kind": cols[3],
            "start_us": cols[4],
            "duration_us": cols[5],
            "host": cols[6],
            "device": cols[7],
            "shard": cols[8],
        }
    )


def run(capsys, *args):
    code = main(["diagnose", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_csv_table_names_worker_function_and_device(tmp_path, capsys):
    path = tmp_path / "events.csv"
    pcsv.write_csv(op_events(slow=5), path)
    code, out, err = run(capsys, path, "--json")
    assert code == 0, err
    findings = msgspec.json.decode(out, type=list[Finding])  # the Finding shape of `lockstep findings --json`
    assert len(findings) == 1
    f = findings[0]
    # no samples: worker, function and device, but not why (a throttled GPU or a slow one); the summary says what would tell
    assert (f.workers, f.function, f.devices, f.hosts, f.cause) == (
        [5],
        "bwd",
        ["host1/gpu1"],
        ["host1"],
        "undetermined",
    )
    assert f.steps == list(range(6)) and "no hardware samples" in f.summary and "no sm_clock_mhz samples" in f.summary
    code, out, _ = run(capsys, path)
    assert code == 0 and "bwd" in out and "16 workers x 6 steps (0..5)" in out


def test_the_policy_file_sets_the_thresholds(tmp_path, capsys):
    path = tmp_path / "events.csv"
    pcsv.write_csv(op_events(slow=5), path)
    strict = tmp_path / "strict.yaml"
    strict.write_text("id: strict\ndiagnosis: {min_excess_share: 0.5}\n")
    code, out, err = run(capsys, path, "--json", "--policy", strict)
    assert code == 0 and json.loads(out) == [], err


def test_clock_skew_between_hosts_changes_nothing(tmp_path, capsys):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(op_events(slow=5, skew=True), a)
    pq.write_table(op_events(slow=5, skew=False), b)
    ja, jb = (json.loads(run(capsys, p, "--json")[1]) for p in (a, b))
    assert [(f["workers"], f["function"], f["cause"], f["impact"]) for f in ja] == [
        (f["workers"], f["function"], f["cause"], f["impact"]) for f in jb
    ]
    assert json.loads(run(capsys, tmp_path / "a.parquet", "--json")[1])[0]["workers"] == [5]
    pq.write_table(op_events(skew=True), a)
    assert json.loads(run(capsys, a, "--json")[1]) == []  # healthy, however far apart the clocks


def test_peer_groups_and_hardware_samples(tmp_path, capsys):
    ev = op_events(slow=6)
    pq.write_table(ev, tmp_path / "e.parquet")
    # samples on each worker's own clock: worker 6's GPU runs at a lower clock with the thermal bits set
    rows = []
    starts = ev.group_by("worker").aggregate([("start_us", "min")]).to_pylist()
    for r in starts:
        w, t0 = r["worker"], r["start_us_min"]
        for t in np.arange(t0, t0 + 6 * 400_000.0, 10_000.0):
            rows.append((w, t, "sm_clock_mhz", 1500.0 if w == 6 else 1980.0))
            rows.append((w, t, "clock_events", 0x40 if w == 6 else 0))
            rows.append((w, t, "gpu_temp_c", 90.0 if w == 6 else 60.0))
    w, t, m, v = zip(*rows)
    pcsv.write_csv(pa.table({"worker": w, "t_us": t, "metric": m, "value": v}), tmp_path / "s.csv")
    code, out, err = run(
        capsys, tmp_path / "e.parquet", "--samples", tmp_path / "s.csv", "--peer-group", "shard", "--json"
    )
    assert code == 0, err
    f = json.loads(out)[0]
    assert (f["workers"], f["cause"]) == ([6], "gpu_throttle_thermal")
    assert "only" not in f["summary"]  # 8 peers per shard: enough
    ev_ = {e["feature"]: e for e in f["evidence"]}
    assert ev_["sm_clock_mhz"]["value"] == 1500 and ev_["sm_clock_mhz"]["peer_value"] == 1980


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    good = tmp_path / "good.csv"
    pcsv.write_csv(op_events(), good)
    nokind = tmp_path / "nokind.csv"
    pcsv.write_csv(op_events().drop_columns(["kind"]), nokind)
    garbage = tmp_path / "rank0.json"
    garbage.write_text("{ not json")
    mixed = tmp_path / "mixed.csv"
    pcsv.write_csv(
        op_events().set_column(8, "shard", pa.array([str(i % 3) for i in range(op_events().num_rows)])), mixed
    )
    badsamples = tmp_path / "samples.csv"
    pcsv.write_csv(pa.table({"worker": [0], "t_us": [1.0], "value": [2.0]}), badsamples)
    cases = [
        ((good, "--samples", badsamples), "samples.csv: sample table lacks column(s) metric"),
        ((nokind,), "nokind.csv: op-event table lacks column(s) kind"),
        ((garbage,), "rank0.json: not a Chrome-trace JSON object"),
        ((tmp_path / "missing.csv",), "missing.csv: cannot read it"),
        ((good, good), "good.csv: worker 0 is also in"),
        ((good, "--peer-group", "rack"), "good.csv: no column rack for --peer-group"),
        ((mixed, "--peer-group", "shard"), "label column shard must hold one value per worker"),
    ]
    for args, message in cases:
        code, _, err = run(capsys, *args)
        assert code == 1 and message in err, (args, err)
        assert err.startswith("lockstep diagnose: error: ") and err.count("\n") == 1, err


def test_no_traceback_from_the_command_line(tmp_path):
    bad = tmp_path / "events.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", "diagnose", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert (
        p.stderr.strip().startswith("lockstep diagnose: error:")
        and "events.parquet: not a readable Parquet table" in p.stderr
    )


@pytest.mark.parametrize("flag", ["--json", None])
def test_healthy_table_has_no_findings(tmp_path, capsys, flag):
    path = tmp_path / "e.csv"
    pcsv.write_csv(op_events(), path)
    code, out, _ = run(capsys, path, *([flag] if flag else []))
    assert code == 0 and (json.loads(out) == [] if flag else out.startswith("no findings"))


def test_a_rate_limited_link_in_a_ring_is_named_by_the_shape_of_its_samples(tmp_path, capsys):
    """The real case of issue 16: four ranks in one ring, one rank's link rate-limited. Every rank's all-reduce
    takes as long and every rank's mean NIC throughput is the same; the limited link is busy all the time while
    the others burst and idle (NIC counters at 1 kHz)."""
    rng = np.random.default_rng(3)
    events, samples = [], []
    rate = 0.02  # GB/s: the limited link, and so the ring
    for w in range(4):
        clock = 1e12 + w * 5.1e6  # each rank on its own clock
        for s in range(6):
            t = clock + s * 200_000.0
            for f, kind, d in (
                ("fwd", "compute", 30_000.0),
                ("bwd", "compute", 60_000.0),
                ("gloo:all_reduce", "collective", 80_000.0),
            ):
                events.append((w, s, f, kind, t, d * rng.lognormal(0, 0.01), f"node{w}"))
                if kind == "collective":  # 1 kHz NIC samples while it runs
                    ts = t + np.arange(0.0, d, 1000.0)
                    burst = rng.random(ts.size) < 0.25  # the others: a quarter of the time at 4x, idle otherwise
                    v = (
                        rate * rng.normal(1.0, 0.15, ts.size)
                        if w == 2
                        else np.where(burst, 4 * rate * rng.normal(1.0, 0.1, ts.size), 0.0)
                    )
                    samples += [(w, float(x), "nic_gbps", float(y)) for x, y in zip(ts, v)]
                t += d
    cols = list(zip(*events))
    pq.write_table(
        pa.table(
            {
                "worker": cols[0],
                "step": cols[1],
                "function": cols[2],
                "kind": cols[3],
                "start_us": cols[4],
                "duration_us": cols[5],
                "host": cols[6],
            }
        ),
        tmp_path / "e.parquet",
    )
    w, t, m, v = zip(*samples)
    pq.write_table(pa.table({"worker": w, "t_us": t, "metric": m, "value": v}), tmp_path / "s.parquet")
    code, out, err = run(capsys, tmp_path / "e.parquet", "--samples", tmp_path / "s.parquet", "--json")
    assert code == 0, err
    named = [f for f in json.loads(out) if f["workers"]]
    assert (
        named
        and named[0]["workers"] == [2]
        and named[0]["cause"] == "nic"
        and named[0]["function"] == "gloo:all_reduce"
    ), out
    assert "saturated its link" in named[0]["summary"] and len(named) == 1


def ring_connections(workers: int, culprit: int | None, lost: int = 2_000) -> pa.Table:
    """Each worker's TCP connections of a ring sending r -> r-1, seen from both ends, as the agent records them:
    the culprit's link loses ``lost`` of 40,000 segments both ways (its connection to r-1, the one from r+1)."""
    rows = []
    for r in range(workers):
        to = (r - 1) % workers
        a, b = f"10.0.{r // 250}.{r % 250 + 1}:4{r:04d}", f"10.0.{to // 250}.{to % 250 + 1}:5{to:04d}"
        bad = culprit is not None and culprit in (r, to)
        rows.append(dict(worker=r, local=a, peer=b, segs_out=40_000, retrans=lost if bad else 4))
        rows.append(dict(worker=to, local=b, peer=a, segs_out=0, retrans=0))
    return pa.Table.from_pylist(rows)


def test_a_lossy_link_is_named_from_the_connections_where_timing_shows_none(tmp_path, capsys):
    """Every worker's all-reduce alike (a ring waits for its slowest link): the timing alone names no worker; the
    connections name the one endpoint the lossy ones share, cause nic, with the counts as evidence."""
    events = tmp_path / "e.parquet"
    pq.write_table(op_events(workers=8), events)
    conns = tmp_path / "c.parquet"
    pq.write_table(ring_connections(8, culprit=5), conns)
    code, out, _ = run(capsys, events, "--json")
    assert code == 0 and not [f for f in json.loads(out) if f["scope"] == "worker"]
    code, out, _ = run(capsys, events, "--connections", conns, "--json")
    found = msgspec.convert(json.loads(out), list[Finding])
    (link,) = [f for f in found if f.cause == "nic"]
    assert (link.scope, link.workers, link.function, link.hosts) == ("worker", [5], "nccl:all_reduce", ["host1"])
    assert link.confidence >= 0.5
    ev = {e.feature: e for e in link.evidence}
    assert ev["tcp_retrans_share"].value == pytest.approx(0.05) and ev["tcp_retrans_share"].peer_value == pytest.approx(
        1e-4
    )
    assert ev["lossy_peers"].value == 2
    assert "workers 4, 6" in link.summary
    # healthy connections, or a CSV of them: no link named
    pcsv.write_csv(ring_connections(8, culprit=None), tmp_path / "c.csv")
    code, out, _ = run(capsys, events, "--connections", tmp_path / "c.csv", "--json")
    assert code == 0 and not [f for f in json.loads(out) if f["cause"] == "nic"]


def test_a_slow_link_is_named_from_the_connections_busy_time_and_a_lossy_one_gets_one_finding(tmp_path, capsys):
    """A link that delivers slowly but loses nothing: worker 5's two connections ran at 100 MB/s while busy, the
    others at 800. Named, cause nic, with the throughputs as evidence; a link both lossy and slow is one finding."""
    events = tmp_path / "e.parquet"
    pq.write_table(op_events(workers=8), events)

    def with_busy(t: pa.Table, slow: int) -> pa.Table:
        rows = t.to_pylist()
        for row in rows:
            if row["segs_out"]:
                w, to = row["worker"], (row["worker"] - 1) % 8
                row["bytes_sent"] = 40_000_000
                row["busy_us"] = 400_000 if slow in (w, to) else 50_000
        return pa.Table.from_pylist(rows)

    conns = tmp_path / "c.parquet"
    pq.write_table(with_busy(ring_connections(8, culprit=None), slow=5), conns)
    code, out, _ = run(capsys, events, "--connections", conns, "--json")
    found = msgspec.convert(json.loads(out), list[Finding])
    (link,) = [f for f in found if f.cause == "nic"]
    assert (link.scope, link.workers, link.function) == ("worker", [5], "nccl:all_reduce")
    ev = {e.feature: e for e in link.evidence}
    assert ev["tcp_busy_mbps"].value == pytest.approx(100.0) and ev["tcp_busy_mbps"].peer_value == pytest.approx(800)
    assert ev["slow_peers"].value == 2 and "tcp_retrans_share" not in ev
    assert link.confidence >= 0.8 and "delivered at most 100 MB/s" in link.summary
    # lossy and slow: one finding on worker 5 with both rules' evidence
    pq.write_table(with_busy(ring_connections(8, culprit=5), slow=5), conns)
    code, out, _ = run(capsys, events, "--connections", conns, "--json")
    assert code == 0
    found = msgspec.convert(json.loads(out), list[Finding])
    (link,) = [f for f in found if f.cause == "nic"]
    features = [e.feature for e in link.evidence]
    assert link.workers == [5] and {"tcp_retrans_share", "tcp_busy_mbps"} <= set(features)
    assert len(features) == len(set(features))


def test_a_bad_connection_table_is_a_one_line_error(tmp_path, capsys):
    events = tmp_path / "e.csv"
    pcsv.write_csv(op_events(), events)
    nopeer = tmp_path / "nopeer.csv"
    pcsv.write_csv(ring_connections(4, None).drop_columns(["peer"]), nopeer)
    words = tmp_path / "words.csv"
    pcsv.write_csv(ring_connections(4, None).set_column(3, "segs_out", pa.array(["many"] * 8)), words)
    cases = [
        (nopeer, "nopeer.csv: connection table lacks column peer"),
        (words, "words.csv: column segs_out of the connection table is not int64"),
        (tmp_path / "none.parquet", "none.parquet: cannot read it"),
    ]
    for path, message in cases:
        code, _, err = run(capsys, events, "--connections", path)
        assert code == 1 and message in err, (path, err)
        assert err.startswith("lockstep diagnose: error: ") and err.count("\n") == 1, err
