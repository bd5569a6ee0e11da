"""A trace read in parts of whole steps (``read_chrome_trace_parts``: spilled to disk, a part at a time) summarises
to exactly what it summarises to read whole, whatever the file's event order, and holds one part at a time."""

from __future__ import annotations

import gzip
import json
import math
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest

from lockstep.producers.agent.summarise import StepSummary, summarise
from lockstep.producers.agent.trace import TraceError, read_chrome_trace, read_chrome_trace_parts

TRACES = Path(__file__).parents[2] / "data" / "traces"
REAL = sorted(p.name for p in TRACES.glob("*.json.gz"))


def _rows(t: pa.Table | None) -> list[tuple] | None:
    """A table's rows with NaN made comparable."""
    if t is None:
        return None
    cols = t.to_pydict()
    return [
        tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)
        for row in zip(*cols.values(), strict=True)
    ]


def _summaries(parts) -> dict[tuple[int, int], tuple]:
    out: dict[tuple[int, int], tuple] = {}
    for te in parts:
        for s in summarise(te.events, None, te.step_bounds):
            assert (s.worker, s.step) not in out, f"step {s.step} summarised by two parts"
            out[(s.worker, s.step)] = _key(s)
    return out


def _key(s: StepSummary) -> tuple:
    return s.step_time_us, _rows(s.functions), _rows(s.collectives)


