"""A job's heartbeats aggregated per shard and step, in columns (pure: rows in, partials out; no Kafka, no clock).

One job's heartbeats arrive keyed ``job/shard`` (``HeartbeatBatch``; the shard is ``worker // shard_workers``), so
they spread over partitions and processors.  Each processor reduces, per ``(job, shard, partition)`` and step, what
it got to one :class:`~lockstep.schemas.records.StepPartial` (workers reported, the slowest, the shard clock's
``sent_at``, the workers behind the step): the detector combines a step's partials, a few per step instead of
one record per worker.  ``StepHeartbeat`` records (key ``job``) are shard -1 of their partition.

A shard's step is sent when its workers all reported (as many as in its recent steps), when a step two later has
started, or, with nothing later (a hang, the job's end), ``timeout`` after its first heartbeat.  The input
records that fed an open step are held (:class:`Held`) until its partial is out: the stage acknowledges them then,
in offset order, so a replay after a crash rebuilds what was open.  Decoding and aggregating are per batch: numpy
over the batch's columns, a Python loop only over the (few) shards and steps in it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from ..schemas.records import MAX_MISSING, AgentCounters, Echo, PartialClosed, StepPartial, WorkerCounters
from .detector import FUTURE_CLOCK_S, FUTURE_PACE, FUTURE_STEPS, RESTART_STEPS

T = TypeVar("T")

#: (job, shard, heartbeats partition): who makes a shard's partials (one owner per partition at a time)
ShardKey = tuple[str, int, int]
#: steps a shard remembers having sent (a heartbeat for one of them is late)
DONE_MEMORY = 256
#: a shard silent this long is forgotten
FORGET_AFTER_S = 3600.0
_I8 = np.int64


class Held(Generic[T]):
    """One input record and how many open steps (or news) of any shard still need it."""

    __slots__ = ("item", "refs")

    def __init__(self, item: T):
        self.item = item
        self.refs = 0


@dataclass(slots=True)
class Rows:
    """Heartbeats as columns; ``holder[i]``: the index, in the list given with them, of the record row ``i`` came in."""

    worker: np.ndarray
    step: np.ndarray
    step_time_s: np.ndarray
    sent_at: np.ndarray
    holder: np.ndarray

    def __len__(self) -> int:
        return int(self.worker.size)

    def where(self, keep: np.ndarray) -> Rows:
        return Rows(self.worker[keep], self.step[keep], self.step_time_s[keep], self.sent_at[keep], self.holder[keep])


class _Open:
    """One open step of a shard."""

    __slots__ = (
        "holders",
        "lowest",
        "n",
        "newest_sent_at",
        "opened_at",
        "seen",
        "slowest_s",
        "slowest_worker",
        "times",
    )

    def __init__(self, size: int, now: float):
        self.seen = np.zeros(size, dtype=bool)  # by position in the shard's ranks
        self.n = 0
        self.slowest_s = 0.0
        self.slowest_worker = -1
        self.times: list[np.ndarray] = []
        self.lowest = (math.inf, 0.0)  # (worker, sent_at) of the lowest worker that reported the step
        self.newest_sent_at = 0.0
        self.opened_at = now
        self.holders: list[Held] = []


class _Shard:
    def __init__(self, key: ShardKey, tenant: str):
        self.key = key
        self.tenant = tenant
        self.ranks = np.empty(0, dtype=_I8)  # workers seen, ascending
        self.last = np.empty(0, dtype=_I8)  # ... and the highest step each reported
        self.open: dict[int, _Open] = {}
        self.news_holders: list[Held] = []
        self.final = 0
        self.echoes: dict[str, Echo] = {}  # window -> its slowest receipt
        self.agents: dict[int, AgentCounters] = {}  # worker -> its agent's last counters
        self.agents_changed = False
        self.last_seen_at = 0.0
        self.reset()

    def reset(self) -> None:
        """Forget the run (a restart from a checkpoint); the workers stay known."""
        self.last[:] = -1
        self.done = np.empty(0, dtype=_I8)  # steps sent lately
        self.done_max = -1
        self.counts: deque[int] = deque(maxlen=16)  # workers of recent steps
        self.highest = -1
        self.newest_sent_at = 0.0
        self.pace: deque[tuple[int, float]] = deque(maxlen=16)  # (step, the clock worker's sent_at)

    @property
    def news(self) -> bool:
        return bool(self.final or self.echoes or self.agents_changed)

    def index(self, workers: np.ndarray) -> np.ndarray:
        """Positions of ``workers`` in ``ranks``, which grows (and the open steps with it) when new ones appear."""
        idx = np.searchsorted(self.ranks, workers)
        if self.ranks.size and idx.max() < self.ranks.size and np.array_equal(self.ranks[idx], workers):
            return idx
        ranks = np.union1d(self.ranks, workers)
        moved = np.searchsorted(ranks, self.ranks)
        last = np.full(ranks.size, -1, dtype=_I8)
        last[moved] = self.last
        for op in self.open.values():
            seen = np.zeros(ranks.size, dtype=bool)
            seen[moved] = op.seen
            op.seen = seen
        self.ranks, self.last = ranks, last
        return np.searchsorted(ranks, workers)

    def interval_s(self) -> float:
        """Seconds per step on the clock worker's own clock; NaN while unknown."""
        if len(self.pace) < 2:
            return math.nan
        p = np.asarray(self.pace)
        d = np.diff(p[:, 1]) / np.maximum(np.diff(p[:, 0]), 1)
        return float(np.median(d))


