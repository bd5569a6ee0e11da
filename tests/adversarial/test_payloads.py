"""Compressed payloads that expand without bound, and records nested without bound: refused with a reason,
in bounded memory, and the reader goes on reading good records.

Each case runs in a fresh interpreter (``run_isolated``) that reads the hostile bytes, calls the very function
the processor calls, then reads a good record; its peak resident memory may grow by at most the bound.
"""

from __future__ import annotations

import msgspec
import pytest

from lockstep.schemas import functions as ft
from lockstep.schemas.records import FeatureBatch, StepReport, WorkerMeta, encode

pytestmark = pytest.mark.slow  # every case decodes in a fresh interpreter, to measure its peak memory

GOOD_TABLE = ft.make_table(
    {
        "function": ["a", "b"],
        "kind": ["compute", "python"],
        "calls": [1, 2],
        "total_us": [5.0, 6.0],
        "critical_us": [5.0, 6.0],
    }
)
GOOD = FeatureBatch(
    job="j",
    window="w",
    step=3,
    window_start=3,
    window_steps=1,
    expected_workers=1,
    worker=WorkerMeta(rank=0, host="h"),
    step_time_us=100.0,
    functions=ft.pack(GOOD_TABLE),
)
REPORT = StepReport(
    job="j",
    window="w",
    step=3,
    window_start=3,
    window_steps=1,
    expected_workers=1,
    workers_seen=1,
    bytes_in=1,
    step_time_us=100.0,
    step_time_median_us=100.0,
    work_max_us=90.0,
    healthy_work_max_us=90.0,
    outliers=b"",
    groups=b"",
)

SETUP = """
from pathlib import Path
from lockstep.schemas import functions as ft
from lockstep.schemas.records import FeatureBatch, RecordError, StepReport, decode
from lockstep.streams.diagnosis import step_result
hostile = Path({hostile!r}).read_bytes()
good = Path({good!r}).read_bytes()
"""
#: what the step stage does with a feature batch, then the same with a good one
READ_FEATURES = """
result = {}
try:
    b = decode(hostile, FeatureBatch)
    ft.read(b.functions, b.functions_codec)
except RecordError as err:
    result["reason"], result["detail"] = err.reason, err.detail
g = decode(good, FeatureBatch)
result["good_rows"] = ft.conform(ft.read(g.functions, g.functions_codec)).num_rows
"""
#: what the window stage does with a step report
READ_REPORT = """
result = {}
try:
    step_result(decode(hostile, StepReport))
except RecordError as err:
    result["reason"], result["detail"] = err.reason, err.detail
result["good_rows"] = ft.conform(ft.read(decode(good, FeatureBatch).functions)).num_rows
"""


def _batch(functions: bytes, codec: str = "zstd") -> bytes:
    return encode(msgspec.structs.replace(GOOD, functions=functions, functions_codec=codec))


CASES = {
    # (payload from the helpers, reader, what its detail says, bound on the reader's memory growth in MiB)
    "feature batch, 33 KiB of zstd expanding to 1 GiB": (
        lambda h: _batch(h.zstd_bomb(h.GiB)),
        READ_FEATURES,
        "expands beyond",
        200,
    ),
    "feature batch, a zstd frame declaring 1 TiB": (
        lambda h: _batch(h.zstd_declaring(1 << 40)),
        READ_FEATURES,
        "declares 1099511627776 bytes",
        64,
    ),
    "feature batch, Arrow IPC compressing 1 GiB in its own buffers": (
        lambda h: _batch(h.ipc_compressed_bomb(), "none"),
        READ_FEATURES,
        "compressed inside",
        64,
    ),
    "feature batch, the same IPC inside zstd": (
        lambda h: _batch(h.zstd(h.ipc_compressed_bomb())),
        READ_FEATURES,
        "compressed inside",
        64,
    ),
    "step report, outliers of 33 KiB of zstd expanding to 1 GiB": (
        lambda h: _report(outliers=h.zstd_bomb(h.GiB)),
        READ_REPORT,
        "expands beyond",
        200,
    ),
    "step report, outliers in compressed Arrow IPC": (
        lambda h: _report(outliers=h.zstd(h.ipc_compressed_bomb())),
        READ_REPORT,
        "compressed inside",
        64,
    ),
}


def _report(**tables: bytes) -> bytes:
    empty = ft.pack(GOOD_TABLE[:0])
    return encode(msgspec.structs.replace(REPORT, **{"outliers": empty, "groups": empty, **tables}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_payload_that_would_expand_without_bound_is_refused_in_bounded_memory(case, tmp_path, hostile):
    make, reader, detail, bound_mb = CASES[case]
    (tmp_path / "hostile").write_bytes(make(hostile))
    (tmp_path / "good").write_bytes(encode(GOOD))
    out = hostile.run_isolated(SETUP.format(hostile=str(tmp_path / "hostile"), good=str(tmp_path / "good")), reader)
    print(f"\nRELIABILITY hostile: {case}: the reader grew {out['grew_mb']:.0f} MiB")
    assert out["reason"] == "bad_function_table" and detail in out["detail"], out
    assert out["grew_mb"] < bound_mb, out  # before: 1.1 GiB and more
    assert out["good_rows"] == 2  # and the reader goes on


@pytest.mark.parametrize("form", ["json", "msgpack"])
def test_a_record_nested_without_bound_is_malformed_and_the_reader_goes_on(form, tmp_path, hostile):
    deep = {"json": b'{"a":' * 100_000, "msgpack": b"\x81\xa1a" * 100_000 + b"\xc0"}[form]
    (tmp_path / "hostile").write_bytes(deep)
    (tmp_path / "good").write_bytes(encode(GOOD))
    out = hostile.run_isolated(
        SETUP.format(hostile=str(tmp_path / "hostile"), good=str(tmp_path / "good")), READ_FEATURES
    )
    assert out["reason"] == "malformed" and out["good_rows"] == 2 and out["grew_mb"] < 64, out
