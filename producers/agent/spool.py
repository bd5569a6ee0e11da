"""A bounded on-disk spool for records Kafka could not take.

Segment files in one directory, written by one thread (the agent's publishing
thread).  A record is ``<u16 topic length><i32 key length, -1 = none><u32 value
length>`` followed by the three byte strings.  A segment is closed when it
reaches ``max_bytes / 8``; when the spool would exceed ``max_bytes`` the oldest
segments are deleted and their records counted as dropped.  A torn record at the
end of a segment (the process died while writing) ends that segment.  The spool
survives restarts: records left by a previous run are sent by the next one.
"""

from __future__ import annotations

import builtins
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("lockstep.agent")

MAGIC = b"LSSPOOL1"
_HEAD = struct.Struct("<HiI")
SpoolRecord = tuple[str, bytes | None, bytes]


class Spool:
    def __init__(self, directory: Path, max_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # an eighth of the bound: dropping the oldest segment keeps at least 7/8 of what fits (a 64 KiB floor
        # made a bound under 512 KiB drop nearly everything it held at once)
        self.segment_bytes = max(1, max_bytes // 8)
        self.dropped = 0  # records deleted to stay within max_bytes
        self._counts: dict[Path, int] = {}  # closed segment -> records
        self._sizes: dict[Path, int] = {}
        for seg in sorted(self.dir.glob("*.spool")):
            n = sum(1 for _ in self.read(seg))
            self._counts[seg], self._sizes[seg] = n, seg.stat().st_size
        self._seq = 1 + max((int(p.stem) for p in self._counts), default=0)
        self._current: Path | None = None
        self._fh: BinaryIO | None = None
        self._current_n = 0
        self._current_size = 0

    # ------------------------------------------------------------------ state

    @property
    def records(self) -> int:
        return sum(self._counts.values()) + self._current_n

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values()) + self._current_size

    def __len__(self) -> int:
        return self.records

    # ------------------------------------------------------------------ writing

    def append(self, topic: str, key: builtins.bytes | None, value: builtins.bytes) -> int:
        """Store one record; returns how many records were dropped to make room (this one included if too big)."""
        t = topic.encode()
        size = _HEAD.size + len(t) + (len(key) if key is not None else 0) + len(value)
        if size + len(MAGIC) > self.max_bytes:
            self.dropped += 1
            log.warning(
                "spool: a %d-byte record for %s is larger than the whole spool (%d bytes); dropped",
                size,
                topic,
                self.max_bytes,
            )
            return 1
        dropped = self._make_room(size)
        if self._fh is None or self._current_size + size > self.segment_bytes:
            self._rotate()
            self._current = self.dir / f"{self._seq:012d}.spool"
            self._seq += 1
            self._fh = open(self._current, "wb")  # noqa: SIM115 - closed in _rotate
            self._fh.write(MAGIC)
            self._current_size = len(MAGIC)
        self._fh.write(_HEAD.pack(len(t), -1 if key is None else len(key), len(value)))
        self._fh.write(t)
        if key is not None:
            self._fh.write(key)
        self._fh.write(value)
        self._current_n += 1
        self._current_size += size
        return dropped

    def _make_room(self, size: int) -> int:
        dropped = 0
        while self.bytes + size > self.max_bytes:
            if not self._counts:
                self._rotate()  # the current segment is the oldest: close it so that it can go
                if not self._counts:
                    break
            oldest = min(self._counts)
            n = self._counts.pop(oldest)
            self._sizes.pop(oldest)
            oldest.unlink(missing_ok=True)
            dropped += n
        if dropped:
            self.dropped += dropped
            log.warning(
                "spool full (%d bytes): dropped the %d oldest record(s), %d so far",
                self.max_bytes,
                dropped,
                self.dropped,
            )
        return dropped

    def _rotate(self) -> None:
        """Close the segment being written, making it readable."""
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        assert self._current is not None
        if self._current_n:
            self._counts[self._current], self._sizes[self._current] = self._current_n, self._current_size
        else:
            self._current.unlink(missing_ok=True)
        self._current, self._current_n, self._current_size = None, 0, 0

    def flush(self) -> None:
        """Make everything written so far durable (closes the current segment)."""
        self._rotate()

    # ------------------------------------------------------------------ reading

    def segments(self) -> list[Path]:
        """Closed segments, oldest first (the one being written is closed first)."""
        self._rotate()
        return sorted(self._counts)

    def read(self, segment: Path) -> Iterator[SpoolRecord]:
        try:
            data = segment.read_bytes()
        except FileNotFoundError:
            return
        if not data.startswith(MAGIC):
            log.warning("spool: %s is not a spool segment; ignored", segment)
            return
        pos = len(MAGIC)
        while pos + _HEAD.size <= len(data):
            tlen, klen, vlen = _HEAD.unpack_from(data, pos)
            pos += _HEAD.size
            end = pos + tlen + max(klen, 0) + vlen
            if end > len(data):
                log.warning("spool: %s ends in a torn record; the rest of it is lost", segment)
                return
            topic = data[pos : pos + tlen].decode()
            pos += tlen
            key = None if klen < 0 else data[pos : pos + klen]
            pos += max(klen, 0)
            yield topic, key, data[pos : pos + vlen]
            pos += vlen

    def remove(self, segment: Path) -> None:
        """Forget a segment whose records were all delivered (or spooled again)."""
        self._counts.pop(segment, None)
        self._sizes.pop(segment, None)
        segment.unlink(missing_ok=True)

    def close(self) -> None:
        self._rotate()
