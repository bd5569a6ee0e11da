"""Chrome-trace JSON read as it is parsed: a file (gzip streamed) -> the trace's metadata and its events as columns.

``torch.profiler`` writes one JSON object, ``{"traceEvents": [...], "distributedInfo": ..., ...}``, whose
``traceEvents`` array is almost all of it.  Reading it whole costs about ten times its size in memory
(the bytes, then a Python object per event and field).  Here the file is read in slices of
:data:`WINDOW` bytes (gunzipped as it is read, when it is gzip): the top-level object is walked key by
key, and the ``traceEvents`` array is cut at the last event boundary of each slice and that run of
events read into a few numpy columns (strings as codes of a dictionary, since traces repeat the same few
thousand names): by the native scanner (``_tracescan.c``, :func:`_scan`), which reads what torch.profiler
writes with no Python object per event, or, where it gives up or is not built, by msgspec into structs,
which are at once turned into the same columns and dropped.  What stays is
:class:`Columns`: about 60 bytes per complete (``"ph": "X"``) event and 21 per flow event, whatever the
JSON spent on them (names, ``args``), and nothing of other events (metadata, counters, instants).

**Cutting the array.**  The last ``}`` of a slice that is followed by ``, {`` or ``]`` is tried first (a
``}, `` alone is common inside kernel names' templates):
if ``[`` + the slice up to it + ``]`` decodes as a list of events, the cut is at an event boundary
(the decoder's state there is the state the whole array's decoding would have: after a complete
value at depth one).  If it does not decode (a ``}`` inside a string or a nested object), the
boundaries are found exactly by a vectorised scan of the slice's strings and brackets.  An event
larger than :data:`MAX_EVENT_BYTES`, or a top-level value other than ``traceEvents`` larger than
:data:`MAX_META_BYTES`, is refused.

**Bounds.**  Every byte read counts against ``max_bytes`` (for gzip, the bytes *after*
decompression, as they are inflated): a gzip bomb is refused when its content reaches the limit,
having cost the time to inflate that much and the memory of one slice.  Memory: one slice (4 MiB,
a few copies of it while it is decoded) + the columns; see docs/offline.md ("Traces of any size,
many ranks" and "The reader's speed and memory, measured") for the measured figures.
"""

from __future__ import annotations

import ctypes
import gzip
import logging
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np
import pyarrow as pa

from ...schemas.errors import LockstepError

#: ``scan(buffer, lo, hi)``, the native scanner (producers/agent/_tracescan.c, built by `pip install` where a C
#: compiler is); None where it is not built (or switched off, as the benchmark's baseline and the tests do): msgspec
#: then decodes every run
native_scan: Callable[[bytearray, int, int], tuple | None] | None
try:
    from ._tracescan import scan as native_scan
except ImportError:  # pragma: no cover - a build without a compiler
    native_scan = None
_unbuilt_told = native_scan is not None  # where it is built there is nothing to tell

log = logging.getLogger(__name__)

#: bytes of JSON decoded at once
WINDOW = 4 << 20
#: the largest single event accepted (kernel names with their templates run to a few kilobytes)
MAX_EVENT_BYTES = 64 << 20
#: the largest top-level value other than traceEvents (distributedInfo with its process groups, ...)
MAX_META_BYTES = 64 << 20
#: top-level keys kept (the rest is skipped as it is read)
META_KEYS = ("distributedInfo", "deviceProperties", "host_name", "hostName", "trace_id")
#: flow categories whose events join a launch to its device work
FLOW_CATS = ("ac2g", "async")


class TraceReadError(LockstepError, ValueError):
    """The bytes are not a readable Chrome trace; the message says why (the reader re-raises it as TraceError)."""


class _Args(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=False):
    correlation: Any = None
    device: Any = None
    bytes: Any = None
    pg_desc: Any = msgspec.field(name="Process Group Description", default=None)
    pg_name: Any = msgspec.field(name="Process Group Name", default=None)
    seq: Any = msgspec.field(name="Seq", default=None)


_NO_ARGS = _Args()
_ABSENT = -(2**63)


class _TypedArgs(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=False):
    """``args`` as torch.profiler writes them: decoded and checked in C (a run with other types is decoded again
    as :class:`_Args`)."""

    correlation: int = _ABSENT
    device: int = _ABSENT
    bytes: int | float = _ABSENT
    pg_desc: str = msgspec.field(name="Process Group Description", default="")
    pg_name: str = msgspec.field(name="Process Group Name", default="")
    seq: int = msgspec.field(name="Seq", default=_ABSENT)


_NO_TYPED_ARGS = _TypedArgs()


class ChromeEvent(msgspec.Struct, gc=False, forbid_unknown_fields=False):
    """One trace event, the fields the reader uses (``gc=False``: millions of them are made and dropped)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: _Args = _NO_ARGS


class _TypedEvent(msgspec.Struct, gc=False, forbid_unknown_fields=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int = 0  # a run with a pid or tid written as a string is decoded loosely
    tid: int = 0
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: _TypedArgs = _NO_TYPED_ARGS


class Head(msgspec.Struct, forbid_unknown_fields=False):
    """The trace's top-level fields other than its events."""

    distributedInfo: dict[str, Any] = {}
    deviceProperties: list[dict[str, Any]] = []
    host_name: str = ""
    hostName: str = ""
    trace_id: str = ""


