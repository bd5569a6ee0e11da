"""The trace reader and the summariser on collectives the trace numbers (``record_param_comms``'s ``Seq``).

The A100 trace numbered the way ``torch.profiler`` writes the numbers today
(tests/lockstep/commands/test_diagnose_collectives.py: :func:`numbered`); expected values are found here from the
raw JSON with plain Python (the launching call of each kernel by correlation, the numbered record that encloses
it or that a communication operator overlaps), independently of the reader's vectorised code.
"""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pytest

from lockstep.producers.agent.summarise import summarise
from lockstep.producers.agent.trace import read_chrome_trace
from lockstep.schemas.events import COLLECTIVE_INSTANCE_SCHEMA, OP_EVENT_SCHEMA, OP_EVENT_SEQ_SCHEMA
from tests.lockstep.commands.test_diagnose_collectives import A100, extra_collective, numbered


@pytest.fixture(scope="module")
def trace() -> dict:
    return extra_collective(numbered(json.loads(gzip.decompress(A100.read_bytes()))), 5000)


def _expected(trace: dict) -> list[tuple[str, float, int, str]]:
    """(name, start, number, group) of every collective event the reader keeps, from the raw events."""
    x = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    records = [e for e in x if e["name"] == "record_param_comms" and "Seq" in e.get("args", {})]
    launch = {e["args"]["correlation"]: e for e in x if e.get("cat") == "cuda_runtime" and "correlation" in e["args"]}

    def number(e: dict) -> tuple[int, str] | None:
        over = [
            r
            for r in records
            if r["tid"] == e["tid"] and r["ts"] <= e["ts"] + e["dur"] and r["ts"] + r["dur"] >= e["ts"]
        ]
        if not over:
            return None
        r = max(over, key=lambda r: r["ts"])
        return r["args"]["Seq"], r["args"]["Process Group Description"]

    out = []
    for e in x:
        if e.get("cat") in ("cpu_op", "user_annotation") and e["name"].startswith(("c10d::", "nccl:")):
            got = number(e)
        elif e.get("cat") == "kernel" and "nccl" in e["name"]:
            call = launch.get(e["args"].get("correlation"))
            got = number(call) if call else None
        else:
            continue
        if got:
            out.append((e["name"].split("(")[0], float(e["ts"]), *got))
    return sorted(out)


def test_each_collective_carries_its_number_and_group(trace):
    te = read_chrome_trace(trace, 0)
    assert te.events.schema == OP_EVENT_SEQ_SCHEMA
    t = te.events.to_pydict()
    got = sorted(
        (f, s, n, g)
        for f, s, n, g in zip(t["function"], t["start_us"], t["collective_seq"], t["process_group"])
        if n is not None
    )
    want = [w for w in _expected(trace) if w[1] in set(t["start_us"])]  # the events inside the steps
    assert got == want
    assert len(got) > 80 and {g for *_, g in got} == {"default_pg", "pp"}
    # the job's collectives are numbered 0, 1, ... in their group, the extra one 0, 1 (one a step) in its own
    assert sorted({n for _, _, n, g in got if g == "pp"}) == [0, 1]
    kinds = {k for k, n in zip(t["kind"], t["collective_seq"]) if n is not None}
    assert kinds <= {"collective", "p2p"}
    # nothing else carries a number: operators, regions, copies, other kernels
    assert all(n is None for k, n in zip(t["kind"], t["collective_seq"]) if k not in ("collective", "p2p"))


def test_a_trace_without_numbers_reads_exactly_as_before(trace):
    plain = json.loads(gzip.decompress(A100.read_bytes()))
    te = read_chrome_trace(plain, 0)
    assert te.events.schema == OP_EVENT_SCHEMA
    assert all(s.collectives is None for s in summarise(te.events, None, te.step_bounds))
    numbered_te = read_chrome_trace(numbered(json.loads(gzip.decompress(A100.read_bytes()))), 0)
    assert numbered_te.events.drop_columns(["collective_seq", "process_group", "bytes"]).equals(
        te.events.drop_columns(["bytes"])
    )


def test_the_file_and_the_parsed_object_read_the_same_numbers(trace, tmp_path):
    """The file is read by the typed decoder (``Seq`` checked as an integer in C), the parsed object by the loose
    path: the same numbers and groups."""
    path = tmp_path / "rank.json"
    path.write_text(json.dumps(trace))
    typed = read_chrome_trace(path, 0).events
    loose = read_chrome_trace(trace, 0).events
    assert typed.drop_columns(["host", "device", "bytes"]).equals(loose.drop_columns(["host", "device", "bytes"]))
    assert typed.column("collective_seq").null_count < typed.num_rows


def test_the_summary_keeps_each_steps_numbered_instances(trace):
    te = read_chrome_trace(trace, 3)
    summaries = summarise(te.events, None, te.step_bounds)
    assert [s.step for s in summaries] == [553, 554]
    ev = te.events.to_pydict()
    for s in summaries:
        assert s.collectives is not None and s.collectives.schema == COLLECTIVE_INSTANCE_SCHEMA
        want = sorted(
            (f, g, n, d)
            for st, f, g, n, d in zip(
                ev["step"], ev["function"], ev["process_group"], ev["collective_seq"], ev["duration_us"]
            )
            if st == s.step and n is not None
        )
        c = s.collectives.to_pydict()
        assert sorted(zip(c["function"], c["process_group"], c["collective_seq"], c["duration_us"])) == want
        # the instances are the calls of the numbered functions: as many as the function table counts
        calls = dict(zip(s.functions.column("function").to_pylist(), s.functions.column("calls").to_pylist()))
        per = pa.table(c).group_by("function").aggregate([("collective_seq", "count")]).to_pydict()
        for f, n in zip(per["function"], per["collective_seq_count"]):
            assert n <= calls[f]


def test_groups_are_named_by_the_trace_s_pg_config_where_their_description_is_unique(trace):
    """Descriptions need not be unique across a job (every tensor-parallel group is ``mesh_tp``); names are.  Where
    ``distributedInfo.pg_config`` names the group of a description, the collectives carry the name."""
    configured = json.loads(json.dumps(trace))
    configured["distributedInfo"]["pg_config"] = [
        {"pg_name": "0", "pg_desc": "default_pg", "ranks": list(range(16))},
        {"pg_name": "7", "pg_desc": "pp", "ranks": [0, 1]},
    ]
    before = read_chrome_trace(trace, 0).events
    after = read_chrome_trace(configured, 0).events
    rename = {"default_pg": "0", "pp": "7", None: None}
    assert after.column("process_group").to_pylist() == [rename[g] for g in before.column("process_group").to_pylist()]
    assert after.drop_columns(["process_group", "bytes"]).equals(before.drop_columns(["process_group", "bytes"]))
    # two groups of one description: neither name is taken
    configured["distributedInfo"]["pg_config"].append({"pg_name": "8", "pg_desc": "pp", "ranks": [2, 3]})
    again = read_chrome_trace(configured, 0).events
    assert set(again.column("process_group").to_pylist()) == {"0", "pp", None}
