"""Per-connection TCP health of the training process, from the kernel (``sock_diag`` netlink, ``tcp_info``).

A degraded link (a bad cable, a NIC dropping packets, a congested port) costs every member of a ring collective
alike, so the workers' timing cannot tell whose link it is; the connections can.  :func:`snapshot` asks the kernel
for every established TCP socket of this network namespace with its ``tcp_info`` (the way ``ss -ti`` does: one
netlink dump, no per-socket system calls), keeps those the process owns (its ``/proc/PID/fd`` socket inodes), and
:func:`connections` turns two snapshots (a window's start and end) into the connection table
(:data:`lockstep.schemas.events.CONNECTION_SCHEMA`): data segments sent and sent again, bytes sent, RTT.

Linux only; elsewhere, or where netlink is refused (a sandbox), :func:`snapshot` returns ``None`` and the window
simply has no connection table.  It costs about a millisecond per few hundred sockets, twice a window.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass

import pyarrow as pa

from ...schemas.events import CONNECTION_SCHEMA

log = logging.getLogger("lockstep.agent")

__all__ = ["Socket", "connections", "snapshot"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
TCP_ESTABLISHED = 1
_HDR = struct.Struct("=IHHII")  # nlmsghdr
_REQ = struct.Struct("=BBBxI48x")  # inet_diag_req_v2: family, protocol, ext, states, an empty sockid
_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")  # inet_diag_msg
_RTA = struct.Struct("=HH")
#: offsets in ``struct tcp_info`` (linux/tcp.h; fields only ever appended): the kernel sends as many bytes as it has
_TCP_INFO = {
    "rtt_us": (68, "I"),
    "total_retrans": (100, "I"),
    "data_segs_out": (156, "I"),
    "min_rtt_us": (148, "I"),
    "bytes_sent": (200, "Q"),
    "bytes_received": (128, "Q"),
}


@dataclass(frozen=True)
class Socket:
    """One TCP connection's counters at one moment (``None``: the kernel's ``tcp_info`` is too old to have it)."""

    inode: int
    local: str
    peer: str
    segs_out: int
    retrans: int
    bytes_sent: int | None
    bytes_received: int | None
    rtt_us: float | None
    min_rtt_us: float | None


def _address(family: int, raw: bytes, port: bytes) -> str:
    ip = socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw)
    if ip.startswith("::ffff:") and "." in ip:  # an IPv4 peer of a dual-stack socket: one spelling for one address
        ip = ip[7:]
    return f"{ip}:{int.from_bytes(port, 'big')}"


def _field(info: bytes, name: str) -> int | None:
    at, code = _TCP_INFO[name]
    size = struct.calcsize(code)
    return struct.unpack_from("=" + code, info, at)[0] if len(info) >= at + size else None


def _dump(family: int) -> list[Socket]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 1 << TCP_ESTABLISHED)
        nl.send(_HDR.pack(_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body)
        out: list[Socket] = []
        while True:
            data = nl.recv(1 << 16)
            at = 0
            while at + _HDR.size <= len(data):
                length, kind, _, _, _ = _HDR.unpack_from(data, at)
                if length < _HDR.size or kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, at + _HDR.size)
                    raise OSError(-errno, os.strerror(-errno))
                msg = at + _HDR.size
                fam, _, _, _, sport, dport, src, dst, _, _, _, _, _, _, inode = _MSG.unpack_from(data, msg)
                info = b""
                rta = msg + _MSG.size
                end = at + length
                while rta + _RTA.size <= end:
                    rlen, rtype = _RTA.unpack_from(data, rta)
                    if rlen < _RTA.size:
                        break
                    if rtype == INET_DIAG_INFO:
                        info = data[rta + _RTA.size : rta + rlen]
                    rta += (rlen + 3) & ~3
                if info:
                    rtt, min_rtt = _field(info, "rtt_us"), _field(info, "min_rtt_us")
                    out.append(
                        Socket(
                            inode=inode,
                            local=_address(fam, src, sport),
                            peer=_address(fam, dst, dport),
                            segs_out=_field(info, "data_segs_out") or 0,
                            retrans=_field(info, "total_retrans") or 0,
                            bytes_sent=_field(info, "bytes_sent"),
                            bytes_received=_field(info, "bytes_received"),
                            rtt_us=None if rtt is None else float(rtt),
                            min_rtt_us=None if min_rtt is None else float(min_rtt),
                        )
                    )
                at += (length + 3) & ~3


def _inodes(pid: int) -> set[int]:
    found = set()
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


_said_unavailable = False


def snapshot(pid: int | None = None) -> dict[int, Socket] | None:
    """The established TCP connections process ``pid`` (default: this one) owns, by socket inode; ``None`` where
    the kernel cannot be asked (not Linux, netlink refused), said once in the log."""
    global _said_unavailable
    try:
        owned = _inodes(os.getpid() if pid is None else pid)
        found = [s for family in (socket.AF_INET, socket.AF_INET6) for s in _dump(family)]
    except (OSError, AttributeError) as exc:  # AttributeError: a platform without AF_NETLINK
        if not _said_unavailable:
            log.info("per-connection TCP health not recorded: %s", exc)
            _said_unavailable = True
        return None
    return {s.inode: s for s in found if s.inode in owned}


def _change(now: int | None, then: int | None) -> int | None:
    return None if now is None else now - (then or 0)


def connections(worker: int, before: dict[int, Socket] | None, after: dict[int, Socket] | None) -> pa.Table | None:
    """Two snapshots -> the connection table of what happened between them: counters' change, RTT at the end.

    Only connections that carried data either way are kept (a job's idle connections, a full mesh of them in gloo,
    tell nothing).  A connection opened between them counts from zero; one closed between them is not in the table
    (its last counters are gone with it).  ``None`` where either snapshot is missing.
    """
    if before is None or after is None:
        return None
    rows = []
    for inode, s in sorted(after.items()):
        b = before.get(inode)
        if b is not None and (b.local, b.peer) != (s.local, s.peer):
            b = None  # an inode reused by another socket: from zero
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
            }
        )
    return pa.Table.from_pylist(rows, schema=CONNECTION_SCHEMA)