@pytest.mark.parametrize("name", REAL)
def test_a_real_trace_read_in_parts_summarises_as_it_does_read_whole(name, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    whole = read_chrome_trace(TRACES / name, 0)
    reading = read_chrome_trace_parts(TRACES / name, 0, part_events=300)
    first = next(reading)
    spilled = list(tmp_path.iterdir())
    parts = [first, *reading]
    assert _summaries(parts) == _summaries([whole])
    assert all(p.meta == whole.meta for p in parts)
    assert sorted(b for p in parts for b in p.step_bounds) == sorted(whole.step_bounds)
    if whole.events.num_rows > 300:
        assert spilled, "a trace of more than part_events events is spilled"
    assert not list(tmp_path.iterdir()), "the spilled chunks are removed"


def _repeated(path: Path, times: int, *, lag_us: float = 0.0, device_first: bool = False) -> Path:
    """The real A100 trace's two steps repeated ``times`` times (shifted times, step numbers and correlation ids);
    ``lag_us``: its device work runs that much later (past the next step's start); ``device_first``: the device
    events written before the CPU's (``torch.profiler`` does not write events in time order)."""
    trace = json.loads(gzip.decompress((TRACES / "a100_rank0_of16.json.gz").read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e.get("dur", 0) for e in events) - t0 + lag_us
    corr = 1 + max(e.get("args", {}).get("correlation", 0) for e in events)
    out = []
    for i in range(times):
        for e in events:
            e = {**e, "ts": e["ts"] + i * span}
            on_device = e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            if on_device:
                e["ts"] += lag_us
            if "correlation" in e.get("args", {}):
                e["args"] = {**e["args"], "correlation": e["args"]["correlation"] + i * corr}
            if e["name"].startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{int(e['name'][13:]) + 2 * i}"
            out.append(e)
    if device_first:
        out.sort(key=lambda e: e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"))
    trace["traceEvents"] = meta + out
    path.write_text(json.dumps(trace))
    return path


def test_device_work_running_after_the_next_part_began_stays_with_the_step_that_launched_it(tmp_path):
    """Each step's kernels run 40 ms late (into the next step, so into the next part), and the file holds the device
    events before the CPU's: the parts still give each step exactly its own work."""
    path = _repeated(tmp_path / "lagged.json", 8, lag_us=40_000.0, device_first=True)
    whole = read_chrome_trace(path, 0)
    parts = list(read_chrome_trace_parts(path, 0, part_events=10_000))
    assert len(parts) >= 4
    got, want = _summaries(parts), _summaries([whole])
    assert got == want
    assert len(want) == 16


@pytest.mark.slow  # ~10 s: traces of the real one's steps repeated, written and read in parts
def test_the_largest_part_does_not_grow_with_the_trace(tmp_path):
    """Memory is one part's: a trace four times as long is read in four times as many parts, of the same size."""
    sizes = {}
    for times in (4, 16):
        path = _repeated(tmp_path / f"r{times}.json", times)
        parts = [te.events.num_rows for te in read_chrome_trace_parts(path, 0, part_events=12_000)]
        sizes[times] = (len(parts), max(parts))
    (n_short, big_short), (n_long, big_long) = sizes[4], sizes[16]
    assert n_long >= 3 * n_short
    assert big_long == big_short


def test_a_trace_of_at_most_part_events_is_one_part_and_needs_no_temporary_folder(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_folder))
    parts = list(read_chrome_trace_parts(TRACES / "a100_rank0_of16.json.gz", 0))
    assert len(parts) == 1
    assert parts[0].events.num_rows == read_chrome_trace(TRACES / "a100_rank0_of16.json.gz", 0).events.num_rows


def test_a_temporary_folder_without_room_is_a_one_line_error_that_says_what_to_do(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_folder))
    with pytest.raises(TraceError, match="set TMPDIR to a folder with room") as err:
        list(read_chrome_trace_parts(TRACES / "a100_rank0_of16.json.gz", 0, part_events=300))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # ~10 s: traces of the real one's steps repeated, written and read in parts
def test_a_trace_whose_rank_is_unknown_is_read_in_parts_as_the_callers_placeholder_worker(tmp_path):
    """Without ``anonymous_as`` it is read back whole (its events carry worker -1 until it is numbered); with it, in
    parts whose events are that worker's, the summaries those of the whole trace read as that worker's."""
    path = _repeated(tmp_path / "r.json", 4)
    trace = json.loads(path.read_text())
    trace["distributedInfo"].pop("rank", None)
    unranked = tmp_path / "unranked.json"
    unranked.write_text(json.dumps(trace))
    parts = list(read_chrome_trace_parts(unranked, None, part_events=1_000))
    assert len(parts) == 1 and parts[0].worker is None
    assert parts[0].events.num_rows == read_chrome_trace(unranked).events.num_rows
    parts = list(read_chrome_trace_parts(unranked, None, part_events=1_000, anonymous_as=0))
    assert len(parts) > 1 and all(p.worker is None for p in parts)
    assert _summaries(parts) == _summaries([read_chrome_trace(unranked, 0)])


@pytest.mark.slow  # ~10 s: traces of the real one's steps repeated, written and read in parts
def test_a_trace_without_profiler_steps_is_read_in_parts_by_its_inferred_steps(tmp_path):
    """Without ``ProfilerStep#N`` its iterations end with its ``Optimizer.step``s, else they are its repeating
    top-level region (which no CPU event of any chunk encloses): parts, as read whole.  A trace that is one step is
    one part."""

    def read(trace: dict, name: str) -> tuple[list, object]:
        path = tmp_path / name
        path.write_text(json.dumps(trace))
        return list(read_chrome_trace_parts(path, 0, part_events=5_000)), read_chrome_trace(path, 0)

    def rename(trace: dict, prefix: str, name: str) -> None:
        for e in trace["traceEvents"]:
            if e["name"].startswith(prefix):
                e["name"] = name

    trace = json.loads(_repeated(tmp_path / "r.json", 4).read_text())
    rename(trace, "ProfilerStep#", "step_region")
    parts, whole = read(trace, "no_steps.json")
    assert len(parts) > 1 and all(p.meta.steps_from == whole.meta.steps_from == "Optimizer.step" for p in parts)
    assert _summaries(parts) == _summaries([whole])

    rename(trace, "Optimizer.step", "optimizer_region")
    parts, whole = read(trace, "no_optimizer.json")
    assert len(parts) > 1 and all(p.meta.steps_from == whole.meta.steps_from == "region step_region" for p in parts)
    assert _summaries(parts) == _summaries([whole])

    for i, e in enumerate(e for e in trace["traceEvents"] if e["name"] == "step_region"):
        e["name"] = f"region {i}"  # nothing repeats: the whole trace is one step
    parts, whole = read(trace, "one_step.json")
    assert len(parts) == 1 and parts[0].meta.steps_from == whole.meta.steps_from == "whole trace"
    assert _summaries(parts) == _summaries([whole])


def test_a_broken_event_in_a_later_chunk_is_the_same_error_and_leaves_no_spilled_files(tmp_path, monkeypatch):
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    path = _repeated(tmp_path / "r.json", 4)
    trace = json.loads(path.read_text())
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    ops[-1]["dur"] = 1e13  # no profiler measures that
    path.write_text(json.dumps(trace))
    with pytest.raises(TraceError) as whole:
        read_chrome_trace(path, 0)
    with pytest.raises(TraceError) as parts:
        list(read_chrome_trace_parts(path, 0, part_events=1_000))
    assert str(parts.value) == str(whole.value)
    assert not os.listdir(tmp_path / "tmp")


def test_lockstep_diagnose_numbers_unranked_traces_read_in_parts_as_it_numbers_them_read_whole(tmp_path, monkeypatch):
    """Two traces that name no rank, each read in parts as worker 0's: numbered 0 and 1 in the order given, their
    summaries with them, as when each is read whole."""
    from lockstep.app.offline import load_inputs

    files = []
    for name in ("first.json", "second.json"):
        trace = json.loads(_repeated(tmp_path / "r.json", 3).read_text())
        trace["distributedInfo"].pop("rank", None)
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(trace))

    status: list[str] = []

    def read() -> tuple[dict, list[str]]:
        inputs = load_inputs(files, None, None, jobs=1, status=status.append)
        return {(s.worker, s.step): _key(s) for s in inputs.summaries}, inputs.notes

    whole, notes = read()
    monkeypatch.setattr("lockstep.producers.agent.trace.PART_EVENTS", 5_000)
    status.clear()
    in_parts, notes_parts = read()
    assert sorted({w for w, _ in in_parts}) == [0, 1]
    assert in_parts == whole and notes_parts == notes
    assert any("numbered 0" in n and "numbered 1" in n for n in notes)
    # how far each large trace has got, part by part, for the progress bar
    first = [s for s in status if s.startswith("reading first.json: ")]
    assert len(first) >= 2 and first[-1] == "reading first.json: 6 steps"


