"""The adversarial corpus: inputs an attacker (or a broken producer) controls, each with what must happen.

Where memory is the threat, the case runs in a process of its own and its peak resident memory (the
kernel's high-water mark, ``VmHWM``) is compared with a bound: a bound, not a timing, so it cannot flake.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import cramjam
import numpy as np
import pyarrow as pa
import pytest

GiB = 1 << 30
MiB = 1 << 20


def zstd_bomb(size: int = GiB) -> bytes:
    """zstd frames that expand to ``size`` zero bytes and declare no size: 33 KiB for 1 GiB."""
    c = cramjam.zstd.Compressor(level=1)
    c.compress(b"\0" * (16 * MiB))
    frame = bytes(c.finish())
    return frame * (size // (16 * MiB))


def zstd_declaring(size: int) -> bytes:
    """A zstd frame header that declares ``size`` bytes (8-byte field), followed by one empty raw block."""
    fhd = 0b11100000  # content size: 8 bytes, single segment, no checksum, no dictionary
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + size.to_bytes(8, "little") + b"\x01\x00\x00"


def ipc_compressed_bomb(rows: int = GiB // 8) -> bytes:
    """An Arrow IPC stream whose buffers Arrow itself compressed: 1 GiB of doubles in a few KiB."""
    table = pa.table({"x": pa.array(np.zeros(rows))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def peak_rss_mb(pid: int) -> float:
    """The kernel's high-water mark of a process's resident memory, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def run_isolated(setup: str, code: str, timeout_s: float = 240) -> dict:
    """Run ``setup`` then ``code`` (which sets ``result``, a JSON-able dict) in a fresh interpreter.  Returns
    ``result`` plus ``grew_mb``: how far that interpreter's peak resident memory rose while ``code`` ran."""
    script = "\n".join(
        [
            "import json, resource",
            textwrap.dedent(setup),
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024",
            textwrap.dedent(code),
            "result['grew_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before",
            "print('RESULT ' + json.dumps(result))",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


class Hostile:
    """The helpers above, for test modules (with pytest's importlib mode a conftest is not importable)."""

    GiB, MiB = GiB, MiB
    zstd_bomb = staticmethod(zstd_bomb)
    zstd_declaring = staticmethod(zstd_declaring)
    ipc_compressed_bomb = staticmethod(ipc_compressed_bomb)
    zstd = staticmethod(lambda data: bytes(cramjam.zstd.compress(data)))
    peak_rss_mb = staticmethod(peak_rss_mb)
    run_isolated = staticmethod(run_isolated)


@pytest.fixture
def hostile() -> type[Hostile]:
    return Hostile