class _Whole(Head, forbid_unknown_fields=False):
    traceEvents: list[ChromeEvent] = []


_events = msgspec.json.Decoder(list[ChromeEvent])
_typed_events = msgspec.json.Decoder(list[_TypedEvent])


def _decode_run(data: bytes | memoryview) -> list:
    """A run of events: typed in C when the args are as torch.profiler writes them, else loosely."""
    try:
        return _typed_events.decode(data)
    except msgspec.ValidationError:
        return _events.decode(data)


_WS = re.compile(rb"[ \t\r\n]*")
_AFTER = re.compile(rb"[ \t\r\n]*(?:,[ \t\r\n]*\{|\])")  # an event ends: the next begins, or the array
_KEY = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(rb"[^,}\]\s]+")


# --------------------------------------------------------------------------- columns


class _Dictionary:
    """Strings -> codes, each distinct string stored once."""

    def __init__(self) -> None:
        self.code: dict[str, int] = {}

    def encode_strings(self, get: attrgetter, events: list) -> np.ndarray:
        """Codes of a string field of ``events`` (the decoder made them ``str``): looked up in the dictionary in C,
        new ones numbered in the order they first occur (as :meth:`encode` numbers them)."""
        code = self.code
        try:
            return np.fromiter(map(code.get, map(get, events)), np.int32, len(events))
        except TypeError:  # a string not seen before (None)
            for s in map(get, events):
                if s not in code:
                    code[s] = len(code)
            return np.fromiter(map(code.get, map(get, events)), np.int32, len(events))

    def recode(self, local: np.ndarray, strings: list[str], first: bytes) -> np.ndarray:
        """Codes of ``local`` (indices into ``strings``; ``first``, int32: those it holds, in the order they first
        occur in it), new strings numbered in that order."""
        lut = np.zeros(len(strings), dtype=np.int32)
        code = self.code
        for u in np.frombuffer(first, dtype=np.int32).tolist():
            lut[u] = code.setdefault(strings[u], len(code))
        return lut[local]

    def encode(self, values: list) -> np.ndarray:
        if not values:
            return np.empty(0, dtype=np.int32)
        try:
            arr = pa.array(values, pa.string()).dictionary_encode()
        except (pa.ArrowException, TypeError):  # not all strings (a process group named by a number)
            arr = pa.array([str(v) for v in values], pa.string()).dictionary_encode()
        local = np.array([self.code.setdefault(s, len(self.code)) for s in arr.dictionary.to_pylist()], np.int32)
        return local[arr.indices.to_numpy(zero_copy_only=False)]

    def strings(self) -> list[str]:
        return list(self.code)


@dataclass
class Columns:
    """The events a trace reader needs, as columns: complete events (``X``) and flow events (``s``/``f``).

    Strings are int32 codes into the ``*_dict`` lists; ``stream`` is the event's ``pid/tid`` timeline.
    """

    cat: np.ndarray  # int32 -> cat_dict
    name: np.ndarray  # int32 -> name_dict
    ts: np.ndarray  # float64 µs
    dur: np.ndarray  # float64 µs
    stream: np.ndarray  # int32 -> stream_dict ("pid/tid")
    corr: np.ndarray  # int64 args.correlation, -1 where absent or not an id
    device: np.ndarray  # int64 args.device, else the pid; -1 where neither is a number
    nbytes: np.ndarray  # float64 args.bytes, NaN where absent
    pg: np.ndarray  # int32 -> pg_dict: args' process group (description, else name), "" where none
    seq: np.ndarray  # int64 args.Seq (a collective's sequence number in its process group), -1 where absent
    cat_dict: list[str]
    name_dict: list[str]
    stream_dict: list[str]
    pg_dict: list[str]
    flow_is_end: np.ndarray  # bool: "f" (else "s")
    flow_id: np.ndarray  # int64 (ids that are not integers coded after 2**62)
    flow_ts: np.ndarray  # float64
    flow_stream: np.ndarray  # int32 -> stream_dict

    @property
    def size(self) -> int:
        return int(self.ts.size)


#: the column names and types of :class:`Columns`' arrays (complete events, then flow events)
EVENT_COLUMNS: dict[str, type] = {
    "cat": np.int32,
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "stream": np.int32,
    "corr": np.int64,
    "device": np.int64,
    "nbytes": np.float64,
    "pg": np.int32,
    "seq": np.int64,
}
FLOW_COLUMNS: dict[str, type] = {
    "flow_is_end": bool,
    "flow_id": np.int64,
    "flow_ts": np.float64,
    "flow_stream": np.int32,
}