class HeartbeatShards(Generic[T]):
    """Per shard and step: heartbeats in, :class:`StepPartial` out, and the held records each partial releases."""

    def __init__(self, timeout_min_s: float = 1.0, timeout_steps: float = 3.0):
        self.timeout_min_s = timeout_min_s
        self.timeout_steps = timeout_steps
        self.shards: dict[ShardKey, _Shard] = {}
        self.late = 0  # heartbeats of steps already sent
        self.heartbeats = 0

    @property
    def open_steps(self) -> int:
        return sum(len(sh.open) for sh in self.shards.values())

    def _shard(self, key: ShardKey, tenant: str) -> _Shard:
        sh = self.shards.get(key)
        if sh is None:
            sh = self.shards[key] = _Shard(key, tenant)
        sh.tenant = tenant or sh.tenant
        return sh

    # ------------------------------------------------------------------ in

    def future(self, key: ShardKey, step: np.ndarray, sent_at: np.ndarray, now: float) -> np.ndarray:
        """Rows no real worker can have sent: a clock a day ahead, or a step far beyond the shard's progress (the
        detector's rule, on the shard: a record that would poison it is refused before it touches it)."""
        bad = sent_at > now + FUTURE_CLOCK_S
        sh = self.shards.get(key)
        if sh is not None and sh.highest >= 0:
            interval = sh.interval_s()
            pace = FUTURE_PACE * (now - sh.last_seen_at) / interval if math.isfinite(interval) and interval > 0 else 0.0
            bad |= step > sh.highest + FUTURE_STEPS + pace
        return bad

    def future_detail(self, key: ShardKey, step: np.ndarray, sent_at: np.ndarray, now: float) -> str:
        if (sent_at > now + FUTURE_CLOCK_S).any():
            ahead = float(sent_at.max()) - now
            return f"sent_at is {ahead / 3600:.0f} h ahead of the processor's clock (at most {FUTURE_CLOCK_S / 3600:.0f} h): a host's clock is broken"
        sh = self.shards[key]
        return (
            f"step {int(step.max())} of job {key[0]!r} is {int(step.max()) - sh.highest} steps beyond the highest its shard "
            f"{key[1]} has shown ({sh.highest}); at most {FUTURE_STEPS} plus its pace are plausible"
        )

    def add(
        self, key: ShardKey, tenant: str, rows: Rows, holders: list[Held[T]], now: float
    ) -> list[tuple[StepPartial, list[T]]]:
        """A batch's rows of one shard; returns what a restart of the job from a checkpoint sent (the old run's steps)."""
        sh = self._shard(key, tenant)
        sh.last_seen_at = now
        out: list[tuple[StepPartial, list[T]]] = []
        if not len(rows):
            return out
        self.heartbeats += len(rows)
        if sh.done_max >= 0:
            before = sh.done_max - RESTART_STEPS
            restart = (rows.step < before) & (rows.sent_at > sh.newest_sent_at)
            if restart.any():  # far behind yet newer than anything seen: the job restarted from a checkpoint
                out = [self._emit(sh, s, "timeout", now) for s in sorted(sh.open)]
                sh.reset()
                keep = rows.step < before  # what is not of the new run is a straggler of the old one
                self.late += int((~keep).sum())
                rows = rows.where(keep)
        idx = sh.index(rows.worker)
        np.maximum.at(sh.last, idx, rows.step)
        sh.newest_sent_at = max(sh.newest_sent_at, float(rows.sent_at.max()))
        sh.highest = max(sh.highest, int(rows.step.max()))
        live = ~np.isin(rows.step, sh.done) & (rows.step > sh.done_max - DONE_MEMORY)
        self.late += int(live.size - np.count_nonzero(live))
        steps = rows.step[live]
        for step in np.unique(steps).tolist():
            m = live & (rows.step == step)
            op = sh.open.get(step)
            if op is None:
                op = sh.open[step] = _Open(sh.ranks.size, now)
            ii, t = idx[m], rows.step_time_s[m]
            uniq, first = np.unique(ii, return_index=True)
            fresh = ~op.seen[uniq]
            op.seen[uniq[fresh]] = True
            op.n += int(np.count_nonzero(fresh))
            op.times.append(t[first[fresh]])
            j = int(np.argmax(t))
            if t[j] > op.slowest_s:
                op.slowest_s, op.slowest_worker = float(t[j]), int(sh.ranks[ii[j]])
            low = int(np.argmin(ii))
            if sh.ranks[ii[low]] < op.lowest[0]:
                op.lowest = (int(sh.ranks[ii[low]]), float(rows.sent_at[m][low]))
            op.newest_sent_at = max(op.newest_sent_at, float(rows.sent_at[m].max()))
            for h in np.unique(rows.holder[m]).tolist():
                held = holders[h]
                held.refs += 1
                op.holders.append(held)
        return out

    def news(
        self,
        key: ShardKey,
        tenant: str,
        holder: Held[T],
        final: int = 0,
        echoes: Iterable[Echo] = (),
        agents: Iterable[WorkerCounters] = (),
    ) -> None:
        """What is rare, from one record: final heartbeats, trigger echoes, agent counters.  It goes out with the shard's
        next partial (a final heartbeat only once none of the shard's steps is open: the detector sees the steps
        first); the record is held until then."""
        sh = self._shard(key, tenant)
        sh.final += final
        for e in echoes:
            seen = sh.echoes.get(e.window)
            if seen is None or e.latency_s > seen.latency_s:
                sh.echoes[e.window] = e
        for a in agents:
            sh.agents[a.worker] = a.counters
            sh.agents_changed = True
        if sh.news:
            holder.refs += 1
            sh.news_holders.append(holder)

    # ------------------------------------------------------------------ out

    def ready(self, keys: Iterable[ShardKey], now: float) -> list[tuple[StepPartial, list[T]]]:
        """The partials the shards ``keys`` can send now: complete steps (in order), and news."""
        out = []
        for key in keys:
            sh = self.shards.get(key)
            if sh is None:
                continue
            for step in sorted(sh.open):
                op = sh.open[step]
                expected = max(sh.counts, default=0)  # a step just sent may have taught it
                if expected and op.n >= expected:
                    out.append(self._emit(sh, step, "complete", now))
                elif step <= sh.highest - 2:
                    out.append(self._emit(sh, step, "later", now))
                else:
                    break
            if sh.news and not sh.open:
                out.append(self._emit(sh, None, "news", now))
        return out

    def expire(self, now: float) -> list[tuple[StepPartial, list[T]]]:
        """Steps that waited ``timeout`` for their last workers go out without them (a hang: the detector hears which
        workers are behind); shards silent for an hour are forgotten."""
        out = []
        for key, sh in list(self.shards.items()):
            interval = sh.interval_s()
            timeout = (
                max(self.timeout_min_s, self.timeout_steps * interval)
                if math.isfinite(interval)
                else self.timeout_min_s
            )
            for step in sorted(sh.open):
                if now - sh.open[step].opened_at < timeout:
                    break
                out.append(self._emit(sh, step, "timeout", now))
            if sh.news and not sh.open:
                out.append(self._emit(sh, None, "news", now))
            if not sh.open and not sh.news and now - sh.last_seen_at > FORGET_AFTER_S:
                del self.shards[key]
        return out

    def drop(self, partitions: Collection[int]) -> None:
        """Heartbeats partitions revoked: their shards belong to another processor, which replays them."""
        for key in [k for k in self.shards if k[2] in partitions]:
            del self.shards[key]

    def _emit(self, sh: _Shard, step: int | None, closed: PartialClosed, now: float) -> tuple[StepPartial, list[T]]:
        job, shard, partition = sh.key
        release: list[Held[T]] = []
        if step is None:  # news only
            p = StepPartial(
                job=job,
                tenant=sh.tenant,
                step=max(sh.highest, 0),
                shard=shard,
                partition=partition,
                workers=0,
                newest_sent_at=sh.newest_sent_at,
                highest=max(sh.highest, 0),
                closed="news",
                at=now,
            )
        else:
            op = sh.open.pop(step)
            sh.counts.append(op.n)
            behind = sh.ranks[sh.last < step]
            clock = op.lowest[0] == sh.ranks[0]
            if clock:
                sh.pace.append((step, op.lowest[1]))
            sh.done = np.sort(np.append(sh.done, step))[-DONE_MEMORY:]
            sh.done_max = max(sh.done_max, step)
            times = np.concatenate(op.times) if op.times else np.zeros(1)
            p = StepPartial(
                job=job,
                tenant=sh.tenant,
                step=step,
                shard=shard,
                partition=partition,
                workers=op.n,
                slowest_s=op.slowest_s,
                slowest_worker=op.slowest_worker,
                median_s=float(np.median(times)),
                clock_worker=int(op.lowest[0]) if clock else -1,
                clock_sent_at=op.lowest[1] if clock else 0.0,
                newest_sent_at=op.newest_sent_at,
                highest=sh.highest,
                missing=behind[:MAX_MISSING].tolist(),
                missing_total=int(behind.size),
                closed=closed,
                at=now,
            )
            release = op.holders
        if sh.echoes or sh.agents_changed:
            p.echoes = sorted(sh.echoes.values(), key=lambda e: e.window)
            if sh.agents_changed:
                fields = AgentCounters.__struct_fields__
                p.agents = AgentCounters(**{f: sum(getattr(c, f) for c in sh.agents.values()) for f in fields})
            sh.echoes, sh.agents_changed = {}, False
        if sh.final and not sh.open:
            p.final, sh.final = sh.final, 0
        if not sh.news:
            release = release + sh.news_holders
            sh.news_holders = []
        done = []
        for held in release:
            held.refs -= 1
            if held.refs == 0:
                done.append(held.item)
        return p, done
