"""Arrow tables that lie about their contents: a dictionary index outside its dictionary, offsets and lengths past
their buffers, bytes flipped anywhere in the table.  Each becomes one ``bad_function_table`` dead letter for the one
record that carried it; the stages go on with the window's other workers; nothing outside the table reaches a message.

Before: the reader trusted what Arrow's IPC reader returned (it checks the framing, not the values), so a 2.5 KB
``WindowFeatures`` whose ``kind`` column held index -5 made the processor read outside the table (a segfault 0.5 s
later, again on every restart as the record was replayed), and copied heap bytes into the dead letter's text.

The structure-aware fuzzer (``scripts/fuzz.py``) runs here for a bounded number of iterations in a process of its
own (a crash is its exit status, not this test run's end), and for a minute under ``slow``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import cramjam
import msgspec
import numpy as np
import pyarrow as pa
import pytest

from lockstep.kafka import Topics, window_features_key
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas import functions as ft
from lockstep.schemas.records import DeadLetter, RecordError, StepSlice, WindowFeatures, decode, encode
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Processor, Tables
from tests.paths import ROOT

TOPICS = Topics.named("t")
SIM = FleetSimulator(
    Scenario(
        job="j",
        topology=Topology(workers=4, gpus_per_host=4),
        faults=(Fault(type="gpu_slow", workers=(1,), severity=0.4),),
    )
)


def _window_features() -> list[WindowFeatures]:
    trigger = msgspec.structs.replace(SIM.trigger(Window(60, 2)), shard_workers=4)
    return SIM.window_features([SIM.step(s) for s in (60, 61)], trigger, sent_at=1.8e9)


def _ipc(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return bytes(sink.getvalue().to_pybytes())


def _with_index(rec: WindowFeatures, column: str, index: int) -> WindowFeatures:
    """``rec`` with the first row of a dictionary column pointing at ``index``, uncompressed (the bytes reach Arrow)."""
    t = ft.read_compact(rec.functions, rec.functions_codec)
    col = t.column(column).combine_chunks()
    idx = col.indices.to_numpy().astype(np.int32)
    idx[0] = index
    bad = pa.DictionaryArray.from_buffers(col.type, len(col), [None, pa.array(idx).buffers()[1]], col.dictionary)
    t = t.set_column(t.schema.get_field_index(column), t.schema.field(column), bad)
    return msgspec.structs.replace(rec, functions=_ipc(t), functions_codec="none")


@pytest.mark.parametrize("column", ["function", "kind", "resource"])
@pytest.mark.parametrize("index", [-5, -1, 1 << 20, -(2**31)])
def test_a_dictionary_index_outside_its_dictionary_is_refused_with_a_reason_and_no_foreign_bytes(column, index):
    rec = _with_index(_window_features()[1], column, index)
    with pytest.raises(RecordError) as err:
        ft.read_compact(rec.functions, rec.functions_codec)
    assert err.value.reason == "bad_function_table" and "out of bounds" in err.value.detail
    # the message names the index and the dictionary's length, nothing read from outside the table
    assert err.value.detail.isascii() and len(err.value.detail) < 400


def test_the_shard_stage_dead_letters_only_the_lying_record_and_the_window_goes_on():
    out = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=lambda: 1.8e9)
    recs = _window_features()
    recs[1] = _with_index(recs[1], "kind", -5)

    async def go():
        for r in recs:
            await proc.shards.on_record(
                out.append(TOPICS.windowfeatures, window_features_key(r.job, r.window, r.shard), encode(r))
            )
        await proc.shards.on_timer(1.8e9 + 60)

    asyncio.run(go())
    dead = [d for d in out.decoded(TOPICS.deadletter) if isinstance(d, DeadLetter)]
    assert [(d.offset, d.reason) for d in dead] == [(1, "bad_function_table")], dead
    slices = [s for s in out.decoded(TOPICS.features) if isinstance(s, StepSlice)]
    assert {s.step for s in slices} == {60, 61}
    assert all(s.missing == [1] for s in slices), [s.missing for s in slices]  # the other three workers go on


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_bytes_flipped_anywhere_in_a_window_table_are_read_or_refused_never_a_crash(seed):
    """Byte positions of one record's table (1,500 of them, or all) set at random in turn, in a process of its own: Arrow reads it (and the
    values check decides) or it is one RecordError; the process never dies."""
    code = f"""
import random, msgspec, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.adversarial.test_arrow import _window_features, _ipc
from lockstep.schemas import functions as ft
from lockstep.schemas.records import RecordError
rec = _window_features()[{seed}]
raw = _ipc(ft.read_compact(rec.functions, rec.functions_codec))
rng = random.Random({seed})
refused = read = 0
for i in rng.sample(range(len(raw)), min(len(raw), 1500)):
    b = bytearray(raw)
    b[i] = rng.randrange(256)
    try:
        t = ft.read_compact(bytes(b), "none")
        ft.bad_owners(t, __import__("numpy").zeros(t.num_rows, dtype="int64"), 1)
        read += 1
    except RecordError:
        refused += 1