@pytest.mark.slow  # two spawned pool processes read the traces
def test_traces_read_by_a_pool_tell_the_caller_how_far_each_part_got_as_read_here(tmp_path, monkeypatch):
    """``--jobs 2``: each pool process tells the calling process's ``status`` how many steps of a trace it has read,
    after each part (the parts the caller's ``PART_EVENTS`` makes, passed on to the processes), every file's in
    order, before its ``progress``; the inputs are those one process reads, with the same statuses."""
    from lockstep.app import offline
    from lockstep.app.offline import load_inputs

    files = []
    for rank, times in ((0, 1), (1, 2)):
        trace = json.loads(_repeated(tmp_path / "r.json", times).read_text())
        trace["distributedInfo"]["rank"] = rank
        files.append(tmp_path / f"rank-{rank}.json")
        files[-1].write_text(json.dumps(trace))
    monkeypatch.setattr("lockstep.producers.agent.trace.PART_EVENTS", 5_000)

    def read(jobs: int) -> tuple[dict, list[str], list]:
        heard: list = []
        inputs = load_inputs(files, None, None, jobs=jobs, status=heard.append, progress=heard.append)
        summaries = {(s.worker, s.step): _key(s) for s in inputs.summaries}
        return summaries, [*inputs.notes, inputs.expected_workers, *sorted(inputs.workers.items())], heard

    here, meta_here, heard_here = read(jobs=1)

    def not_here(*args, **kwargs):
        raise AssertionError("a trace read in the calling process: the pool was to read it")

    monkeypatch.setattr(offline, "POOL_MIN_FILES", 2)  # two files are enough for a pool
    monkeypatch.setattr(offline, "read_summarised", not_here)  # (the pool processes' own is not patched)
    pooled, meta_pooled, heard_pooled = read(jobs=2)
    assert pooled == here and meta_pooled == meta_here
    assert sorted({w for w, _ in pooled}) == [0, 1] and len(pooled) == 2 + 4

    # while both files are read at once, each says the other is too
    others = [s.partition(" (")[2] for s in heard_pooled if isinstance(s, str) and " (" in s]
    assert set(others) <= {"and 1 more file(s) being read)"}, others
    heard_pooled = [s.partition(" (")[0] if isinstance(s, str) else s for s in heard_pooled]
    for path, steps in zip(files, (2, 4), strict=True):
        told = [s for s in heard_pooled if isinstance(s, str) and s.startswith(f"reading {path.name}: ")]
        assert told == [s for s in heard_here if isinstance(s, str) and s.startswith(f"reading {path.name}: ")]
        assert len(told) >= 2 and told[-1] == f"reading {path.name}: {steps} steps", told
        counts = [int(s.rpartition(": ")[2].split()[0]) for s in told]
        assert counts == sorted(set(counts))  # part by part, in order
        assert heard_pooled.index(told[-1]) < heard_pooled.index(path)  # before the file is done
    assert heard_pooled[-1] == "reading"  # the line says no one file's progress once the pool is done