@dataclass
class Spilled:
    """A trace's columns written to disk run by run (:class:`ColumnBuilder` with a spill folder), read back a chunk
    at a time: what a trace too large to hold whole is summarised from, a group of steps at a time
    (:func:`lockstep.producers.agent.trace.read_chrome_trace_parts`).  Each chunk is one ``.npy`` file per column
    in ``folder`` (the caller's to remove); the dictionaries are the whole trace's, ``relabel`` and ``pid_device``
    turn a chunk's stream codes and absent devices into what :meth:`ColumnBuilder.columns` gives."""

    folder: Path
    chunks: int
    cat_dict: list[str]
    name_dict: list[str]
    stream_dict: list[str]
    pg_dict: list[str]
    relabel: np.ndarray  # int32: a stream's code as read -> its code in stream_dict
    pid_device: np.ndarray  # int64: a stream (relabelled) -> its pid as a device number, -1 where not a number

    def load(self, chunk: int, *columns: str) -> Columns:
        """Chunk ``chunk`` as :class:`Columns` with these columns (all where none are named; the others empty)."""
        want = set(columns or (*EVENT_COLUMNS, *FLOW_COLUMNS))
        cols = {
            k: np.load(self.folder / f"{chunk}.{k}.npy") if k in want else np.empty(0, dtype)
            for k, dtype in (*EVENT_COLUMNS.items(), *FLOW_COLUMNS.items())
        }
        _finish(cols, self.relabel, self.pid_device)
        return Columns(
            **cols,
            cat_dict=self.cat_dict,
            name_dict=self.name_dict,
            stream_dict=self.stream_dict,
            pg_dict=self.pg_dict,
        )


def _finish(cols: dict[str, np.ndarray], relabel: np.ndarray | None, pid_device: np.ndarray) -> None:
    """Streams by their text's code, and a device event's device from its pid where its args name none; in place."""
    if relabel is not None:
        for k in ("stream", "flow_stream"):
            if cols[k].size:
                cols[k] = relabel[cols[k]]
    dev = cols["device"]
    absent = dev == -2
    if absent.any():
        dev[absent] = pid_device[cols["stream"][absent]]


