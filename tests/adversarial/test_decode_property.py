"""Property: whatever the bytes (any nesting depth, any size, any compressed payload), the decoders raise their
own error with a reason and nothing else."""

from __future__ import annotations

import cramjam
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.schemas import functions as ft
from lockstep.schemas.compression import CompressionError, zstd_decompress
from lockstep.schemas.records import (
    DEAD_LETTER_REASONS,
    MAX_RECORD_BYTES,
    FeatureBatch,
    RecordError,
    WorkerMeta,
    decode,
    encode,
)
from tests.tiers import examples

OPEN = {  # one level of nesting, in each form a record can take
    "json object": b'{"schema":',
    "json array": b"[",
    "msgpack map": b"\x81\xa6schema",
    "msgpack array": b"\x91",
}
VALID = encode(
    FeatureBatch(
        job="j",
        window="w",
        step=1,
        window_start=1,
        window_steps=1,
        expected_workers=1,
        worker=WorkerMeta(rank=0, host="h"),
        step_time_us=1.0,
        functions=b"x",
    )
)


@settings(max_examples=examples(150), deadline=None)
@given(
    form=st.sampled_from(sorted(OPEN)),
    depth=st.one_of(st.integers(0, 64), st.integers(64, 300_000)),
    tail=st.binary(max_size=64),
    head=st.sampled_from([b"", b" ", b"\n"]),
)
def test_decode_raises_only_record_errors_at_any_depth(form, depth, tail, head):
    data = head + OPEN[form] * depth + tail
    try:
        decode(data)
    except RecordError as err:
        assert err.reason in DEAD_LETTER_REASONS
    # and it still reads a good record afterwards
    assert decode(VALID).job == "j"


@settings(max_examples=examples(6), deadline=None)
@given(extra=st.integers(1, 1 << 20), filler=st.sampled_from([b" ", b"[", b"\x91"]))
def test_decode_refuses_any_record_over_the_size_bound_before_parsing(extra, filler):
    data = b"{" + filler * (MAX_RECORD_BYTES + extra)
    try:
        decode(data)
    except RecordError as err:
        assert err.reason == "malformed" and "over the" in err.detail
    else:
        raise AssertionError("a record over the size bound was parsed")


@st.composite
def compressed(draw) -> bytes:
    """Garbage; real frames cut short or with bytes flipped; frames with a lying header; several frames."""
    body = draw(st.binary(max_size=4096))
    frame = bytes(cramjam.zstd.compress(body))
    kind = draw(st.sampled_from(["garbage", "cut", "flipped", "lying size", "frames"]))
    if kind == "garbage":
        return draw(st.binary(max_size=256))
    if kind == "cut":
        return frame[: draw(st.integers(0, len(frame)))]
    if kind == "flipped":
        i = draw(st.integers(0, len(frame) - 1))
        return frame[:i] + bytes([frame[i] ^ draw(st.integers(1, 255))]) + frame[i + 1 :]
    if kind == "lying size":
        size = draw(st.integers(0, 1 << 62))
        return b"\x28\xb5\x2f\xfd\xe0" + size.to_bytes(8, "little") + frame[draw(st.integers(5, len(frame))) :]
    return frame * draw(st.integers(2, 5))


@settings(max_examples=examples(300), deadline=None)
@given(data=compressed(), bound=st.integers(0, 1 << 16))
def test_bounded_decompression_returns_at_most_the_bound_or_says_why(data, bound):
    try:
        out = zstd_decompress(data, bound)
    except CompressionError as err:
        assert str(err)
    else:
        assert len(out) <= bound


@settings(max_examples=examples(200), deadline=None)
@given(data=compressed(), codec=st.sampled_from(["zstd", "none"]))
def test_function_tables_raise_only_record_errors(data, codec):
    try:
        ft.read(data, codec)
    except RecordError as err:
        assert err.reason == "bad_function_table" and err.detail
