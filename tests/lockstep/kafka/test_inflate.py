"""Bounded decompression for aiokafka: the codecs read what aiokafka writes, refuse what inflates past the bound or is
corrupt (only CompressionError), and aiokafka's fetcher, once bounded, skips such a batch and reads the ones after it.

The integration test (a real broker, the processor process, librdkafka's batches of each codec, its peak memory) is
``tests/adversarial/test_kafka_compression.py``."""

from __future__ import annotations

import struct

import pytest
from aiokafka import codec as aiocodec
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from lockstep.kafka import inflate
from lockstep.kafka.clients import MAX_BATCH_BYTES
from lockstep.schemas.compression import CompressionError

CODECS = {  # Kafka's codec number -> (aiokafka's encoder, the bounded decoder)
    1: (aiocodec.gzip_encode, inflate.gzip_decode),
    2: (aiocodec.snappy_encode, inflate.snappy_decode),
    3: (aiocodec.lz4_encode, inflate.lz4_decode),
    4: (aiocodec.zstd_encode, inflate.zstd_decode),
}
BOUND = 1 << 20


@pytest.fixture(autouse=True)
def logging_skips():
    """aiokafka is bounded for the whole process: leave it as the processor would (skips logged), not with a test's
    callback."""
    yield
    inflate.bound_aiokafka(MAX_BATCH_BYTES)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("size", [0, 1, 1000, BOUND])
def test_the_bounded_codecs_read_what_aiokafka_writes(codec, size):
    encode, decode = CODECS[codec]
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert decode(encode(data), BOUND) == data


def test_snappy_reads_raw_blocks_and_xerial_framing():
    data = b"abc" * 50_000
    assert inflate.snappy_decode(aiocodec.snappy_encode(data, xerial_compatible=False), BOUND) == data
    assert inflate.snappy_decode(aiocodec.snappy_encode(data, xerial_blocksize=4096), BOUND) == data


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_payload_inflating_past_the_bound_is_refused(codec):
    encode, decode = CODECS[codec]
    with pytest.raises(CompressionError, match="the 1048576-byte bound"):
        decode(encode(b"\0" * (BOUND + 1)), BOUND)


@pytest.mark.parametrize("codec", sorted(CODECS))
@given(junk=st.binary(max_size=300), cut=st.integers(0, 400))
def test_corrupt_or_truncated_payloads_raise_compression_error_only(codec, junk, cut):
    encode, decode = CODECS[codec]
    for payload in (junk, encode(b"some records " * 30)[:cut] + junk):
        try:
            decode(payload, BOUND)
        except CompressionError:
            pass


def test_a_snappy_xerial_block_longer_than_its_payload_is_refused():
    framed = aiocodec.snappy_encode(b"abc" * 1000)
    header, (n,) = framed[:16], struct.unpack_from("!i", framed, 16)
    with pytest.raises(CompressionError, match="unreadable snappy"):
        inflate.snappy_decode(header + struct.pack("!i", n + 100) + framed[20:], BOUND)


def batch(codec: int, base_offset: int, values: list[bytes]) -> bytes:
    """A record batch as a broker returns it (the base offset is outside the batch's CRC)."""
    b = DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, 1 << 31)
    for i, v in enumerate(values):
        b.append(i, timestamp=None, key=b"k", value=v, headers=[])
    raw = bytearray(b.build())
    raw[:8] = struct.pack(">q", base_offset)
    return bytes(raw)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_the_fetcher_skips_a_batch_inflating_past_the_bound_and_reads_the_batches_after_it(codec):
    skipped = []
    inflate.bound_aiokafka(BOUND, on_skip=lambda *a: skipped.append(a))  # the processor's: MAX_BATCH_BYTES
    from aiokafka.consumer import fetcher  # the class the bound put there, as the fetcher finds it

    bomb = b"\0" * (2 * BOUND)
    fetched = (
        batch(codec, 0, [b"a", b"b"])
        + batch(codec, 2, [bomb, b"hidden"])  # a few KiB on the wire
        + batch(codec, 4, [b"c"])
        + batch(0, 5, [b"d"])  # uncompressed
    )
    records = fetcher.PartitionRecords(TopicPartition("t", 3), MemoryRecords(fetched), None, 0, None, None, True, 0)
    assert [(r.offset, r.value) for r in records] == [(0, b"a"), (1, b"b"), (4, b"c"), (5, b"d")]
    assert records.next_fetch_offset == 6
    ((topic, partition, first, last, reason),) = skipped
    assert (topic, partition, first, last) == ("t", 3, 2, 3) and "the 1048576-byte bound" in reason


def test_bounding_twice_keeps_one_layer_and_the_last_callback():
    first, second = [], []
    inflate.bound_aiokafka(BOUND, on_skip=lambda *a: first.append(a))
    inflate.bound_aiokafka(BOUND, on_skip=lambda *a: second.append(a))
    from aiokafka.consumer import fetcher

    ours, theirs, _ = fetcher.PartitionRecords.__mro__  # one layer over aiokafka's class, not two
    assert ours.__module__ == inflate.__name__ and theirs.__module__ == "aiokafka.consumer.fetcher"
    fetched = batch(4, 0, [b"\0" * (BOUND + 1)]) + batch(4, 1, [b"e"])
    records = fetcher.PartitionRecords(TopicPartition("t", 0), MemoryRecords(fetched), None, 0, None, None, True, 0)
    assert [r.value for r in records] == [b"e"]
    assert not first and len(second) == 1