@dataclass
class ColumnBuilder:
    """Events in, runs at a time; :meth:`columns` at the end.  With ``spill`` (a folder): once the runs hold
    ``spill_rows`` events they are written there, and from then on whenever they hold ``chunk_rows``;
    :meth:`finish` gives a :class:`Spilled` once any were."""

    spill: Path | Callable[[], Path] | None = None  # a folder, or what makes one when the first chunk is written
    spill_rows: int = 1 << 20
    chunk_rows: int = 1 << 18
    _chunks: int = 0
    _rows: int = 0
    _cats: _Dictionary = field(default_factory=_Dictionary)
    _names: _Dictionary = field(default_factory=_Dictionary)
    _pgs: _Dictionary = field(default_factory=_Dictionary)
    _streams: dict[tuple[Any, Any], int] = field(default_factory=dict)
    _flow_ids: dict[str, int] = field(default_factory=dict)
    _parts: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def _put(self, **cols: np.ndarray) -> None:
        for k, v in cols.items():
            self._parts.setdefault(k, []).append(v)
        self._rows += next(iter(cols.values())).size

    def _write_chunk(self) -> None:
        """The runs held so far written as the next chunks of about ``chunk_rows`` events (one file per column), and
        freed."""
        if callable(self.spill):
            self.spill = self.spill()
        assert self.spill is not None
        pieces = max(1, -(-self._rows // self.chunk_rows))
        for k, dtype in (*EVENT_COLUMNS.items(), *FLOW_COLUMNS.items()):
            for j, piece in enumerate(np.array_split(_joined(self._parts.pop(k, []), dtype), pieces)):
                np.save(self.spill / f"{self._chunks + j}.{k}.npy", piece)
        self._chunks += pieces
        self._rows = 0
        release_memory()

    def _stream(self, events: list, typed: bool) -> np.ndarray:
        n = len(events)
        try:  # the usual case: pid and tid are numbers (typed: checked by the decoder, never "7")
            if not typed:
                raise TypeError
            return self._stream_of(
                np.fromiter(map(_PID, events), np.int64, n), np.fromiter(map(_TID, events), np.int64, n)
            )
        except (ValueError, TypeError, OverflowError):
            sd = self._streams
            keys = zip(map(_PID, events), map(_TID, events))
            return np.array([sd.setdefault(k, len(sd)) for k in keys], dtype=np.int32)

    def _stream_of(self, p: np.ndarray, t: np.ndarray, strings: list[str] | None = None) -> np.ndarray:
        """The timelines of events whose pid and tid are the integers ``p`` and ``t``, numbered as first seen; with
        ``strings`` (the native scanner's), a pid or tid below ``_STRING_ID`` is the string ``_STRING_ID`` - it
        codes."""
        sd = self._streams
        if not p.size or (p.min() >= 0 and p.max() < 2**31 and t.min() >= -(2**31) and t.max() < 2**31):
            enc = pa.array((p << 32) | (t + 2**31)).dictionary_encode()  # (pid, tid) as one number
            local = [sd.setdefault((k >> 32, (k & (2**32 - 1)) - 2**31), len(sd)) for k in enc.dictionary.to_pylist()]
            return np.array(local, dtype=np.int32)[enc.indices.to_numpy(zero_copy_only=False)]
        pairs, first, inverse = np.unique(np.stack([p, t], axis=1), axis=0, return_index=True, return_inverse=True)

        def key(v: int) -> int | str:
            return strings[_STRING_ID - v] if strings is not None and v <= _STRING_ID else v

        codes = np.empty(len(pairs), dtype=np.int32)
        for k in np.argsort(first).tolist():
            a, b = pairs[k].tolist()
            codes[k] = sd.setdefault((key(a), key(b)), len(sd))
        return codes[inverse.reshape(-1)]

    def _pg(self, args: list, typed: bool, groups_named: bool) -> np.ndarray:
        if typed and (not groups_named or (not any(map(_PG_DESC, args)) and not any(map(_PG_NAME, args)))):
            return np.full(len(args), self._pgs.code.setdefault("", len(self._pgs.code)), dtype=np.int32)
        return self._pgs.encode([a.pg_desc or a.pg_name or "" for a in args])

    def add(
        self, events: list[ChromeEvent], groups_named: bool = True, numbered: bool | Callable[[], bool] = True
    ) -> None:
        """``groups_named`` False: the run's bytes hold no process group's key (nothing to look for in its args);
        ``numbered`` (or, called, it says) False: they hold no ``"Seq"``, asked only of a run decoded loosely (a typed
        run's numbers are read in C anyway; a loose run with none skips that column's pass; a key spelt with escapes
        is not seen there, and that run is then read as one without numbers)."""
        phs = list(map(_PH, events))
        n = phs.count("X")
        x = events if n == len(events) else [e for e, ph in zip(events, phs) if ph == "X"]
        if n:
            args = list(map(_ARGS, x))
            typed = type(x[0]) is _TypedEvent
            self._put(
                cat=self._cats.encode_strings(_CAT, x),
                name=self._names.encode_strings(_NAME, x),
                ts=np.fromiter(map(_TS, x), np.float64, n),
                dur=np.fromiter(map(_DUR, x), np.float64, n),
                stream=self._stream(x, typed),
                corr=_arg_ints(args, "correlation", typed, -1),
                device=_arg_ints(args, "device", typed, -2),
                nbytes=_arg_floats(args, typed),
                pg=self._pg(args, typed, groups_named),
                seq=_arg_ints(args, "seq", typed, -1)
                if typed or (numbered() if callable(numbered) else numbered)
                else np.full(n, -1, dtype=np.int64),
            )
        fl = [] if n == len(events) else [e for e, ph in zip(events, phs) if ph in _FLOW_PH]
        fl = [e for e in fl if e.cat in FLOW_CATS and e.id is not None]
        if fl:
            ids = ints([e.id for e in fl])
            odd = np.flatnonzero(ids < 0)  # string ids (and other odd ones): coded by their text
            if odd.size:
                fd = self._flow_ids
                ids[odd] = [(2**62) + fd.setdefault(str(fl[i].id), len(fd)) for i in odd.tolist()]
            self._put(
                flow_is_end=np.fromiter((e.ph == "f" for e in fl), bool, len(fl)),
                flow_id=ids,
                flow_ts=np.fromiter(map(_TS, fl), np.float64, len(fl)),
                flow_stream=self._stream(fl, type(fl[0]) is _TypedEvent),
            )
        if self.spill is not None and self._rows >= (self.chunk_rows if self._chunks else self.spill_rows):
            self._write_chunk()

    def add_scanned(self, scanned: tuple) -> None:
        """A run of events as the native scanner gave it (``_tracescan.scan``): the same columns :meth:`add` makes
        of that run decoded by msgspec as :class:`_TypedEvent`."""
        raw, escaped, x, fl, first = scanned
        strings = [msgspec.json.decode(b'"%s"' % r, type=str) if e else r.decode() for r, e in zip(raw, escaped)]
        n = len(x[0]) // 4
        if n:
            col = [np.frombuffer(b, dtype=d) for b, d in zip(x, _SCANNED_X)]
            cat, name, ts, dur, pid, tid, corr, device, nbytes, pg, seq = col
            self._put(
                cat=self._cats.recode(cat, strings, first[0]),
                name=self._names.recode(name, strings, first[1]),
                ts=ts,
                dur=dur,
                stream=self._stream_of(pid, tid, strings),
                corr=_typed_ints(corr, -1),
                device=_typed_ints(device, -2),
                nbytes=_typed_floats(nbytes),
                pg=self._pgs.recode(pg, strings, first[2]),
                seq=_typed_ints(seq, -1),
            )
        m = len(fl[0])
        if m:
            is_end, fid, fts, fpid, ftid = (np.frombuffer(b, dtype=d) for b, d in zip(fl, _SCANNED_FLOWS))
            ids = np.where((fid >= 0) & (fid < 2**62), fid, -1)
            odd = np.flatnonzero(ids < 0)  # ids out of range: coded by their text, as :meth:`add` codes them
            if odd.size:
                fd = self._flow_ids
                ids[odd] = [(2**62) + fd.setdefault(str(v), len(fd)) for v in fid[odd].tolist()]
            self._put(
                flow_is_end=is_end.astype(bool),
                flow_id=ids,
                flow_ts=fts,
                flow_stream=self._stream_of(fpid, ftid, strings),
            )
        if self.spill is not None and self._rows >= (self.chunk_rows if self._chunks else self.spill_rows):
            self._write_chunk()

    def _streams_by_text(self) -> tuple[list[str], np.ndarray | None, np.ndarray]:
        """Timelines by their text ("1/2" whether pid and tid were numbers or strings), each numbered once: the
        labels, each code's new code (None: no timelines), and each label's pid as a device number (-1: not one)."""
        keys = list(self._streams)
        labels = [f"{p}/{t}" for p, t in keys]
        stream_dict, relabel = np.unique(np.array(labels or [""], dtype=object).astype(str), return_inverse=True)
        pids = [lbl.split("/", 1)[0] for lbl in stream_dict.tolist()]  # a pid written "7" is pid 7 too
        by_label = np.array([int(p) if p.isascii() and p.isdigit() and len(p) < 18 else -1 for p in pids], np.int64)
        return stream_dict.tolist(), relabel.astype(np.int32) if keys else None, by_label

    def columns(self) -> Columns:
        cols: dict[str, np.ndarray] = {}
        for k, dtype in (*EVENT_COLUMNS.items(), *FLOW_COLUMNS.items()):  # one column at a time
            cols[k] = _joined(self._parts.pop(k, []), dtype)
        release_memory()
        stream_dict, relabel, pid_device = self._streams_by_text()
        _finish(cols, relabel, pid_device)  # a device event's device: args.device, else its pid (Kineto's timelines)
        return Columns(
            **cols,
            cat_dict=self._cats.strings(),
            name_dict=self._names.strings(),
            stream_dict=stream_dict,
            pg_dict=self._pgs.strings(),
        )

    def finish(self) -> Columns | Spilled:
        """:meth:`columns`, or where runs were spilled, the rest spilled too and the :class:`Spilled` chunks."""
        if not self._chunks:
            return self.columns()
        if self._rows:
            self._write_chunk()
        stream_dict, relabel, pid_device = self._streams_by_text()
        assert isinstance(self.spill, Path)
        return Spilled(
            self.spill,
            self._chunks,
            self._cats.strings(),
            self._names.strings(),
            stream_dict,
            self._pgs.strings(),
            relabel if relabel is not None else np.zeros(1, np.int32),
            pid_device,
        )


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """The parts of a column as one array, each part freed as soon as it is copied (the parts and the whole at most)."""
    col = np.empty(sum(p.size for p in parts), dtype=parts[0].dtype if parts else dtype)
    at = 0
    while parts:
        p = parts.pop(0)
        col[at : at + p.size] = p
        at += p.size
        del p
    return col


_FLOW_PH = frozenset(("s", "f"))
#: the dtypes of the native scanner's columns (producers/agent/_tracescan.c): complete events, flow events
_SCANNED_X = (
    np.int32,
    np.int32,
    np.float64,
    np.float64,
    np.int64,
    np.int64,
    np.int64,
    np.int64,
    np.float64,
    np.int32,
    np.int64,
)
_STRING_ID = -(2**62) - 1  # the native scanner's pid or tid written as a string: _STRING_ID - its code
_SCANNED_FLOWS = (np.uint8, np.int64, np.float64, np.int64, np.int64)
_PID, _TID, _TS, _DUR = attrgetter("pid"), attrgetter("tid"), attrgetter("ts"), attrgetter("dur")
_CAT, _NAME, _ARGS, _PH = attrgetter("cat"), attrgetter("name"), attrgetter("args"), attrgetter("ph")
_PG_DESC, _PG_NAME = attrgetter("pg_desc"), attrgetter("pg_name")


def _arg_ints(args: list, field: str, typed: bool, absent: int) -> np.ndarray:
    """An integer of the args (ids, device numbers) as :func:`ints` gives it."""
    if typed:
        try:
            return _typed_ints(np.fromiter(map(attrgetter(field), args), np.int64, len(args)), absent)
        except OverflowError:  # beyond int64: one by one
            return ints([None if a == _ABSENT else a for a in map(attrgetter(field), args)], absent)
    return ints(list(map(attrgetter(field), args)), absent)


def _typed_ints(v: np.ndarray, absent: int) -> np.ndarray:
    """Integers read as int64 with ``_ABSENT`` where there were none, as :func:`ints` gives them."""
    out = np.where((v >= 0) & (v < 2**62), v, -1)
    out[v == _ABSENT] = absent
    return out


def _arg_floats(args: list, typed: bool) -> np.ndarray:
    if typed:
        try:
            return _typed_floats(np.fromiter(map(attrgetter("bytes"), args), np.float64, len(args)))
        except OverflowError:
            return floats([a.bytes for a in args])
    return floats([a.bytes for a in args])


def _typed_floats(v: np.ndarray) -> np.ndarray:
    """Byte counts read as float64 (``_ABSENT`` where there were none), as :func:`floats` gives them."""
    with np.errstate(invalid="ignore"):
        return np.where((v >= 0) & (v < 1e18), v, np.nan)


def release_memory() -> None:
    """Give the C heap's free pages back to the system (glibc keeps the small blocks a run of events was decoded
    into; without this the columns' parts stay in the RSS after they were copied)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None


def ints(values: list, absent: int = -1) -> np.ndarray:
    """Non-negative integers (ids, device numbers); -1 where not an integer, ``absent`` where None."""
    try:  # the usual case, integers and nulls, converted in C
        a = pa.array(values)
        if not (pa.types.is_integer(a.type) or pa.types.is_null(a.type)):
            raise TypeError(a.type)
        v = a.cast(pa.int64()).fill_null(-(2**63)).to_numpy()
        none = v == -(2**63)
        v = np.where((v >= 0) & (v < 2**62), v, -1)
        v[none] = absent
        return v
    except (pa.ArrowException, TypeError, OverflowError):  # strings, floats, booleans, huge numbers: one by one
        return np.array(
            [
                absent
                if a is None
                else int(a)
                if isinstance(a, int) and not isinstance(a, bool) and 0 <= a < 2**62
                else -1
                for a in values
            ],
            dtype=np.int64,
        )


def floats(values: list) -> np.ndarray:
    """Non-negative numbers below 1e18 (byte counts); NaN elsewhere."""
    try:
        a = pa.array(values)
        if not (pa.types.is_integer(a.type) or pa.types.is_floating(a.type) or pa.types.is_null(a.type)):
            raise TypeError(a.type)
        v = a.cast(pa.float64()).fill_null(np.nan).to_numpy()
    except (pa.ArrowException, TypeError, OverflowError):
        v = np.array(
            [
                float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) and abs(b) < 1e300 else np.nan
                for b in values
            ],
            dtype=np.float64,
        )
    with np.errstate(invalid="ignore"):
        return np.where((v >= 0) & (v < 1e18), v, np.nan)


# --------------------------------------------------------------------------- bytes in


class _Source:
    """A file's bytes (gunzipped as read when it is gzip), never more than ``max_bytes`` of them."""

    def __init__(self, fh: BinaryIO, max_bytes: int, what: str) -> None:
        self.max_bytes, self.what, self.read_bytes = max_bytes, what, 0
        head = fh.read(2)
        fh.seek(0)
        self.gzip = head == b"\x1f\x8b"
        if self.gzip:
            size = os.fstat(fh.fileno()).st_size
            if size >= 4:  # gzip's trailer holds the size modulo 2^32: refuse an announced bomb before inflating it
                fh.seek(size - 4)
                announced = int.from_bytes(fh.read(4), "little")
                fh.seek(0)
                if announced > max_bytes:
                    raise TraceReadError(
                        f"gzip {what} unpacks to {announced:,} bytes, more than the limit of {max_bytes:,} (--max-input-mb)"
                    )
            self._fh: BinaryIO = gzip.GzipFile(fileobj=fh)  # type: ignore[assignment]  # a GzipFile reads as a binary file
        else:
            self._fh = fh

    def read(self, n: int) -> bytes:
        try:
            b = self._fh.read(min(n, self.max_bytes + 1 - self.read_bytes))
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceReadError(f"not a readable gzip file ({exc})") from None
        self.read_bytes += len(b)
        if self.read_bytes > self.max_bytes:
            raise TraceReadError(
                f"gzip {self.what} unpacks to more than the limit of {self.max_bytes:,} bytes (--max-input-mb)"
                if self.gzip
                else f"{self.what} is larger than the limit of {self.max_bytes:,} bytes (--max-input-mb)"
            )
        return b


class _Reader:
    """The top-level object walked key by key; ``traceEvents`` decoded run by run into a :class:`ColumnBuilder`."""

    def __init__(self, src: _Source, builder: ColumnBuilder) -> None:
        self.src, self.builder = src, builder
        self.buf = bytearray()
        self.pos = 0
        self.eof = False

    # -- buffer
    def _fill(self, need: int) -> bool:
        """At least ``need`` bytes from ``pos`` on, or all that is left; False when none is left."""
        if len(self.buf) - self.pos < need and not self.eof:
            parts: list[bytes | bytearray] = [self.buf[self.pos :]]
            have = len(parts[0])
            while have < need:
                b = self.src.read(max(need - have, WINDOW))
                if not b:
                    self.eof = True
                    break
                parts.append(b)
                have += len(b)
            # a bytearray with a spare byte before pos: a run of events is decoded in place, between brackets
            # written over the bytes around it (:meth:`_in_brackets`), not copied
            self.buf, self.pos = bytearray().join([b" ", *parts]), 1
        return self.pos < len(self.buf)

    def _skip_ws(self) -> None:
        while True:
            m = _WS.match(self.buf, self.pos)
            self.pos = m.end() if m else self.pos
            if self.pos < len(self.buf) or not self._fill(1):
                return

    def _peek(self) -> bytes:
        self._skip_ws()
        return bytes(self.buf[self.pos : self.pos + 1])

    def _expect(self, c: bytes) -> None:
        if self._peek() != c:
            got = bytes(self.buf[self.pos : self.pos + 20])
            raise TraceReadError(
                f"not a Chrome-trace JSON object with traceEvents (expected {c.decode()!r}, got {got!r:.40})"
            )
        self.pos += 1

    # -- values
    def _value_end(self, within: int) -> int:
        """End of the JSON value at ``pos`` (which is not whitespace) in the buffer's next ``within`` bytes, or -1."""
        c = self.buf[self.pos : self.pos + 1]
        if c == b'"':
            m = _KEY.match(self.buf, self.pos)
            return m.end() if m else -1
        if c in (b"{", b"["):
            end = _container_end(memoryview(self.buf)[self.pos : self.pos + within])
            return end + self.pos if end >= 0 else -1
        m = _SCALAR.match(self.buf, self.pos)
        return m.end() if m and (m.end() < len(self.buf) or self.eof) else -1

    def _value(self, limit: int, what: str) -> bytes:
        """The raw bytes of the value at ``pos`` (at most ``limit`` of them); ``pos`` moves past it."""
        self._skip_ws()
        need = 1 << 16
        while True:
            self._fill(need)
            end = self._value_end(need)
            if end >= 0 and end > self.pos:
                out = bytes(self.buf[self.pos : end])
                self.pos = end
                return out
            if self.eof and len(self.buf) - self.pos <= need:
                raise TraceReadError(f"not a Chrome-trace JSON object with traceEvents ({what} is cut short)")
            if need > limit:
                raise TraceReadError(f"{what} is larger than {limit >> 20} MiB")
            need *= 4

    # -- the trace
    def read(self) -> dict[str, bytes]:
        meta: dict[str, bytes] = {}
        seen_events = False
        self._fill(WINDOW)
        self._expect(b"{")
        if self._peek() == b"}":
            self.pos += 1
        else:
            while True:
                key_raw = self._value(1 << 20, "a key")
                try:
                    key = msgspec.json.decode(key_raw, type=str)
                except msgspec.DecodeError:
                    raise TraceReadError(
                        f"not a Chrome-trace JSON object with traceEvents (a key is not a string: {key_raw!r:.40})"
                    ) from None
                self._expect(b":")
                if key == "traceEvents":
                    self._events()
                    seen_events = True
                elif key in META_KEYS:
                    meta[key] = self._value(MAX_META_BYTES, f"the trace's {key}")
                else:
                    self._value(MAX_META_BYTES, f"the trace's {key[:40]}")
                if self._after_item(b"}"):
                    break
        if self._peek():
            raise TraceReadError("not a Chrome-trace JSON object with traceEvents (trailing data after the object)")
        if not seen_events:
            raise TraceReadError("not a Chrome-trace JSON object with traceEvents (no traceEvents)")
        return meta

    def _events(self) -> None:
        self._expect(b"[")
        if self._peek() == b"]":
            self.pos += 1
            return
        window = WINDOW
        while True:
            self._skip_ws()
            self._fill(window)
            end, events = self._cut(window)
            if end < 0:  # no whole event in the window
                if self.eof and window >= len(self.buf) - self.pos:
                    raise TraceReadError("not a Chrome-trace JSON object with traceEvents (the events are cut short)")
                if window >= MAX_EVENT_BYTES:
                    raise TraceReadError(f"an event of the trace is larger than {MAX_EVENT_BYTES >> 20} MiB")
                window *= 4
                continue
            window = WINDOW
            if isinstance(events, tuple):
                self.builder.add_scanned(events)
            else:
                self.builder.add(events, numbered=partial(_holds, self.buf, b'"Seq"', self.pos, end))
            del events
            self.pos = end
            if self._after_item(b"]"):
                return

    def _after_item(self, close: bytes) -> bool:
        """Past the separator after an item of an object or array: True where it was ``close`` (the end)."""
        c = self._peek()
        self.pos += 1
        if c == close:
            return True
        if c != b",":
            raise TraceReadError(
                f"not a Chrome-trace JSON object with traceEvents (expected ',' or '{close.decode()}', got {c!r})"
            )
        return False

    def _in_brackets(self, lo: int, hi: int) -> list:
        """The events from ``lo`` to ``hi`` decoded as the array ``[...]``: the byte before ``lo`` and the one at ``hi``
        (a separator or whitespace, already read or still to read) are the brackets while it is decoded."""
        buf = self.buf
        before, after = buf[lo - 1], buf[hi]
        buf[lo - 1], buf[hi] = 0x5B, 0x5D
        try:
            with memoryview(buf) as view:
                return _decode_run(view[lo - 1 : hi + 1])
        finally:
            buf[lo - 1], buf[hi] = before, after

    def _cut(self, window: int) -> tuple[int, list[ChromeEvent] | tuple]:
        """The end of the last whole event in the window from ``pos`` (just after its ``}``) and the events up to
        it, scanned (:func:`_scan`) or decoded; -1 when none ends in it."""
        buf, lo = self.buf, self.pos
        hi = min(len(buf), lo + window)
        j = hi
        for _ in range(8):  # the last '}' followed by ', {' or ']': almost always an event's end
            j = buf.rfind(b"}", lo, j)
            if j < 0:
                break
            after = _AFTER.match(buf, j + 1)
            if after and (after.end() <= len(buf)):
                scanned = _scan(buf, lo, j + 1)
                if scanned is not None:
                    return j + 1, scanned
                try:
                    return j + 1, self._in_brackets(lo, j + 1)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    break  # inside a string or an object, or not JSON: the exact scan tells which
                except RecursionError:
                    raise TraceReadError(
                        "not a Chrome-trace JSON object with traceEvents (nested too deeply)"
                    ) from None
        end = _last_event_end(memoryview(buf)[lo:hi]) if hi > lo else -1
        if end < 0:
            return -1, []
        return end + lo, _scan(buf, lo, end + lo) or _decode_events(buf, lo, end + lo)


def _scan(buf: bytearray, lo: int, hi: int) -> tuple | None:
    """The events from ``lo`` to ``hi`` as the native scanner's columns; None where it gave up on them (anything but
    what torch.profiler writes: msgspec decodes those) or is not built."""
    return native_scan(buf, lo, hi) if native_scan is not None else None


def _holds(buf: bytearray, what: bytes, lo: int, hi: int) -> bool:
    return buf.find(what, lo, hi) >= 0


def _decode_events(buf: bytes | bytearray, lo: int, hi: int) -> list[ChromeEvent]:
    try:
        return _decode_run(b"".join((b"[", memoryview(buf)[lo:hi], b"]")))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceReadError(f"not a Chrome-trace JSON object with traceEvents ({exc})") from None
    except RecursionError:
        raise TraceReadError("not a Chrome-trace JSON object with traceEvents (nested too deeply)") from None


def _structure(view: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions of the brackets outside strings of a slice that begins outside a string, with their kind
    (+1 opening, -1 closing) and the byte."""
    a = np.frombuffer(view, dtype=np.uint8)
    q = np.flatnonzero(a == 34)
    esc = q[(q > 0) & (a[np.maximum(q - 1, 0)] == 92)]
    if esc.size:  # a quote after backslashes is escaped when they are an odd number
        real = np.ones(q.size, dtype=bool)
        for i in esc.tolist():
            k = i - 1
            while k >= 0 and a[k] == 92:
                k -= 1
            if (i - 1 - k) % 2:
                real[np.searchsorted(q, i)] = False
        q = q[real]
    br = np.flatnonzero((a == 123) | (a == 125) | (a == 91) | (a == 93))
    br = br[np.searchsorted(q, br) % 2 == 0]  # an even number of quotes before: outside strings
    byte = a[br]
    return br, np.where((byte == 123) | (byte == 91), 1, -1), byte


def _container_end(view: memoryview) -> int:
    """End of the object or array the slice begins with; -1 when it does not end in the slice."""
    br, delta, _ = _structure(view)
    depth = np.cumsum(delta)
    closed = np.flatnonzero(depth == 0)
    return int(br[closed[0]]) + 1 if closed.size else -1


def _last_event_end(view: memoryview) -> int:
    """End of the last whole value at depth 0 of a slice of an array's elements (each an object)."""
    br, delta, byte = _structure(view)
    depth = np.cumsum(delta)
    out = np.flatnonzero(depth < 0)  # the array's own ']': nothing after it is an element
    if out.size:
        depth, byte, br = depth[: out[0]], byte[: out[0]], br[: out[0]]
    ends = np.flatnonzero((depth == 0) & (byte == 125))
    return int(br[ends[-1]]) + 1 if ends.size else -1


# --------------------------------------------------------------------------- the entry points


def read_file(
    fh: BinaryIO,
    max_bytes: int,
    what: str = "trace",
    *,
    spill: Path | Callable[[], Path] | None = None,
    spill_rows: int = 1 << 20,
    chunk_rows: int = 1 << 18,
) -> tuple[Head, Columns | Spilled]:
    """A trace file's metadata and event columns, read in slices; at most ``max_bytes`` (decompressed) read.  With
    ``spill`` (a folder, or a function that makes one): once more than ``spill_rows`` events were read, the columns go there in chunks of about
    ``chunk_rows`` (:class:`Spilled`)."""
    global _unbuilt_told
    if not _unbuilt_told:  # once a process
        _unbuilt_told = True
        log.warning(
            "the trace reader's native scanner is not built (no C compiler or no Python headers when lockstep was "
            "installed): traces are read about half as fast; install gcc and python3-dev, then `pip install` again"
        )
    builder = ColumnBuilder(spill, spill_rows, chunk_rows)
    meta = _Reader(_Source(fh, max_bytes, what), builder).read()
    try:
        head = msgspec.convert({k: msgspec.json.decode(v) for k, v in meta.items()}, Head)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceReadError(f"not a Chrome-trace JSON object with traceEvents ({exc})") from None
    except RecursionError:
        raise TraceReadError("not a Chrome-trace JSON object with traceEvents (nested too deeply)") from None
    return head, builder.finish()


def read_object(obj: dict) -> tuple[Head, Columns]:
    """The same from a parsed JSON object."""
    try:
        whole = msgspec.convert(obj, _Whole)
    except msgspec.ValidationError as exc:
        raise TraceReadError(f"not a Chrome-trace JSON object with traceEvents ({exc})") from None
    if "traceEvents" not in obj:
        raise TraceReadError("not a Chrome-trace JSON object with traceEvents (no traceEvents)")
    builder = ColumnBuilder()
    builder.add(whole.traceEvents)
    return Head(
        distributedInfo=whole.distributedInfo,
        deviceProperties=whole.deviceProperties,
        host_name=whole.host_name,
        hostName=whole.hostName,
        trace_id=whole.trace_id,
    ), builder.columns()