print(refused, read)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    refused, read = map(int, out.stdout.split())
    assert refused > 0 and refused + read >= 1500


def _fuzz(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode in (0, 1), f"the fuzzed processor died (exit {out.returncode}): {out.stderr[-2000:]}"
    result = json.loads(out.stdout.splitlines()[-1])
    assert out.returncode == 0 and not result["bugs"], result
    assert result["peak_rss_mib"] <= result["max_rss_mib"], result
    # the mutations reached the stages: each kind of refusal was seen
    assert {"bad_function_table", "malformed", "invalid"} <= set(result["dead_letters"]), result
    return result


def test_the_stages_under_the_structure_aware_fuzzer_decode_or_dead_letter_never_crash():
    result = _fuzz("--iterations", "60", "--seed", "7")
    assert result["iterations"] == 60


@pytest.mark.slow  # a minute of fuzzing: its point is the number of inputs
def test_a_minute_of_fuzzing_finds_no_crash_and_memory_stays_bounded():
    _fuzz("--seconds", "60", "--seed", "2026")


def test_a_window_features_record_with_a_negative_kind_index_is_what_the_issue_reported():
    """The reported record: 2.5 KB or so, one negative index; its dead letter carries the reason, not heap bytes."""
    rec = _with_index(_window_features()[0], "kind", -5)
    rec = msgspec.structs.replace(rec, functions=bytes(cramjam.zstd.compress(rec.functions)), functions_codec="zstd")
    assert len(encode(rec)) < 4096
    with pytest.raises(RecordError) as err:
        got = decode(encode(rec), WindowFeatures)
        ft.read_compact(got.functions, got.functions_codec)
    assert "-5" in err.value.detail


@pytest.mark.parametrize(
    ("field", "value", "detail"),
    [
        ("window_steps", 200, "exceeds the policy's max_window_steps (64)"),
        ("shard_workers", 100_000, "shard_workers 100000 exceeds 4096"),
    ],
)
def test_sizes_a_record_declares_beyond_what_a_trigger_asks_are_refused(field, value, detail):
    """Before: one 2 KB WindowFeatures claiming window_steps=200, shard_workers=100000, expected_workers=10000000
    made the shard stage build 200 slices in memory (1.85 GB) and publish 74 MB."""
    out = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=lambda: 1.8e9)
    rec = msgspec.structs.replace(_window_features()[0], expected_workers=10_000_000, **{field: value})
    if field == "shard_workers":
        rec = msgspec.structs.replace(rec, shard=0)

    async def go():
        await proc.shards.on_record(
            out.append(TOPICS.windowfeatures, window_features_key(rec.job, rec.window, rec.shard), encode(rec))
        )
        await proc.shards.on_timer(1.8e9 + 60)

    asyncio.run(go())
    dead = [d for d in out.decoded(TOPICS.deadletter) if isinstance(d, DeadLetter)]
    assert [(d.reason, detail in d.detail) for d in dead] == [("invalid", True)], dead
    assert out.decoded(TOPICS.features) == []


def test_a_stage_past_its_memory_budget_closes_its_largest_step_and_holds_no_more():
    """Before: decompressed tables were held until their step closed, bounded per record (64 MiB) but not per step or
    stage: 20 records, 4.5 MB on the wire, held +1.07 GB until the timeout."""
    out = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, out, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=lambda: 1.8e9)
    proc.steps.budget_bytes = 8 << 10
    trigger = msgspec.structs.replace(SIM.trigger(Window(60, 2)), expected_workers=1000)  # steps that never complete
    batches = [b for s in (60, 61) for b in SIM.feature_batches(SIM.step(s), trigger, sent_at=1.8e9)]
    from lockstep.kafka import features_key

    async def go():
        for b in batches:
            await proc.steps.on_record(out.append(TOPICS.features, features_key(b.job, b.step), encode(b)))
            assert proc.steps.assembler.held_bytes <= proc.steps.budget_bytes

    asyncio.run(go())
    assert proc.metrics.get("budget_closes_total", stage="steps") >= 1
    assert proc.metrics.get("steps_closed_total", reason="budget") >= 1
    assert out.decoded(TOPICS.stepreports)  # what it held was diagnosed, not dropped


def test_a_table_with_two_columns_of_one_name_is_refused_with_its_record():
    """Found by the fuzzer: a flipped byte turned one column's name into another's, and the shard stage's
    concatenation of its workers' tables failed for the whole shard (processing_failed)."""
    rec = _window_features()[0]
    t = ft.read_compact(rec.functions, rec.functions_codec)
    dup = pa.Table.from_arrays([*t.columns, t.column("calls")], names=[*t.column_names, "calls"])
    with pytest.raises(RecordError, match="duplicate column names"):
        ft.read_compact(_ipc(dup), "none")
