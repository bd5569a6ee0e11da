"""The streaming Chrome-trace reader: cut in slices, it reads what a whole-file decode reads; its bounds."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.producers.agent import trace_json as tj
from lockstep.producers.agent.trace import TraceError, read_chrome_trace
from tests.paths import DATA
from tests.tiers import examples

NASTY = ["}, {", '"}, {"ph": "X"', "\\", '\\"', "]}", "[{", "ProfilerStep#1", "ü€𝄞", "\n", "},{}]"]


def _columns_equal(a: tj.Columns, b: tj.Columns) -> None:
    for f in ("ts", "dur", "corr", "device", "seq", "flow_is_end", "flow_id", "flow_ts"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    np.testing.assert_array_equal(a.nbytes, b.nbytes)
    for f, d in (("cat", "cat_dict"), ("name", "name_dict"), ("stream", "stream_dict"), ("pg", "pg_dict")):
        assert [getattr(a, d)[i] for i in getattr(a, f)] == [getattr(b, d)[i] for i in getattr(b, f)], f
    assert [a.stream_dict[i] for i in a.flow_stream] == [b.stream_dict[i] for i in b.flow_stream]


def _read(data: bytes, window: int, monkeypatch, max_bytes: int = 1 << 30) -> tuple[tj.Head, tj.Columns]:
    monkeypatch.setattr(tj, "WINDOW", window)
    return tj.read_file(io.BytesIO(data), max_bytes)  # type: ignore[arg-type]  # BytesIO has no fileno: plain only


event = st.fixed_dictionaries(
    {
        "ph": st.sampled_from(["X", "X", "X", "M", "s", "f", "i"]),
        "cat": st.sampled_from(["cpu_op", "kernel", "cuda_runtime", "ac2g", "user_annotation", "Operator"]),
        "name": st.one_of(st.sampled_from(NASTY), st.text(max_size=30)),
        "pid": st.one_of(st.integers(0, 2**40), st.sampled_from(["Spans", "7"])),
        "tid": st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=5)),
        "ts": st.floats(-1e12, 1e12, allow_nan=False),
        "dur": st.floats(0, 1e6, allow_nan=False),
        "id": st.one_of(st.integers(0, 2**62), st.text(max_size=4)),
        "args": st.fixed_dictionaries(
            {},
            optional={
                "correlation": st.one_of(st.integers(-5, 2**64), st.text(max_size=3), st.booleans(), st.none()),
                "device": st.one_of(st.integers(-3, 9), st.none(), st.floats(0, 3)),
                "bytes": st.one_of(st.integers(-1, 2**70), st.floats(allow_nan=False, allow_infinity=False)),
                "Process Group Name": st.one_of(st.text(max_size=6), st.integers(0, 3)),
                "Seq": st.one_of(st.integers(-2, 2**64), st.text(max_size=3), st.none()),
                "Input Dims": st.recursive(
                    st.integers(), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(NASTY), c)
                ),
            },
        ),
    }
)


@settings(max_examples=examples(200), deadline=None)
@given(
    events=st.lists(event, max_size=40),
    window=st.integers(1, 400),
    indent=st.sampled_from([None, 0, 2]),
    before=st.booleans(),
)
def test_read_in_slices_it_is_what_a_whole_decode_reads(events, window, indent, before):
    """Windows as small as one byte: cuts inside strings, escapes, nested args; torch's key order or another."""
    top = {"distributedInfo": {"rank": 1, "pg_config": [{"ranks": [1, 2]}]}, "hostName": "h"}
    doc = {**top, "traceEvents": events} if not before else {"traceEvents": events, "x": [{"}": "{"}], **top}
    data = json.dumps(doc, indent=indent).encode()
    with pytest.MonkeyPatch.context() as mp:
        head, cols = _read(data, window, mp)
    whole_head, whole = tj.read_object(json.loads(data))
    assert head == whole_head
    _columns_equal(cols, whole)


def test_the_real_traces_read_in_small_slices_give_the_same_op_events(monkeypatch):
    for name in ("a100_rank0_of16.json.gz", "worker0.1623143089861.pt.trace.json.gz", "mtia_inference_rank_0.json.gz"):
        whole = read_chrome_trace(DATA / "traces" / name, 0)  # in one slice
        assert whole.events.num_rows > 1000
        monkeypatch.setattr(tj, "WINDOW", 65_537)  # tens of cuts
        sliced = read_chrome_trace(DATA / "traces" / name, 0)
        monkeypatch.undo()
        assert sliced.step_bounds == whole.step_bounds
        assert sliced.events.drop_columns(["bytes"]).equals(whole.events.drop_columns(["bytes"])), name


def _padded_gzip(path: Path, content_mib: int, trailer: int | None) -> None:
    """A valid trace followed by whitespace, gzipped; ``trailer`` overwrites the size the gzip trailer announces."""
    body = json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1}]}).encode()
    data = gzip.compress(body[:-1] + b" " * (content_mib << 20) + b"}", compresslevel=1)
    if trailer is not None:
        data = data[:-4] + trailer.to_bytes(4, "little")
    path.write_bytes(data)


