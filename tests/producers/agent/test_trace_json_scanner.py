"""The trace reader's native scanner (producers/agent/_tracescan.c) against the msgspec path it stands in for.

The scanner accepts a subset of what msgspec decodes and must give the same columns for it; everything else it gives
up on (None), and msgspec decodes the run.  So the oracle for every test here is the reader with the scanner switched
off: the same bytes must give equal columns (or the same error).
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import shutil
import sysconfig
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.producers.agent import trace_json
from lockstep.producers.agent.trace_json import ColumnBuilder, TraceReadError, _decode_run, read_file

TRACES = Path(__file__).parents[2] / "data" / "traces"
NATIVE = trace_json.native_scan


def _buildable() -> bool:
    return shutil.which("cc") is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def test_the_scanner_is_built_where_a_compiler_is() -> None:
    """`pip install` builds it where a C compiler and Python's headers are (CI has both): the reader at its speed."""
    if not _buildable():
        pytest.skip("no C compiler or no Python headers here: the reader decodes with msgspec")
    assert NATIVE is not None, "the native scanner was not built: `pip install -e .` again and read its output"


needs_native = pytest.mark.skipif(NATIVE is None, reason="the native scanner is not built here")


def _read(data: bytes, native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    with monkeypatch.context() as m:
        m.setattr(trace_json, "native_scan", NATIVE if native else None)
        try:
            return read_file(io.BytesIO(data), 1 << 40)
        except TraceReadError as exc:
            return ("error", str(exc))


def _assert_same(a: tuple, b: tuple) -> None:
    if a[0] == "error" or b[0] == "error":
        assert a == b
        return
    assert a[0] == b[0]
    for f in fields(a[1]):
        x, y = getattr(a[1], f.name), getattr(b[1], f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


class _Counted:
    """The scanner, counting the runs it read and those it gave up on."""

    def __init__(self) -> None:
        self.read = self.gave_up = 0

    def __call__(self, buf: bytearray, lo: int, hi: int) -> tuple | None:
        out = NATIVE(buf, lo, hi)
        self.read += out is not None
        self.gave_up += out is None
        return out


@needs_native
@pytest.mark.parametrize("name", sorted(p.name for p in TRACES.glob("*.json.gz")))
def test_every_public_trace_is_scanned_natively_into_the_columns_msgspec_gives(name, monkeypatch) -> None:
    data = gzip.decompress((TRACES / name).read_bytes())
    counted = _Counted()
    monkeypatch.setattr(trace_json, "native_scan", counted)
    native = read_file(io.BytesIO(data), 1 << 40)
    monkeypatch.setattr(trace_json, "native_scan", None)
    _assert_same(native, read_file(io.BytesIO(data), 1 << 40))
    assert counted.read >= 1 and counted.gave_up == 0  # Kineto's traces, string pids included, never fall back


def _trace(events: list, ensure_ascii: bool, sep: tuple[str, str]) -> bytes:
    body = ",\n".join(json.dumps(e, ensure_ascii=ensure_ascii, separators=sep) for e in events)
    return ('{"traceEvents": [' + body + "]}").encode()


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", "ac2g", "async", "kernel", 'a"b', "a\\b", "}, {", "ü", "\x01", "\U0001d518"]
)
_int = st.integers(-(2**63), 2**64) | st.integers(-5, 5) | st.sampled_from([2**62 - 1, 2**62, 10**18, 10**17])
_num = (
    _int
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.1, 1683564901540885.123, 4203669603018.756, 1e-7, 123456789.0])
)


@needs_native
@pytest.mark.parametrize(
    "text",
    ["174041096073403.4221", "1683564901540885.123", "0.1", "9007199254740993", "4203669603018.756", "-0.0", "5e-324"],
)
def test_numbers_read_as_the_nearest_double(text, monkeypatch) -> None:
    """Digits beyond 2**53 are rounded once, not twice (``174041096073403.4221`` read as its digits over 10**4 is one
    ulp off)."""
    data = b'{"traceEvents": [{"ph": "X", "ts": %s, "dur": 1}]}' % text.encode()
    scanned = _read(data, True, monkeypatch)
    assert scanned[1].ts[0] == float(text)
    _assert_same(scanned, _read(data, False, monkeypatch))


_junk = st.recursive(
    st.none() | st.booleans() | _num | _text,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3),
    max_leaves=6,
)
_args = st.fixed_dictionaries(
    {},
    optional={
        "correlation": _int | _junk,
        "device": _int,
        "bytes": _num,
        "Process Group Description": _text,
        "Process Group Name": _text,
        "Seq": _int,
        "External id": _junk,
    },
)
_event = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.sampled_from(["X", "X", "X", "s", "f", "M", "i", "XX", ""]),
        "cat": st.sampled_from(["ac2g", "async", "kernel", "cpu_op", "", "ac2\\u0067"]) | _text,
        "name": _text,
        "pid": _int | st.sampled_from(["Spans", "7", ""]),
        "tid": _int | st.sampled_from(["PyTorch Profiler", "25772", "stream 7"]),
        "ts": _num,
        "dur": _num,
        "id": _int | _text | st.none(),
        "args": _args,
        "extra": _junk,
    },
)


