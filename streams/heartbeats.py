"""A job's heartbeats aggregated per shard and step, in columns (pure: rows in, partials out; no Kafka, no clock).

One job's heartbeats arrive keyed ``job/shard`` (``HeartbeatBatch``; the shard is ``worker // shard_workers``), so
they spread over partitions and processors.  Each processor reduces, per ``(job, shard, partition)`` and step, what
it got to one :class:`~lockstep.schemas.records.StepPartial` (workers reported, the slowest, the shard clock's
``sent_at``, the workers behind the step): the detector combines a step's partials, a few per step instead of
one record per worker.  ``StepHeartbeat`` records (key ``job``) are shard -1 of their partition.

A shard's step is sent when every worker the shard expects reported it (``complete``), or once it has waited as long
as the processor's lateness bound allows (``timeout``: ``lateness_s`` on the processor's clock since its first
heartbeat, three step intervals on a slow job, or ``lateness_steps`` behind the shard's newest step): never merely
because a later step of another worker came first.  Agents send their heartbeats in batches, one per flush, and the
batches of different hosts arrive in any order, a few flush intervals apart; a step closed on a later step would
count the heartbeats of every worker whose batch came second as late.  The workers a shard expects are its
membership: the workers it has heard from, and the members the job's world size names (agents report it), less
those that sent their final heartbeat and those ``lateness_steps`` behind the shard's newest step (gone: not waited
for).  The partial carries that membership (``members``) and the world size, which the detector counts a step's
and a window's workers against.  The input records that fed an open step are held (:class:`Held`) until its
partial is out: the stage acknowledges them then, in offset order, so a replay after a crash rebuilds what was
open.  Decoding and aggregating are per batch: numpy over the batch's columns, a Python loop only over the (few)
shards and steps in it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from ..schemas.records import MAX_MISSING, AgentCounters, Echo, PartialClosed, StepPartial, WorkerCounters
from .plausible import FUTURE_STEPS, RESTART_STEPS, clock_ahead, clock_detail
from .plausible import future as _future

T = TypeVar("T")

#: (job, shard, heartbeats partition): who makes a shard's partials (one owner per partition at a time)
ShardKey = tuple[str, int, int]
#: steps a shard remembers having sent (a heartbeat for one of them is late), beyond the lateness bound in steps
DONE_MEMORY = 256
#: the default lateness bound: a step waits this long (processor clock) for its missing workers ...
LATENESS_S = 2.0
#: ... or until the shard is this many steps past it; a worker this far behind is no longer waited for
LATENESS_STEPS = 256
#: the members a world size names are added to a shard up to this many (a larger shard is learnt from heartbeats)
MAX_NAMED_MEMBERS = 65_536
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
        self.ranks = np.empty(0, dtype=_I8)  # members (workers seen or named by the world size), ascending
        self.last = np.empty(0, dtype=_I8)  # ... the highest step each reported (-1: none) ...
        self.since = np.empty(0, dtype=_I8)  # ... the shard's highest step when it became a member ...
        self.ended = np.empty(0, dtype=bool)  # ... and whether it sent its final heartbeat
        self.world = 0  # the job's world size as the shard's agents report it (0: unknown)
        self.open: dict[int, _Open] = {}
        self.news_holders: list[Held] = []
        self.final = 0
        # window -> its slowest receipt; (window, worker) -> a worker's refusal of it (the detector counts who refused)
        self.echoes: dict[str | tuple[str, int], Echo] = {}
        self.agents: dict[int, AgentCounters] = {}  # worker -> its agent's last counters
        self.agents_changed = False
        self.last_seen_at = 0.0
        self.born = 0.0  # processor clock at its first heartbeat (or its job's restart)
        self.held = 0  # bytes its open steps hold (flags per member, step times, held records)
        self.reset()

    def reset(self) -> None:
        """Forget the run (a restart from a checkpoint); the workers stay known."""
        self.last[:] = -1
        self.done = np.empty(0, dtype=_I8)  # steps sent lately
        self.done_max = -1
        self.since[:] = -1
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
        since = np.full(ranks.size, max(self.highest, 0), dtype=_I8)
        since[moved] = self.since
        ended = np.zeros(ranks.size, dtype=bool)
        ended[moved] = self.ended
        for op in self.open.values():
            seen = np.zeros(ranks.size, dtype=bool)
            seen[moved] = op.seen
            op.seen = seen
        self.ranks, self.last, self.since, self.ended = ranks, last, since, ended
        return np.searchsorted(ranks, workers)

    def expected(self, lateness_steps: int) -> np.ndarray:
        """The members a step waits for: not ended, and not ``lateness_steps`` behind the shard's newest step."""
        return ~self.ended & (np.maximum(self.last, self.since) >= self.highest - lateness_steps)

    def interval_s(self) -> float:
        """Seconds per step on the clock worker's own clock; NaN while unknown."""
        if len(self.pace) < 2:
            return math.nan
        p = np.asarray(self.pace)
        d = np.diff(p[:, 1]) / np.maximum(np.diff(p[:, 0]), 1)
        return float(np.median(d))