def test_a_gzip_whose_trailer_lies_is_refused_on_the_bytes_it_unpacks(tmp_path):
    """As a 4 GiB + 100 byte content would announce 100 bytes (the size modulo 2^32): refused at the limit."""
    _padded_gzip(tmp_path / "t.json.gz", 8, trailer=100)
    with pytest.raises(TraceError, match="gzip trace unpacks to more than the limit of 1,048,576 bytes"):
        read_chrome_trace(tmp_path / "t.json.gz", 0, max_bytes=1 << 20)
    _padded_gzip(tmp_path / "u.json.gz", 8, trailer=None)  # the same content read in full under a larger limit
    assert read_chrome_trace(tmp_path / "u.json.gz", 0, max_bytes=16 << 20).step_bounds == {0: (1.0, 2.0)}


@pytest.mark.parametrize(
    "data,match",
    [
        (b'{"traceEvents": [{"ph": "X"}] "x": 1}', "expected ',' or '}'"),
        (b'{"traceEvents": [{"ph": "X"}]} {}', "trailing data"),
        (b'{"traceEvents": [{"ph": "X"}, 3]}', "not a Chrome-trace JSON object"),
        (b'{"traceEvents": [{"ph": "X", "ts": "soon"}]}', "not a Chrome-trace JSON object"),
        (b'{"traceEvents": [{"ph": "X"}, {"ph": ', "cut short"),
        (b'{"other": [1, 2]}', "no traceEvents"),
        (b'{"hostName": "a" ', "expected ',' or '}'"),
        (b"[]", "expected '{'"),
    ],
)
def test_what_is_not_a_trace_says_so(data, match, monkeypatch):
    with pytest.raises(tj.TraceReadError, match=match):
        _read(data, 8, monkeypatch)


def test_an_event_larger_than_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(tj, "MAX_EVENT_BYTES", 4096)
    big = json.dumps({"traceEvents": [{"ph": "X", "name": "n" * 10_000}]}).encode()
    with pytest.raises(tj.TraceReadError, match="an event of the trace is larger than"):
        _read(big, 64, monkeypatch)


#: what the reader gave for each real trace (rows of the op-event table, a digest of the table, the step bounds,
#: the metadata and the rank) when it was checked equal to the whole-file reader it replaced; any change to
#: what it reads from them shows here
GOLDEN = {
    "a100_rank0_of16.json.gz": (4861, "14a06e20c2584655d97db420af71c112"),
    "event_sync_trace.json.gz": (13, "5596b28acd4ced22ea7b5dc64d4abc88"),
    "mi250_minitoy_train_ROCm6_2_kineto.json.gz": (34, "dfb27c5d1998a65c9ce12f463322f008"),
    "mtia_inference_rank_0.json.gz": (1065, "2ed0b3d3114ac137fc74bac7c67e8ec3"),
    "sampled_rank-0.json.gz": (1607, "cdfa38da367d7ad6901b63be614d2afa"),
    "sampled_rank-1.json.gz": (1545, "db9a6fe4edf7a8c758c959400a625812"),
    "v100_resnet50_run0.json.gz": (6345, "51a10a23594957f05fb7d9391c581855"),
    "v100_resnet50_run1.json.gz": (6345, "48c7726a6fdd9e9ecab801b6ceee287b"),
    "v100_resnet50_run2.json.gz": (6426, "81f2634ab23acd71537242b5cc819018"),
    "v100_resnet50_run3.json.gz": (6426, "775db683c86f12b99af2182d9e25dfa7"),
    "worker0.1623143089861.pt.trace.json.gz": (2115, "6faac7bfa8bed373585ef6776f0f157f"),
}


def _digest(te) -> str:
    h = hashlib.sha256()
    for name in te.events.column_names:
        h.update(json.dumps([name, te.events.column(name).to_pylist()]).encode())
    h.update(json.dumps(sorted(te.step_bounds.items())).encode())
    h.update(json.dumps(dataclasses.asdict(te.meta), sort_keys=True).encode())
    h.update(json.dumps(te.worker).encode())
    return h.hexdigest()[:32]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_every_real_trace_reads_as_it_did_and_as_its_parsed_object_does(name):
    """The file read in slices (the typed decoder, columns built in bulk) and the parsed JSON object (the loose
    path) give the same op events; both what the reader gave when it was checked against the whole-file one."""
    path = DATA / "traces" / name
    te = read_chrome_trace(path)
    assert (te.events.num_rows, _digest(te)) == GOLDEN[name]
    obj = read_chrome_trace(json.loads(gzip.decompress(path.read_bytes())))
    assert obj.step_bounds == te.step_bounds
    # the host and a rank from the file name are not in a parsed object; bytes are NaN where none (NaN != NaN)
    other = ["worker", "host", "device", "bytes"]
    assert obj.events.drop_columns(other).equals(te.events.drop_columns(other)), name
    np.testing.assert_array_equal(obj.events.column("bytes").to_numpy(), te.events.column("bytes").to_numpy())


def test_a_process_group_is_read_in_any_slice_and_however_its_key_is_spelled(monkeypatch):
    """Runs whose bytes hold no process group key skip looking for one; a key spelled with \\u escapes still counts."""
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "ts": i, "dur": 1, "args": {}} for i in range(300)]
    events[250]["args"] = {"Process Group Name": "pg1"}
    events[280]["args"] = {"Process Group Description": "mine"}
    data = json.dumps({"traceEvents": events}).encode()
    data = data.replace(b'"Process Group Description"', b'"Process\\u0020Group Description"')
    _head, cols = _read(data, 2000, monkeypatch)  # many runs, most without a group
    names = [cols.pg_dict[i] for i in cols.pg]
    assert names[250] == "pg1" and names[280] == "mine"
    assert set(names[:250]) == {""}
