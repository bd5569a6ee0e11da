"""Bounded decompression: a payload may not expand beyond what its reader allows.

A few KiB of zstd can declare, or simply produce, gigabytes.  :func:`zstd_decompress`
reads the frame header first: a frame that declares more than the bound is refused
before anything is allocated; a frame that declares its size (what every Lockstep
producer writes) is decompressed into a buffer of exactly that size, so a payload that
lies about it, or carries more frames after it, cannot write past it; anything else is
decompressed as a stream, in chunks, and refused as soon as the output passes the bound.

Arrow IPC can compress its buffers itself, each declaring the length Arrow allocates before
reading it; :func:`read_ipc_stream` refuses such streams (Lockstep compresses whole streams), and validates every
table it reads in full (indices, offsets, lengths, null counts, UTF-8) before anything uses it.
"""

from __future__ import annotations

import struct

import cramjam
import pyarrow as pa

from .errors import LockstepError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20


class CompressionError(LockstepError, ValueError):
    """A compressed payload that is unreadable, or expands beyond its bound; the message says which."""


def zstd_frame_size(data: bytes) -> int | None:
    """The content size the first zstd frame declares, or None when it declares none.

    Raises CompressionError when ``data`` does not start with a zstd frame header."""
    if len(data) < 6 or data[:4] != ZSTD_MAGIC:
        raise CompressionError("not a zstd frame (bad magic number)")
    fhd = data[4]
    single_segment = (fhd >> 5) & 1
    size_bytes = (1 if single_segment else 0, 2, 4, 8)[fhd >> 6]
    if size_bytes == 0:
        return None
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[fhd & 3]
    if len(data) < pos + size_bytes:
        raise CompressionError("truncated zstd frame header")
    size = int.from_bytes(data[pos : pos + size_bytes], "little")
    return size + 256 if size_bytes == 2 else size


def zstd_decompress(data: bytes, max_bytes: int) -> bytes:
    """Decompress ``data`` (one or more zstd frames) to at most ``max_bytes``; CompressionError otherwise."""
    declared = zstd_frame_size(data)
    if declared is not None and declared > max_bytes:
        raise CompressionError(f"zstd frame declares {declared} bytes, over the {max_bytes}-byte bound")
    if declared is not None:
        out = bytearray(declared)
        try:
            n = cramjam.zstd.decompress_into(data, out)
        except cramjam.DecompressionError:
            pass  # more than one frame, or a frame that lied about its size: read it as a stream
        else:
            return bytes(memoryview(out)[:n])
    return stream_decompress(data, "zstd", max_bytes)


def stream_decompress(data: bytes, codec: str, max_bytes: int) -> bytes:
    """Decompress ``data`` (Arrow's stream ``codec``: ``zstd``, ``lz4`` frames, ``gzip``) to at most ``max_bytes``,
    reading 1 MiB at a time; CompressionError as soon as the output passes the bound, or for a corrupt stream."""
    parts, total = [], 0
    try:
        stream = pa.CompressedInputStream(pa.py_buffer(data), codec)
        # read_buffer, not read: read() of a stream that turns out corrupt leaves its buffer allocated (pyarrow 26)
        while (chunk := stream.read_buffer(min(_CHUNK, max_bytes + 1 - total))).size:
            total += chunk.size
            if total > max_bytes:
                raise CompressionError(f"{codec} payload expands beyond the {max_bytes}-byte bound")
            parts.append(chunk)
    except OSError as exc:  # what Arrow raises for a corrupt or truncated stream
        raise CompressionError(f"unreadable {codec} payload ({exc})") from None
    return b"".join(parts)


# --------------------------------------------------------------------------- Arrow IPC

_RECORD_BATCH, _DICTIONARY_BATCH = 3, 4  # MessageHeader union tags (Arrow's Message.fbs)


_I32, _U16, _I64 = struct.Struct("<i"), struct.Struct("<H"), struct.Struct("<q")


def _field(b: memoryview, table: int, index: int) -> int | None:
    """Position of field ``index`` of the flatbuffer table at ``table``; None when absent."""
    vtable = table - _I32.unpack_from(b, table)[0]
    slot = vtable + 4 + 2 * index
    if slot + 2 > vtable + _U16.unpack_from(b, vtable)[0]:
        return None
    off = _U16.unpack_from(b, slot)[0]
    return table + off if off else None


def _message_compressed(b: memoryview) -> tuple[bool, int]:
    """(whether a flatbuffer ``Message`` holds compressed buffers, its body length)."""
    root = _I32.unpack_from(b, 0)[0]
    kind, header, body = _field(b, root, 1), _field(b, root, 2), _field(b, root, 3)
    body_len = _I64.unpack_from(b, body)[0] if body is not None else 0
    if kind is None or header is None or b[kind] not in (_RECORD_BATCH, _DICTIONARY_BATCH):
        return False, body_len
    batch = header + _I32.unpack_from(b, header)[0]
    if b[kind] == _DICTIONARY_BATCH:
        data = _field(b, batch, 1)
        if data is None:
            return False, body_len
        batch = data + _I32.unpack_from(b, data)[0]
    return _field(b, batch, 3) is not None, body_len  # RecordBatch.compression


def ipc_body_compressed(raw: bytes | memoryview) -> bool:
    """Whether any message of an Arrow IPC stream holds compressed buffers (read from the stream's own framing).

    Such buffers declare their own uncompressed length, which Arrow allocates before it reads them: 33 KiB of
    IPC can allocate 1 GiB.  Lockstep payloads compress the whole stream instead.  A stream too broken to
    walk is left to Arrow's reader, which refuses it."""
    b, pos = memoryview(raw), 0
    try:
        while pos + 4 <= len(b):
            length = _I32.unpack_from(b, pos)[0]
            pos += 4
            if length == -1:  # the continuation marker, then the length
                length = _I32.unpack_from(b, pos)[0]
                pos += 4
            if length <= 0 or pos + length > len(b):
                return False  # end of stream, or truncated: Arrow says which
            compressed, body_len = _message_compressed(b[pos : pos + length])
            if compressed:
                return True
            pos += length + max(body_len, 0)
    except (IndexError, struct.error):
        return False
    return False


def read_ipc_stream(raw: bytes | memoryview) -> pa.Table:
    """An Arrow IPC stream as a table, fully validated; CompressionError when a message compresses its buffers.

    Arrow's reader checks the framing, not the values: a dictionary index outside its dictionary, an offset past its
    data, a null count that lies or a string that is not UTF-8 reach the caller as they are, and the first kernel
    that trusts them reads (or copies into a message) memory outside the table, or crashes the process.  The full
    validation checks every index, offset, length and null count (linear in the table's size) and raises
    ``pa.ArrowInvalid``, which readers turn into a refusal of the one record that carried the table."""
    if ipc_body_compressed(raw):
        raise CompressionError("Arrow IPC buffers compressed inside the stream (compress the whole stream instead)")
    table = pa.ipc.open_stream(raw).read_all()
    table.validate(full=True)
    try:
        names = table.schema.names  # decoded here, so that a name that is not UTF-8 is refused with the table
    except UnicodeDecodeError as exc:
        raise pa.ArrowInvalid(f"a column name is not UTF-8 ({exc})") from None
    if len(set(names)) != len(names):  # which one a reader gets is undefined, and concatenation refuses them
        raise pa.ArrowInvalid(f"duplicate column names ({sorted({n for n in names if names.count(n) > 1})})")
    return table
