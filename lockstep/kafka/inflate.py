"""Bounded decompression for aiokafka, the Kafka client of the stream processor (through faust).

aiokafka inflates a compressed record batch whole, in one call (``cramjam.*.decompress``, ``GzipFile.read()``),
before any record reaches ``decode``'s 32 MiB check: a 300 MB record of zeros is ~10 KB of zstd on the wire and
+600 MB in the processor, and no consumer setting bounds it (``max_partition_fetch_bytes`` and ``fetch_max_bytes``
bound the compressed bytes).  :func:`bound_aiokafka` replaces the codec functions aiokafka's record readers call (the
compiled ``_crecords`` modules and the pure-Python ones look them up in their module globals at each call) with
bounded ones, and makes the fetcher skip a batch that inflates past the bound, or cannot be inflated, instead of
raising out of the consumer:

* zstd: refused from its frame header when it declares more (what librdkafka writes), else read as a stream;
* lz4 (frames) and gzip: read as a stream, 1 MiB at a time, refused as soon as the output passes the bound;
* snappy (raw, or xerial blocks): each block's declared length checked before it is inflated.

A skipped batch costs at most the bound (plus a copy of what was read so far): its records never reach the
processor (their keys are inside the compressed bytes, so they cannot be dead-lettered one by one); ``on_skip`` is
told the topic, partition and offsets, and the fetcher goes on with the next batch.  Without the skip, aiokafka lets
the codec's error out of ``getmany`` (faust's consumer thread), and fetches the same batch again.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator
from typing import Any

import cramjam

from ..schemas.compression import CompressionError, stream_decompress, zstd_decompress

log = logging.getLogger("lockstep.kafka")

#: called with (topic, partition, first offset, last offset, the reason) for every batch skipped
OnSkip = Callable[[str, int, int, int, str], None]

_XERIAL_HEADER = b"\x82SNAPPY\x00"
_I32 = struct.Struct("!i")


def zstd_decode(data: Any, max_bytes: int) -> bytes:
    return zstd_decompress(bytes(data), max_bytes)


def lz4_decode(data: Any, max_bytes: int) -> bytes:
    return stream_decompress(bytes(data), "lz4", max_bytes)


def gzip_decode(data: Any, max_bytes: int) -> bytes:
    return stream_decompress(bytes(data), "gzip", max_bytes)


def snappy_decode(data: Any, max_bytes: int) -> bytes:
    """Raw snappy, or Kafka's xerial framing of snappy blocks (``aiokafka.codec.snappy_decode``'s formats)."""
    raw = memoryview(bytes(data))
    if len(raw) >= 16 and raw[:8] == _XERIAL_HEADER:  # (aiokafka needs more than the header: no empty stream)
        blocks, pos = [], 16
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise CompressionError("unreadable snappy payload (truncated block length)")
            (n,) = _I32.unpack_from(raw, pos)
            if n < 0 or pos + 4 + n > len(raw):
                raise CompressionError(f"unreadable snappy payload (a block of {n} bytes at {pos})")
            blocks.append(raw[pos + 4 : pos + 4 + n])
            pos += 4 + n
    else:
        blocks = [raw]
    out, total = [], 0
    for block in blocks:
        try:
            total += cramjam.snappy.decompress_raw_len(block)  # the length the block declares, read from its header
        except cramjam.DecompressionError as exc:
            raise CompressionError(f"unreadable snappy payload ({exc})") from None
        if total > max_bytes:
            raise CompressionError(f"snappy payload expands beyond the {max_bytes}-byte bound")
        try:
            out.append(bytes(cramjam.snappy.decompress_raw(block)))  # exactly the declared length, or an error
        except cramjam.DecompressionError as exc:
            raise CompressionError(f"unreadable snappy payload ({exc})") from None
    return b"".join(out)


_CODECS: dict[str, Callable[[Any, int], bytes]] = {
    "zstd_decode": zstd_decode,
    "lz4_decode": lz4_decode,
    "gzip_decode": gzip_decode,
    "snappy_decode": snappy_decode,
}
_MODULES = (
    "aiokafka.codec",
    "aiokafka.record.default_records",
    "aiokafka.record.legacy_records",
    "aiokafka.record._crecords.default_records",
    "aiokafka.record._crecords.legacy_records",
)


class _Batch:
    """One of aiokafka's record batches; iterating it inflates it, and a batch that cannot be inflated within the
    bound yields no records (``on_skip`` is told) instead of raising."""

    __slots__ = ("_batch", "_skip")

    def __init__(self, batch: Any, skip: Callable[[Any, CompressionError], None]):
        self._batch = batch
        self._skip = skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __iter__(self) -> Iterator[Any]:
        try:
            records = iter(self._batch)  # the compiled batch inflates here; the Python one at its first record
            first = next(records)
        except StopIteration:
            return
        except CompressionError as exc:
            self._skip(self._batch, exc)
            return
        yield first
        while True:  # next(), not a for loop: iter() of a compiled batch a second time fails its own assertion
            try:
                record = next(records)
            except StopIteration:
                return
            yield record

    def __next__(self) -> Any:  # a control batch's marker (never compressed)
        return next(self._batch)


class _Batches:
    """aiokafka's ``MemoryRecords`` of one partition's fetch, its batches read through :class:`_Batch`."""

    __slots__ = ("_records", "_skip")

    def __init__(self, records: Any, skip: Callable[[Any, CompressionError], None]):
        self._records = records
        self._skip = skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._records, name)

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        batch = self._records.next_batch()
        return None if batch is None else _Batch(batch, self._skip)


def _log_skip(topic: str, partition: int, first: int, last: int, reason: str) -> None:
    log.warning(
        "skipped a record batch of %s[%d], offsets %d..%d: %s; its records are not read",
        topic,
        partition,
        first,
        last,
        reason,
    )


def bound_aiokafka(max_bytes: int, on_skip: OnSkip = _log_skip) -> None:
    """Make aiokafka (in this process) inflate a compressed batch to at most ``max_bytes``, and skip one that would
    inflate beyond it or cannot be inflated (``on_skip``; the default logs a warning).  Idempotent: the last call's
    bound and callback apply."""
    import importlib

    from aiokafka.consumer import fetcher

    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # the compiled readers are optional (AIOKAFKA_NO_EXTENSIONS, a platform without wheels)
            continue
        for fn, bounded in _CODECS.items():
            if hasattr(module, fn):
                setattr(module, fn, _bounded(bounded, max_bytes))

    original = getattr(fetcher.PartitionRecords, "__lockstep_original__", fetcher.PartitionRecords)

    class PartitionRecords(original):  # type: ignore[misc, valid-type]  # aiokafka's class, found at run time
        __lockstep_original__ = original

        def __init__(self, tp: Any, records: Any, *args: Any, **kwargs: Any) -> None:
            def skip(batch: Any, exc: CompressionError) -> None:
                on_skip(tp.topic, tp.partition, batch.base_offset, batch.next_offset - 1, str(exc))

            super().__init__(tp, _Batches(records, skip), *args, **kwargs)

    fetcher.PartitionRecords = PartitionRecords  # read by the fetcher at each fetch (a module global)


def _bounded(fn: Callable[[Any, int], bytes], max_bytes: int) -> Callable[[Any], bytes]:
    def decode(data: Any) -> bytes:
        return fn(data, max_bytes)

    decode.__name__ = fn.__name__
    return decode
