"""The on-disk spool: bounded, oldest dropped and counted, survives restarts and torn writes."""

from lockstep.producers.agent.spool import Spool


def test_records_come_back_in_order_with_keys_and_topics(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 20)
    sp.append("a", b"k1", b"v1")
    sp.append("b", None, b"")
    sp.append("a", b"", b"v3" * 100)
    assert len(sp) == 3
    (seg,) = sp.segments()
    assert list(sp.read(seg)) == [("a", b"k1", b"v1"), ("b", None, b""), ("a", b"", b"v3" * 100)]
    sp.remove(seg)
    assert len(sp) == 0 and sp.segments() == []


def test_the_bound_drops_the_oldest_records_and_counts_them(tmp_path):
    sp = Spool(tmp_path, max_bytes=512 << 10)  # segments of 64 KiB
    value = b"x" * 1000
    for i in range(2000):  # ~2 MB into a 512 KiB spool
        sp.append("t", str(i).encode(), value)
    assert sp.bytes <= 512 << 10
    assert sp.dropped > 0 and sp.dropped + len(sp) == 2000
    kept = [int(k) for seg in sp.segments() for _, k, _ in sp.read(seg)]
    assert kept == list(range(2000 - len(kept), 2000))  # the newest survive, in order
    assert sp.append("t", b"k", b"y" * (1 << 20)) == 1  # larger than the whole spool: dropped
    assert sp.dropped + len(sp) == 2001


def test_a_small_bound_keeps_most_of_what_fits(tmp_path):
    """Segments are an eighth of the bound, so dropping the oldest keeps at least 7/8 of it (a 64 KiB floor on
    segments made a bound under 512 KiB drop nearly everything it held at once)."""
    sp = Spool(tmp_path, max_bytes=48 << 10)
    for _ in range(2000):
        sp.append("t", b"k", b"x" * 180)
        if sp.dropped:
            assert sp.bytes >= (48 << 10) * 7 // 8 - 300
    assert sp.dropped > 0 and sp.bytes <= 48 << 10


def test_a_new_spool_on_the_same_directory_finds_what_the_last_one_left(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(10):
        sp.append("t", None, str(i).encode())
    sp.close()
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert len(again) == 10
    again.append("t", None, b"10")
    values = [v for seg in again.segments() for _, _, v in again.read(seg)]
    assert values == [str(i).encode() for i in range(11)]


def test_a_torn_record_ends_its_segment(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        sp.append("t", None, b"v%d" % i)
    (seg,) = sp.segments()
    seg.write_bytes(seg.read_bytes()[:-2])  # the process died in the middle of the last record
    assert [v for _, _, v in Spool(tmp_path, 1 << 20).read(seg)] == [b"v0", b"v1"]
