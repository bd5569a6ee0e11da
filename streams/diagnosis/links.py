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

Pure: a table in, :class:`LossyLink` out; no Kafka, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..policy import DiagnosisPolicy

__all__ = ["LossyLink", "lossy_links", "peer_workers"]


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


def lossy_links(conns: pa.Table | None, dp: DiagnosisPolicy) -> list[LossyLink]:
    """The workers whose links lose packets, named from the window's connection table (see the module's text)."""
    if conns is None or conns.num_rows == 0:
        return []
    worker = conns.column("worker").to_numpy()
    other = peer_workers(conns)
    segs = conns.column("segs_out").to_numpy().astype(np.float64)
    retrans = conns.column("retrans").to_numpy().astype(np.float64)
    rtt = (
        pc.fill_null(conns.column("rtt_us"), np.nan).to_numpy()
        if "rtt_us" in conns.column_names
        else np.full(conns.num_rows, np.nan)
    )
    judged = (other >= 0) & (other != worker) & (segs >= dp.link_min_segs)
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
