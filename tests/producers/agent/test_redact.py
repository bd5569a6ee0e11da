"""Redaction of names, paths and stacks before anything leaves the host."""

import pyarrow as pa
import pytest

from lockstep.producers.agent.redact import Redaction

NAMES = ["/home/alice/secret/train.py(42): step", "torch/nn/modules/module.py(1782): _call_impl", "aten::mm", "gloo:all_reduce"]


def test_strip_keeps_file_names_and_drops_directories():
    r = Redaction(paths="strip", names="keep")
    assert [r.name(n) for n in NAMES] == ["train.py(42): step", "module.py(1782): _call_impl", "aten::mm", "gloo:all_reduce"]
    # the vectorised path gives the same answer as the per-name one
    assert r.names_array(pa.array(NAMES)).to_pylist() == [r.name(n) for n in NAMES]


def test_hashed_names_are_stable_across_workers_and_hide_the_name():
    worker_a = Redaction(paths="strip", names="hash", salt="tenant-7")
    worker_b = Redaction.parse("paths=strip,names=hash,salt=tenant-7")
    # a different install directory on another host does not change the key once paths are stripped
    a = worker_a.names_array(pa.array(["/opt/a/train.py(42): step", "aten::mm", "/opt/a/train.py(42): step"])).to_pylist()
    b = worker_b.names_array(pa.array(["/srv/b/train.py(42): step", "aten::mm"])).to_pylist()
    assert a[0] == a[2] == b[0] and a[1] == b[1] and a[0] != a[1]
    assert all(x.startswith("fn:") and "train" not in x for x in a)
    assert Redaction(names="hash", salt="other").name("aten::mm") != a[1]  # the salt matters


def test_hashed_paths_keep_the_file_name_but_not_the_directory():
    r = Redaction(paths="hash")
    out = r.name(NAMES[0])
    assert out.endswith("/train.py(42): step") and "alice" not in out


def test_raw_traces_lose_stacks_and_paths():
    trace = {"traceName": "/home/alice/t.json", "baseTimeNanoseconds": 1, "traceEvents": [
        {"ph": "X", "name": NAMES[0], "ts": 1, "dur": 2, "args": {"Python parent id": 3, "Call stack": "/home/alice/x.py", "External id": 9}},
        {"ph": "M", "name": "thread_name", "args": {"name": "thread 1"}},
    ]}  # fmt: skip
    out = Redaction().trace(trace)
    assert out["traceEvents"][0]["name"] == "train.py(42): step"
    assert out["traceEvents"][0]["args"] == {"External id": 9}
    assert "traceName" not in out and out["baseTimeNanoseconds"] == 1
    assert trace["traceEvents"][0]["name"] == NAMES[0]  # the kept trace is untouched
    assert Redaction.parse("none").trace(trace) is trace


@pytest.mark.parametrize("spec", ["paths=bogus", "names", "colour=red"])
def test_bad_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        Redaction.parse(spec)


def test_the_applied_redaction_is_reported_without_its_salt():
    r = Redaction.parse("names=hash,salt=s3cret")
    assert r.spec() == "paths=strip,stacks=drop,names=hash"
    assert Redaction.parse(r.spec(with_salt=True)) == r
