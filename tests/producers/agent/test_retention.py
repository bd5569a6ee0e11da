"""Raw retention: bounded slices (longest events first) and the store keeping only the last window."""

import json
import random

from lockstep.producers.agent.retention import RawStore, decompress, slice_trace


def make_trace(steps=(10, 11, 12), events_per_step=400, seed=1):
    rnd = random.Random(seed)
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    bounds = {}
    for i, s in enumerate(steps):
        lo = 1_000_000.0 + i * 10_000
        bounds[s] = (lo, lo + 10_000)
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{s}",
                "ts": lo,
                "dur": 10_000,
                "pid": 1,
                "tid": 1,
            }
        )
        for j in range(events_per_step):
            events.append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": f"aten::op{rnd.randrange(50)}",
                    "ts": lo + rnd.uniform(0, 9_000),
                    "dur": rnd.uniform(1, 1000),
                    "pid": 1,
                    "tid": 1,
                    "args": {"External id": j},
                }
            )
    return {"schemaVersion": 1, "baseTimeNanoseconds": 5, "traceName": "/x/t.json", "traceEvents": events}, bounds


def test_a_slice_that_fits_is_whole():
    trace, bounds = make_trace()
    sl = slice_trace(trace, bounds, [11], max_bytes=1 << 20)
    doc = json.loads(decompress(sl.data))
    assert not sl.truncated and sl.steps == [11] and sl.events == sl.events_total == 401
    lo, hi = bounds[11]
    body = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert all(e["ts"] < hi and e["ts"] + e["dur"] > lo for e in body)
    assert doc["traceEvents"][0]["ph"] == "M" and doc["baseTimeNanoseconds"] == 5 and "traceName" not in doc


def test_a_bounded_slice_keeps_the_longest_events_under_the_bound():
    trace, bounds = make_trace()
    full = slice_trace(trace, bounds, None, 1 << 30)
    sl = slice_trace(trace, bounds, None, max_bytes=len(full.data) // 4)
    assert sl.truncated and len(sl.data) <= len(full.data) // 4 and 0 < sl.events < sl.events_total == full.events
    kept = [e for e in json.loads(decompress(sl.data))["traceEvents"] if e["ph"] == "X"]
    shortest_kept = min(e["dur"] for e in kept)
    in_window = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    dropped = [e for e in in_window if e not in kept]
    assert max(e["dur"] for e in dropped) <= shortest_kept
    assert [e["ts"] for e in kept] == sorted(e["ts"] for e in kept)  # back in time order
    tiny = slice_trace(trace, bounds, None, max_bytes=16)  # nothing fits: an empty slice, still valid JSON
    assert tiny.events == 0 and json.loads(decompress(tiny.data))["traceEvents"] == []


def test_the_store_keeps_only_the_last_window_and_bounds_it(tmp_path):
    trace, bounds = make_trace()
    raw = json.dumps(trace).encode()
    store = RawStore(tmp_path / "raw", max_bytes=1 << 20)
    store.keep("w1", raw, bounds)
    store.keep("w2", raw, bounds)
    assert store.load("w1") is None
    window, kept, kept_bounds = store.load()
    assert window == "w2" and kept == trace and kept_bounds == bounds
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["w2.meta.json", "w2.trace.json.zst"]
    small = RawStore(tmp_path / "small", max_bytes=8000)
    path = small.keep("w3", raw, bounds)
    assert path.stat().st_size <= 8000
    _, cut, _ = small.load("w3")
    assert 0 < len(cut["traceEvents"]) < len(trace["traceEvents"])
