"""Lossy links from the workers' TCP connections: the worker whose link drops packets, where timing cannot tell.

A ring or tree collective runs at its slowest link, so every member waits alike and no worker's own work stands
out; the connections can tell.  Each worker's agent records its training process's TCP connections over the window
(:data:`lockstep.schemas.events.CONNECTION_SCHEMA`: data segments sent, sent again).  A connection between two
workers appears in both tables with its ends swapped, which gives every connection the worker at its other end.

- A connection is **lossy** when it sent at least ``link_min_segs`` data segments and at least ``link_min_retrans``
  of them again, at least ``link_loss_min`` of them (0.5%: a healthy data-centre path loses well under 0.1%; on
  this 2-core machine, where a descheduled receiver makes timers fire, a healthy connection sent 0.14% again).
  Loss shows at the sender.
- A lossy connection is an edge between its two workers: one of their links is at fault.  A worker is **named**
  when it is at one end of lossy connections to at least two different peers, and to more than any of those
  peers is: the one endpoint its lossy connections share.  In a ring, a worker's bad link slows the connection to
  the previous rank and the one from the next: both name it, and each neighbour has one.  A pair's single
  connection names neither (its link is both workers'); a network where every worker loses names none.

A link can also be slow without losing anything: a port negotiated down to a lower speed, a shaper, a congested
path.  Its connections then take longer to deliver the same bytes.  The kernel counts, per connection, the time it
had data in flight (``busy_us``) and how much of that the receiver's window or the sender's own buffer held it back;
the rest is the network's.  A connection's **throughput while busy** is its bytes sent over that rest.

- A connection is judged when it sent at least ``link_min_segs`` data segments, the network's part of its busy
  time is at least ``link_min_busy_us`` (the kernel counts busy time in ticks of 1-4 ms), and it sent at least
  ``link_bulk_share`` of the bytes of the job's busiest judged connection.  Each TCP connection appears once per
  end, and in a ring one end carries the data while the other sends only small control messages (48 bytes a
  segment in gloo's rings here): their throughput while busy is their latency, not the link's speed, and counted
  among the others they pull the median down by three orders of magnitude.  A segment floor does not tell them
  apart: it is a count, and a longer window passes it (an 8-rank ring's control ends send 560 segments in 10
  steps, 1,344 in 24).
- A worker is **named** when it is at one end of judged connections to at least two different peers, and every one
  of them ran at most ``link_slow_ratio`` of the median throughput of the judged connections it is not an end of: in
  a ring, its link slows the connection to the next rank and the one from the previous, while each neighbour still
  has one fast connection.  A pair has no other connection to compare with, and names neither.

Both rules judge only connections between two addresses (:func:`between_hosts`): a connection within one host,
over loopback or between two processes on one address, crosses no link; its speed and its timer-fired
retransmits are the host's CPU (on this 2-core machine, healthy 8-rank loopback rings spread 2.6x in throughput
while busy).

Pure: a table in, :class:`LossyLink` and :class:`SlowLink` out; no Kafka, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..policy import DiagnosisPolicy

__all__ = ["LossyLink", "SlowLink", "between_hosts", "lossy_links", "peer_workers", "slow_links"]


@dataclass(frozen=True)
class LossyLink:
    """A worker named as the common endpoint of lossy connections, and what showed it."""

    worker: int
    peers: tuple[int, ...]  # the workers at the other end of its lossy connections
    retrans: int  # segments sent again on those connections (by either end)
    segs_out: int  # data segments sent on them
    loss: float  # retrans / segs_out
    others_loss: float  # the median share sent again of the judged connections it is not an end of
    judged: int  # connections between workers that sent enough to be judged
    lossy: int  # of them lossy, in the whole job
    rtt_us: float  # the median RTT of its lossy connections (NaN: not recorded)
    others_rtt_us: float  # the median RTT of the judged connections it is not an end of


@dataclass(frozen=True)
class SlowLink:
    """A worker named because each of its connections ran well below the others while data was in flight."""

    worker: int
    peers: tuple[int, ...]  # the workers at the other end of its judged connections
    mbps: float  # the fastest of its judged connections' throughput while busy (MB/s)
    others_mbps: float  # the median of the judged connections it is not an end of
    judged: int  # connections between workers judged, in the whole job
    rtt_us: float  # the median RTT of its judged connections (NaN: not recorded)
    others_rtt_us: float  # ... of the others


def peer_workers(conns: pa.Table) -> np.ndarray:
    """Each connection's worker at the other end: the worker that has it with its ends swapped (-1: none does, or
    two workers claim that end: not one of the job's workers, or not uniquely one)."""
    forward = pc.binary_join_element_wise(conns.column("local"), conns.column("peer"), "|")
    backward = pc.binary_join_element_wise(conns.column("peer"), conns.column("local"), "|")
    at = pc.fill_null(pc.index_in(backward, value_set=forward), -1).to_numpy()
    worker = conns.column("worker").to_numpy()
    other = np.where(at >= 0, worker[np.maximum(at, 0)], -1)
    counts = pc.value_counts(forward)
    claimed_twice = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    ambiguous = pc.or_(pc.is_in(forward, value_set=claimed_twice), pc.is_in(backward, value_set=claimed_twice))
    return np.where(ambiguous.to_numpy(zero_copy_only=False), -1, other)