class HeartbeatShards(Generic[T]):
    """Per shard and step: heartbeats in, :class:`StepPartial` out, and the held records each partial releases."""

    def __init__(
        self, lateness_s: float = LATENESS_S, lateness_steps: int = LATENESS_STEPS, timeout_steps: float = 3.0
    ):
        self.lateness_s = lateness_s  # a step waits this long for its missing workers (processor clock) ...
        self.lateness_steps = lateness_steps  # ... or until the shard is this many steps past it
        self.timeout_steps = timeout_steps  # ... or, on a slow job, this many of its step intervals
        self.memory = max(DONE_MEMORY, lateness_steps)  # steps sent that a shard remembers
        self.shards: dict[ShardKey, _Shard] = {}
        self.late = 0  # heartbeats of steps already sent
        self.heartbeats = 0
        self.held_bytes = 0  # what the shards' open steps hold (``_Shard.held``, summed)

    @property
    def open_steps(self) -> int:
        return sum(len(sh.open) for sh in self.shards.values())

    def _shard(self, key: ShardKey, tenant: str, now: float) -> _Shard:
        sh = self.shards.get(key)
        if sh is None:
            sh = self.shards[key] = _Shard(key, tenant)
            sh.born = now
        sh.tenant = tenant or sh.tenant
        return sh

    # ------------------------------------------------------------------ in

    def future(self, key: ShardKey, step: np.ndarray, sent_at: np.ndarray, now: float) -> np.ndarray:
        """Rows no real worker can have sent: a clock a day ahead, or a step far beyond the shard's progress (the
        detector's rule, :func:`~lockstep.streams.plausible.future`, on the shard: a record that would poison it
        is refused before it touches it)."""
        return _future(step, sent_at, now, self.shards.get(key))

    def future_detail(self, key: ShardKey, step: np.ndarray, sent_at: np.ndarray, now: float) -> str:
        if clock_ahead(sent_at, now).any():
            return clock_detail(float(sent_at.max()) - now, "a host's clock")
        sh = self.shards.get(key)
        highest = sh.highest if sh is not None and sh.highest >= 0 else -1
        if highest < 0:
            return (
                f"step {int(step.max())} of job {key[0]!r} is more than {FUTURE_STEPS} steps beyond the other steps its "
                f"shard {key[1]} first showed: not plausible"
            )
        return (
            f"step {int(step.max())} of job {key[0]!r} is {int(step.max()) - highest} steps beyond the highest its shard "
            f"{key[1]} has shown ({highest}); at most {FUTURE_STEPS} plus its pace are plausible"
        )

    def add(
        self,
        key: ShardKey,
        tenant: str,
        rows: Rows,
        holders: list[Held[T]],
        now: float,
        world_size: int = 0,
        shard_workers: int = 0,
    ) -> list[tuple[StepPartial, list[T]]]:
        """A batch's rows of one shard; returns what a restart of the job from a checkpoint sent (the old run's steps).

        ``world_size`` (0: not reported): the job's workers as the agents know them; with ``shard_workers`` (0: the
        shard holds every worker, as ``StepHeartbeat`` records' shard does) it names the shard's members, which its
        steps wait for before any of them reported."""
        sh = self._shard(key, tenant, now)
        sh.last_seen_at = now
        out: list[tuple[StepPartial, list[T]]] = []
        if world_size > sh.world:
            sh.world = world_size
            lo = max(key[1], 0) * shard_workers if shard_workers else 0
            hi = min(lo + shard_workers, world_size) if shard_workers else world_size
            if 0 < hi - lo <= MAX_NAMED_MEMBERS:
                sh.index(np.arange(lo, hi, dtype=_I8))
        if not len(rows):
            self._account(sh)
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
                sh.since[:] = int(rows.step.min())  # every member is waited for again from the new run's start
                sh.born = now
        idx = sh.index(rows.worker)
        np.maximum.at(sh.last, idx, rows.step)
        sh.ended[idx] = False  # a worker that reports steps again did not end
        sh.newest_sent_at = max(sh.newest_sent_at, float(rows.sent_at.max()))
        sh.highest = max(sh.highest, int(rows.step.max()))
        live = ~np.isin(rows.step, sh.done) & (rows.step > sh.done_max - self.memory)
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
        self._account(sh)
        return out

    def _account(self, sh: _Shard) -> None:
        """The bytes the shard's open steps hold, recounted (after anything that opened, grew or closed one)."""
        held = 0
        for op in sh.open.values():
            held += op.seen.nbytes + sum(t.nbytes for t in op.times) + 8 * len(op.holders)
        self.held_bytes += held - sh.held
        sh.held = held

    def close_largest(self, now: float) -> list[tuple[StepPartial, list[T]]]:
        """The open steps of the shard whose open steps hold the most bytes, sent as they are (``timeout``: without
        their missing workers, whose heartbeats then come late); nothing when no open step holds any."""
        sh = max((s for s in self.shards.values() if s.open), key=lambda s: s.held, default=None)
        if sh is None or not sh.held:
            return []
        expected = sh.expected(self.lateness_steps)
        return [self._emit(sh, step, "timeout", now, expected) for step in sorted(sh.open)]

    def news(
        self,
        key: ShardKey,
        tenant: str,
        holder: Held[T],
        final: int = 0,
        echoes: Iterable[Echo] = (),
        agents: Iterable[WorkerCounters] = (),
        ended: Collection[int] = (),
    ) -> None:
        """What is rare, from one record: final heartbeats, trigger echoes, agent counters.  It goes out with the shard's
        next partial (a final heartbeat only once none of the shard's steps is open: the detector sees the steps
        first); the record is held until then.  ``ended``: the workers of those final heartbeats, no longer waited for."""
        sh = self._shard(key, tenant, 0.0)  # (the stage adds the record's rows first, which made the shard)
        sh.final += final
        if ended:
            sh.ended[sh.index(np.unique(np.asarray(list(ended), dtype=_I8)))] = True
            self._account(sh)  # new members grow the open steps' flags
        for e in echoes:
            if e.refused:
                sh.echoes[(e.window, e.worker)] = e
                continue
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
        """The partials the shards ``keys`` can send now: steps every expected worker reported, or that waited as long
        as the lateness bound allows (in step order), and news."""
        out: list[tuple[StepPartial, list[T]]] = []
        for key in keys:
            sh = self.shards.get(key)
            if sh is not None:
                out += self._due(sh, now)
        return out

    def expire(self, now: float) -> list[tuple[StepPartial, list[T]]]:
        """Steps that waited the lateness bound for their last workers go out without them (a hang: the detector hears
        which workers are behind); shards silent for an hour are forgotten."""
        out = []
        for key, sh in list(self.shards.items()):
            out += self._due(sh, now)
            if not sh.open and not sh.news and now - sh.last_seen_at > FORGET_AFTER_S:
                self.held_bytes -= self.shards.pop(key).held
        return out

    def wait_s(self, sh: _Shard) -> float:
        """How long a step of the shard waits for its missing workers: ``lateness_s``, or on a slow job
        ``timeout_steps`` of its step intervals."""
        interval = sh.interval_s()
        return max(self.lateness_s, self.timeout_steps * interval) if math.isfinite(interval) else self.lateness_s

    def _due(self, sh: _Shard, now: float) -> list[tuple[StepPartial, list[T]]]:
        out = []
        if sh.open:
            expected = sh.expected(self.lateness_steps)
            wait = self.wait_s(sh)
            # until the world size named its members, a shard learns them from heartbeats during its first wait
            known = bool(sh.world) or now - sh.born >= wait
            for step in sorted(sh.open):
                op = sh.open[step]
                if known and (op.seen | ~expected).all():
                    out.append(self._emit(sh, step, "complete", now, expected))
                elif now - op.opened_at >= wait or step <= sh.highest - self.lateness_steps:
                    out.append(self._emit(sh, step, "timeout", now, expected))
                else:
                    break
        if sh.news and not sh.open:
            out.append(self._emit(sh, None, "news", now))
        return out

    def drop(self, partitions: Collection[int]) -> None:
        """Heartbeats partitions revoked: their shards belong to another processor, which replays them."""
        for key in [k for k in self.shards if k[2] in partitions]:
            self.held_bytes -= self.shards.pop(key).held

    def _emit(
        self, sh: _Shard, step: int | None, closed: PartialClosed, now: float, expected: np.ndarray | None = None
    ) -> tuple[StepPartial, list[T]]:
        job, shard, partition = sh.key
        release: list[Held[T]] = []
        if expected is None:
            expected = sh.expected(self.lateness_steps)
        members = int(np.count_nonzero(expected))
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
                highest_sent_at=sh.newest_sent_at,
                closed="news",
                at=now,
                members=members,
                world_size=sh.world,
            )
        else:
            op = sh.open.pop(step)
            behind = sh.ranks[(sh.last < step) & ~sh.ended]
            clock = op.lowest[0] == sh.ranks[0]
            if clock:
                sh.pace.append((step, op.lowest[1]))
            sh.done = np.sort(np.append(sh.done, step))[-self.memory :]
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
                highest_sent_at=sh.newest_sent_at,
                missing=behind[:MAX_MISSING].tolist(),
                missing_total=int(behind.size),
                closed=closed,
                at=now,
                members=max(members, op.n),
                world_size=sh.world,
            )
            release = op.holders
        if sh.echoes or sh.agents_changed:
            p.echoes = sorted(sh.echoes.values(), key=lambda e: (e.window, e.worker))
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
        if step is not None:
            self._account(sh)
        return p, done
