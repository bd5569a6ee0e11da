"""Per-connection TCP health of the training process, from the kernel (``getsockopt(TCP_INFO)``).

A degraded link (a bad cable, a NIC dropping packets, a congested port) costs every member of a ring collective
alike, so the workers' timing cannot tell whose link it is; the connections can.  :func:`snapshot` runs inside the
training process: for each of its TCP sockets (its ``/proc/self/fd`` entries that are sockets) it asks the kernel
for the ``tcp_info`` (``getsockopt(TCP_INFO)`` on a duplicate of the descriptor, the counters ``ss -ti`` shows) and
the two ends' addresses, and :func:`connections` turns two snapshots (a window's start and end) into the connection
table (:data:`lockstep.schemas.events.CONNECTION_SCHEMA`): data segments sent and sent again, bytes sent, RTT.

Per socket a few system calls, a few microseconds, whatever else the host runs (a ``sock_diag`` netlink dump walks
the kernel's whole TCP table: 1.5 ms a family on an idle host; ``python benchmarks/bench_agent.py connections``).
Linux only; elsewhere :func:`snapshot` returns ``None`` and the window simply has no connection table.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass

import pyarrow as pa

from ...schemas.events import CONNECTION_SCHEMA

log = logging.getLogger("lockstep.agent")

__all__ = ["Socket", "connections", "snapshot"]

TCP_ESTABLISHED = 1
TCP_INFO_BYTES = 256  # more than any kernel's struct tcp_info so far: it sends what it has
#: offsets in ``struct tcp_info`` (linux/tcp.h; fields only ever appended): a field past what the kernel sent is None
_TCP_INFO = {
    "rtt_us": (68, "I"),
    "total_retrans": (100, "I"),
    "bytes_received": (128, "Q"),
    "min_rtt_us": (148, "I"),
    "data_segs_out": (156, "I"),
    "busy_us": (168, "Q"),  # time with data in flight (cumulative)
    "rwnd_limited_us": (176, "Q"),  # ... of it, held back by the receiver's window
    "sndbuf_limited_us": (184, "Q"),  # ... of it, held back by the sender's own buffer
    "bytes_sent": (200, "Q"),
}


@dataclass(frozen=True)
class Socket:
    """One TCP connection's counters at one moment (``None``: the kernel's ``tcp_info`` is too old to have it)."""

    local: str
    peer: str
    segs_out: int
    retrans: int
    bytes_sent: int | None
    bytes_received: int | None
    rtt_us: float | None
    min_rtt_us: float | None
    busy_us: int | None = None
    rwnd_limited_us: int | None = None
    sndbuf_limited_us: int | None = None


def _address(addr: tuple) -> str:
    ip = str(addr[0])
    if ip.startswith("::ffff:") and "." in ip:  # an IPv4 peer of a dual-stack socket: one spelling for one address
        ip = ip[7:]
    return f"{ip}:{addr[1]}"


def _field(info: bytes, name: str) -> int | None:
    at, code = _TCP_INFO[name]
    size = struct.calcsize(code)
    return struct.unpack_from("=" + code, info, at)[0] if len(info) >= at + size else None


def _socket(fd: int) -> Socket | None:
    """The connection behind descriptor ``fd``, None unless it is an established TCP socket (or it went meanwhile)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed meanwhile, or not a socket
        return None
    with dup:
        try:
            if dup.family not in (socket.AF_INET, socket.AF_INET6) or dup.type != socket.SOCK_STREAM:
                return None
            if dup.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) != socket.IPPROTO_TCP:
                return None
            info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            if not info or info[0] != TCP_ESTABLISHED:
                return None
            local, peer = _address(dup.getsockname()), _address(dup.getpeername())
        except OSError:  # not connected, or gone
            return None
    rtt, min_rtt = _field(info, "rtt_us"), _field(info, "min_rtt_us")
    return Socket(
        local=local,
        peer=peer,
        segs_out=_field(info, "data_segs_out") or 0,
        retrans=_field(info, "total_retrans") or 0,
        bytes_sent=_field(info, "bytes_sent"),
        bytes_received=_field(info, "bytes_received"),
        rtt_us=None if rtt is None else float(rtt),
        min_rtt_us=None if min_rtt is None else float(min_rtt),
        busy_us=_field(info, "busy_us"),
        rwnd_limited_us=_field(info, "rwnd_limited_us"),
        sndbuf_limited_us=_field(info, "sndbuf_limited_us"),
    )


_said_unavailable = False


def snapshot() -> dict[tuple[str, str], Socket] | None:
    """This process's established TCP connections, by their (local, peer) ends; ``None`` where the kernel cannot be
    asked (not Linux), said once in the log."""
    global _said_unavailable
    if not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        if not _said_unavailable:
            log.info("per-connection TCP health not recorded: tcp_info is Linux's")
            _said_unavailable = True
        return None
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                continue
        except OSError:  # closed meanwhile
            continue
        s = _socket(int(name))
        if s is not None:
            found[(s.local, s.peer)] = s
    return found


def _change(now: int | None, then: int | None) -> int | None:
    return None if now is None else now - (then or 0)


def connections(
    worker: int, before: dict[tuple[str, str], Socket] | None, after: dict[tuple[str, str], Socket] | None
) -> pa.Table | None:
    """Two snapshots -> the connection table of what happened between them: counters' change, RTT at the end.

    Only connections that carried data either way are kept (a job's idle connections, a full mesh of them in gloo,
    tell nothing).  A connection opened between them counts from zero; one closed between them is not in the table
    (its last counters are gone with it).  ``None`` where either snapshot is missing.
    """
    if before is None or after is None:
        return None
    rows = []
    for key, s in sorted(after.items()):
        b = before.get(key)
        if b is not None and (s.segs_out < b.segs_out or s.retrans < b.retrans):
            b = None  # the same ends, another connection (closed and opened again): from zero
        segs = s.segs_out - (b.segs_out if b else 0)
        sent = _change(s.bytes_sent, b.bytes_sent if b else 0)
        got = _change(s.bytes_received, b.bytes_received if b else 0)
        if not (segs > 0 or (sent or 0) > 0 or (got or 0) > 0):
            continue
        rows.append(
            {
                "worker": worker,
                "local": s.local,
                "peer": s.peer,
                "segs_out": segs,
                "retrans": s.retrans - (b.retrans if b else 0),
                "bytes_sent": sent,
                "rtt_us": s.rtt_us,
                "min_rtt_us": s.min_rtt_us,
                "busy_us": _change(s.busy_us, b.busy_us if b else 0),
                "rwnd_limited_us": _change(s.rwnd_limited_us, b.rwnd_limited_us if b else 0),
                "sndbuf_limited_us": _change(s.sndbuf_limited_us, b.sndbuf_limited_us if b else 0),
            }
        )
    return pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)