def _median(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else float("nan")


def between_hosts(conns: pa.Table) -> np.ndarray:
    """Per connection: whether its two ends have different addresses.  A connection within one host (loopback, or
    two processes on one address) crosses no link: its speed and its losses are the host's CPU, not a network's."""
    address = r":[^:]*$"  # address:port -> address (IPv6 addresses keep their colons)
    local = pc.replace_substring_regex(conns.column("local"), address, "")
    peer = pc.replace_substring_regex(conns.column("peer"), address, "")
    out: np.ndarray = pc.not_equal(local, peer).to_numpy(zero_copy_only=False)
    return out


def _column(conns: pa.Table, name: str) -> np.ndarray:
    """A numeric column as float64, NaN where empty or where the table (an older agent's) has no such column."""
    if name not in conns.column_names:
        return np.full(conns.num_rows, np.nan)
    out: np.ndarray = pc.fill_null(pc.cast(conns.column(name), pa.float64()), np.nan).to_numpy()
    return out


def _judgeable(conns: pa.Table, dp: DiagnosisPolicy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each connection's worker, the worker at its other end, and whether both rules may judge it: another worker
    at its other end, across two addresses, at least ``link_min_segs`` data segments sent."""
    worker = conns.column("worker").to_numpy()
    other = peer_workers(conns)
    segs = conns.column("segs_out").to_numpy()
    return worker, other, (other >= 0) & (other != worker) & (segs >= dp.link_min_segs) & between_hosts(conns)


def lossy_links(conns: pa.Table | None, dp: DiagnosisPolicy) -> list[LossyLink]:
    """The workers whose links lose packets, named from the window's connection table (see the module's text)."""
    if conns is None or conns.num_rows == 0:
        return []
    worker, other, judged = _judgeable(conns, dp)
    segs = conns.column("segs_out").to_numpy().astype(np.float64)
    retrans = conns.column("retrans").to_numpy().astype(np.float64)
    rtt = _column(conns, "rtt_us")
    if judged.sum() < 2:
        return []
    loss = np.divide(retrans, segs, out=np.zeros_like(segs), where=segs > 0)
    lossy = judged & (retrans >= dp.link_min_retrans) & (loss >= dp.link_loss_min)
    if not lossy.any():
        return []
    a, b = np.minimum(worker, other)[lossy], np.maximum(worker, other)[lossy]
    pairs = np.unique(np.stack([a, b], axis=1), axis=0)  # one edge per pair of workers, whichever side lost
    ends, degree = np.unique(pairs.ravel(), return_counts=True)
    deg = dict(zip(ends.tolist(), degree.tolist(), strict=True))
    found = []
    for w in ends[degree >= 2].tolist():
        peers = sorted(set(pairs[pairs[:, 0] == w, 1].tolist()) | set(pairs[pairs[:, 1] == w, 0].tolist()))
        if not all(deg[p] < deg[w] for p in peers):
            continue  # a peer shares as many lossy connections: not the one common endpoint
        ends_w = (worker == w) | (other == w)
        mine = lossy & ends_w
        rest = judged & ~ends_w
        r, s = int(retrans[mine].sum()), int(segs[mine].sum())
        found.append(
            LossyLink(
                worker=int(w),
                peers=tuple(int(p) for p in peers),
                retrans=r,
                segs_out=s,
                loss=r / s if s else 0.0,
                others_loss=_median(loss[rest]),
                judged=int(judged.sum()),
                lossy=int(lossy.sum()),
                rtt_us=_median(rtt[mine]),
                others_rtt_us=_median(rtt[rest]),
            )
        )
    return found


def slow_links(conns: pa.Table | None, dp: DiagnosisPolicy) -> list[SlowLink]:
    """The workers whose links deliver slowly, named from the window's connection table (see the module's text)."""
    if conns is None or conns.num_rows == 0:
        return []
    worker, other, judged = _judgeable(conns, dp)
    busy = _column(conns, "busy_us")
    held = np.nan_to_num(_column(conns, "rwnd_limited_us")) + np.nan_to_num(_column(conns, "sndbuf_limited_us"))
    net_us = busy - held  # NaN where the agent's kernel did not count busy time
    sent = _column(conns, "bytes_sent")
    judged &= (worker >= 0) & (net_us >= dp.link_min_busy_us) & (sent > 0)
    if judged.any():  # bulk ends only: a control end's throughput is its latency (see the module's text)
        judged &= sent >= dp.link_bulk_share * np.max(sent[judged])
    if judged.sum() < 3:  # a worker's two connections and at least one other
        return []
    mbps = np.divide(sent, net_us, out=np.full(sent.shape, np.nan), where=judged)  # bytes/us = MB/s
    rtt = _column(conns, "rtt_us")
    # each worker's fastest judged connection (either end), and how many distinct peers it has: vectorised, so
    # that only the few workers that could be slow (fastest below the ratio of the job's fastest) are looked at
    a, b, m = worker[judged], other[judged], mbps[judged]
    n = int(max(a.max(), b.max())) + 1
    fastest = np.zeros(n)
    np.maximum.at(fastest, a, m)
    np.maximum.at(fastest, b, m)
    pairs = np.unique(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1), axis=0)
    degree = np.bincount(pairs.ravel(), minlength=n)
    candidates = np.flatnonzero((degree >= 2) & (fastest > 0) & (fastest <= dp.link_slow_ratio * m.max()))
    found = []
    for w in candidates.tolist():
        ends_w = judged & ((worker == w) | (other == w))
        rest = judged & ~ends_w
        peers = sorted(set(np.where(worker[ends_w] == w, other[ends_w], worker[ends_w]).tolist()))
        if not rest.any():
            continue
        others = float(np.median(mbps[rest]))
        if fastest[w] > dp.link_slow_ratio * others:
            continue
        found.append(
            SlowLink(
                worker=int(w),
                peers=tuple(int(p) for p in peers),
                mbps=float(fastest[w]),
                others_mbps=others,
                judged=int(judged.sum()),
                rtt_us=_median(rtt[ends_w]),
                others_rtt_us=_median(rtt[rest]),
            )
        )
    return found