@needs_native
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    events=st.lists(_event, min_size=1, max_size=12),
    ensure_ascii=st.booleans(),
    sep=st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", " :\r\n ")]),
)
def test_generated_events_read_the_same_scanned_or_decoded(events, ensure_ascii, sep, monkeypatch) -> None:
    data = _trace(events, ensure_ascii, sep)
    _assert_same(_read(data, True, monkeypatch), _read(data, False, monkeypatch))


def _decoded(run: bytes) -> ColumnBuilder | None:
    b = ColumnBuilder()
    try:
        b.add(_decode_run(b"[" + run + b"]"))
    except Exception:
        return None
    return b


@needs_native
def test_mutated_bytes_never_crash_the_scanner_and_what_it_accepts_msgspec_reads_the_same() -> None:
    """A real trace's events, bytes flipped, inserted and cut at random: the scanner reads no byte outside the run
    (this would crash or read garbage), and any run it accepts is one msgspec decodes to the same columns."""
    data = gzip.decompress((TRACES / "sampled_rank-0.json.gz").read_bytes())
    lo = data.index(b"[", data.index(b'"traceEvents"')) + 1
    base = data[lo : lo + 40_000]
    base = base[: [m.start() for m in re.finditer(rb"\}\s*,\s*\{", base)][-1] + 1]  # whole events
    rng = random.Random(7)
    accepted = 0
    for _ in range(1500):
        b = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(b))
            what = rng.random()
            if what < 0.4:
                b[at] = rng.choice(b'"\\{}[],:0123456789.eE-+ \x00\x1f\x80\xc3\xff' + bytes([rng.randrange(256)]))
            elif what < 0.7:
                b[at:at] = rng.choice([b'"', b"\\", b"{", b"}", b",", b'"\\u', b"\xf0\x9d", b"1e999", b"[[[["])
            else:
                del b[at : at + rng.randint(1, 30)]
        a, z = sorted(rng.randrange(len(b) + 1) for _ in range(2)) if rng.random() < 0.3 else (0, len(b))
        out = NATIVE(b, a, z)
        if out is None:
            continue
        accepted += 1
        want = _decoded(bytes(b[a:z]))
        assert want is not None, bytes(b[a:z])[:200]
        got = ColumnBuilder()
        got.add_scanned(out)
        ga, wa = got.columns(), want.columns()
        for f in fields(ga):
            x, y = getattr(ga, f.name), getattr(wa, f.name)
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y, err_msg=f.name)
            else:
                assert x == y, f.name
    assert accepted > 100  # the mutations that leave valid JSON were read, not all given up on


@needs_native
@pytest.mark.parametrize(
    "run",
    [
        b'{"ph": "s", "cat": "ac2g", "id": "0x1", "ts": 1}',  # a flow id written as a string
        b'{"na\\u006de": "a"}',  # a key spelt with escapes
        b'{"ph": "X", "ts": 1, "ts": 2}',  # a field twice
        b'{"ph": "X", "pid": 1234567890123456789}',  # beyond 18 digits
        b'{"ph": "X", "ts": NaN}',
        b'{"ph": "X", "name": "\\ud800"}',  # a surrogate alone
        b'{"ph": "X", "name": "\\udc00x"}',
        b'{"ph": "X", "name": "a\x01"}',  # a control character
        b'{"ph": "X", "name": "\xc3("}',  # not UTF-8
        b'{"ph": "X", "args": ' + b"[" * 70 + b"]" * 70 + b"}",  # nested beyond the scanner's depth
        b'{"ph": "X"},',  # a trailing comma
        b'{"ph": "X", "ts": 01}',
        b'{"ph": "X", "ts": 1.}',
        b'{"ph": "X", "args": null}',
        b'{"ph": "X", "cat": null}',
        b'{"ph": "X", "pid": 1.0}',
        b'{"ph": "X", "ts": 1}{"ph": "X"}',
        b"[]",
    ],
)
def test_the_scanner_gives_up_on_what_it_does_not_read_exactly(run) -> None:
    assert NATIVE(bytearray(run), 0, len(run)) is None


@needs_native
def test_the_scanner_never_reads_past_the_end_it_is_given() -> None:
    run = bytearray(b'{"ph": "X", "ts": 12, "dur": 3}')
    assert NATIVE(run, 0, len(run)) is not None
    for hi in range(len(run)):  # every cut short: given up on, whatever follows in the buffer
        assert NATIVE(run, 0, hi) is None
    with pytest.raises(ValueError):
        NATIVE(run, 0, len(run) + 1)
