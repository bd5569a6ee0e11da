"""The per-host relay: one agent per host speaks to Kafka for its host's heartbeats and triggers.

The agent of local rank 0 runs a :class:`Relay`: a Unix datagram socket ``relay.sock`` in a per-run
directory (:func:`run_dir`, mode 0700).  The agents of the other local ranks hold a :class:`RelayLink`
(their own datagram socket in the same directory) and, while the relay answers, have no Kafka client
at all:

- each flush, an agent hands its heartbeats to the relay as one ``HeartbeatBatch`` per datagram
  (a non-blocking ``sendto``: never a wait);
- the relay's thread (``lockstep-agent-relay``) gathers them; at its own flush the relay agent merges
  them with its own heartbeats (:func:`merge_batches`) and sends one ``HeartbeatBatch`` per shard
  through its one Kafka producer;
- the relay forwards the control records it reads (``ProfileTrigger``, ``RawRequest``) to every agent
  it has heard from, and answers an agent's hello (no periodic pings: each would wake every agent's
  publishing thread; a hand-over the relay takes says it is there, one it cannot take that it is not).

Robustness: a hand-over that the relay cannot take (no socket: the relay is not there or has ended;
nobody bound: it was killed; its queue is full: it is stalled, since Linux queues at most
``net.unix.max_dgram_qlen`` datagrams, 10 by default) fails at once: the agent then sends that flush
and every later one itself, through its own (lazily created) Kafka producer and spool, and follows the
control topic itself, as an agent without relay does.  It says hello with backoff up to ``retry_s``;
once a relay answers, it hands over again.  An agent that starts before its relay keeps its
heartbeats (bounded) for up to ``join_s``.  Buffers are bounded (the relay's pending rows, the
sockets' kernel queues).  What a relay killed outright held (about one flush of each agent's
heartbeats) is lost.

Frames (version 1): ``b"LSR" + version byte + kind byte + payload``; kinds ``H`` (payload: an encoded
``HeartbeatBatch``), ``C`` (an encoded ``ProfileTrigger`` or ``RawRequest``), ``A`` (alive, empty),
``?`` (hello, empty).  A frame of another version or kind is counted and ignored.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import select
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...schemas.errors import LockstepError
from ...schemas.records import (
    MAX_BATCH_ROWS,
    HeartbeatBatch,
    ProfileTrigger,
    RawRequest,
    RecordError,
    decode,
    encode,
)

log = logging.getLogger("lockstep.agent")

MAGIC = b"LSR"
VERSION = 1
HEARTBEATS, CONTROL, ALIVE, HELLO = b"H", b"C", b"A", b"?"
KINDS = frozenset((HEARTBEATS, CONTROL, ALIVE, HELLO))
HEADER = len(MAGIC) + 2
#: one datagram's payload at most (well under Linux's default socket buffer of ~208 KiB)
MAX_DATAGRAM = 60 << 10
RELAY_SOCKET = "relay.sock"
#: heartbeat rows the relay holds for its next flush; beyond, the oldest batches are dropped and counted
PENDING_ROWS_MAX = 200_000
#: how often the relay's thread forgets agents gone quiet
HOUSEKEEPING_S = 1.0
#: an agent not heard from for this long is no longer sent control records and pings
PEER_FORGET_S = 60.0
#: heartbeat rows an agent keeps while it waits for a relay to start; beyond, it sends them itself
HELD_ROWS_MAX = 10_000
#: an agent without relay says hello again after this long, then twice as long each time, up to its ``retry_s``
FIRST_RETRY_S = 0.5
#: environment variables naming one run of a launcher (what tells two runs of the same job apart)
RUN_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")

ControlRecord = ProfileTrigger | RawRequest
_LINKS = itertools.count()  # links of this process (tests hold several)

#: send errors that mean "the relay cannot take it now": no socket, nobody bound, its queue full
UNREACHABLE = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, ConnectionResetError, InterruptedError)


class FrameError(LockstepError, ValueError):
    """A datagram that is not a frame this version reads."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return MAGIC + bytes((VERSION,)) + kind + payload


def parse_frame(data: bytes) -> tuple[bytes, bytes]:
    """(kind, payload) of a frame; :class:`FrameError` for anything else."""
    if len(data) < HEADER or data[: len(MAGIC)] != MAGIC:
        raise FrameError("not a relay frame")
    if data[len(MAGIC)] != VERSION:
        raise FrameError(f"relay frame version {data[len(MAGIC)]}, this agent reads {VERSION}")
    kind = data[len(MAGIC) + 1 : HEADER]
    if kind not in KINDS:
        raise FrameError(f"unknown relay frame kind {kind!r}")
    return kind, data[HEADER:]


def run_id(env: Mapping[str, str]) -> str:
    """What tells this run apart from another of the same job on the host: the launcher's run ids and the
    parent process (torchrun's agent, slurmstepd, orted: every rank of a run on a host shares it)."""
    ids = [f"{k}={env[k]}" for k in RUN_VARS if env.get(k) not in (None, "", "none")]
    return ",".join([*ids, f"ppid={os.getppid()}"])


def run_dir(job: str, host: str = "", env: Mapping[str, str] | None = None, base: Path | None = None) -> Path:
    """The per-run directory the ranks of one run on one host meet in (short: a socket path has <= 107 bytes).
    ``host`` is the host the agent says it is on: ranks configured as different hosts never share a relay."""
    env = os.environ if env is None else env
    digest = hashlib.sha1(f"{job}\0{host}\0{run_id(env)}".encode()).hexdigest()[:16]
    return (base or Path(tempfile.gettempdir())) / f"lockstep-relay-{os.getuid()}" / digest


def _private_dir(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"relay directory {path} belongs to another user")


def _bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket left by a process that ended
    sock.bind(str(path))
    return sock


# --------------------------------------------------------------------------- pure: merging and splitting batches


def merge_batches(batches: Iterable[HeartbeatBatch], max_rows: int = MAX_BATCH_ROWS) -> list[HeartbeatBatch]:
    """Heartbeat batches (several agents' flushes) as one batch per job and shard: columns concatenated in the
    order given, ``final`` rows renumbered, sparse fields joined; a host only when all came from one."""
    groups: dict[tuple[str, str, int, int], list[HeartbeatBatch]] = {}
    for b in batches:
        groups.setdefault((b.job, b.tenant, b.shard, b.shard_workers), []).append(b)
    out = []
    for (job, tenant, shard, shard_workers), group in groups.items():
        if len(group) == 1 and len(group[0].worker) <= max_rows:
            out.append(group[0])
            continue
        hosts = {b.host for b in group}
        worker: list[int] = []
        step: list[int] = []
        step_time_s: list[float] = []
        sent_at: list[float] = []
        final: list[int] = []
        echoes = []
        agents = []
        for b in group:
            final += [len(worker) + i for i in b.final]
            worker += b.worker
            step += b.step
            step_time_s += b.step_time_s
            sent_at += b.sent_at
            echoes += b.echoes
            agents += b.agents
        merged = HeartbeatBatch(
            job=job,
            tenant=tenant,
            shard=shard,
            shard_workers=shard_workers,
            host=hosts.pop() if len(hosts) == 1 else "",
            worker=worker,
            step=step,
            step_time_s=step_time_s,
            sent_at=sent_at,
            final=final,
            echoes=echoes,
            agents=agents,
        )
        out += split_batch(merged, max_rows)
    return out


def split_batch(batch: HeartbeatBatch, max_rows: int) -> list[HeartbeatBatch]:
    """``batch`` as batches of at most ``max_rows`` rows (sparse fields with the first part that names the worker)."""
    n = len(batch.worker)
    if n <= max_rows:
        return [batch]
    out = []
    echoes, agents = list(batch.echoes), list(batch.agents)
    for lo in range(0, n, max_rows):
        hi = min(n, lo + max_rows)
        here = set(batch.worker[lo:hi])
        out.append(
            HeartbeatBatch(
                job=batch.job,
                tenant=batch.tenant,
                shard=batch.shard,
                shard_workers=batch.shard_workers,
                host=batch.host,
                worker=batch.worker[lo:hi],
                step=batch.step[lo:hi],
                step_time_s=batch.step_time_s[lo:hi],
                sent_at=batch.sent_at[lo:hi],
                final=[i - lo for i in batch.final if lo <= i < hi],
                echoes=[e for e in echoes if e.worker in here],
                agents=[a for a in agents if a.worker in here],
            )
        )
        echoes = [e for e in echoes if e.worker not in here]
        agents = [a for a in agents if a.worker not in here]
    return out


def heartbeat_frames(batches: Iterable[HeartbeatBatch], max_bytes: int = MAX_DATAGRAM) -> list[bytes]:
    """Frames of ``batches``, each at most ``max_bytes`` (a batch too large is split in halves until it fits)."""
    out = []
    todo = deque(batches)
    while todo:
        b = todo.popleft()
        data = frame(HEARTBEATS, encode(b))
        if len(data) <= max_bytes or len(b.worker) <= 1:
            out.append(data)
        else:
            todo.extendleft(reversed(split_batch(b, (len(b.worker) + 1) // 2)))
    return out


# --------------------------------------------------------------------------- the relay (local rank 0)


@dataclass
class RelayCounters:
    batches_in: int = 0  # heartbeat batches handed over
    rows_in: int = 0  # heartbeats handed over
    dropped_rows: int = 0  # pending rows over the bound, dropped
    bad_frames: int = 0  # datagrams that were not frames, or held no valid record
    control_out: int = 0  # control records forwarded (one per agent)
    control_failed: int = 0  # forwards an agent could not take


class Relay:
    """Gathers the heartbeats the host's other agents hand over and forwards control records to them."""

    def __init__(self, directory: Path, *, pending_rows_max: int = PENDING_ROWS_MAX):
        _private_dir(directory)
        self.directory = directory
        self.path = directory / RELAY_SOCKET
        self._sock = _bind(self.path)
        self._sock.setblocking(False)
        self._inode = self.path.stat().st_ino  # to remove only our own socket (a later relay may bind the path)
        self._pending_rows_max = pending_rows_max
        self._pending: deque[HeartbeatBatch] = deque()
        self._pending_rows = 0
        self._lock = threading.Lock()
        self._peers: dict[str, float] = {}  # agent socket path -> when last heard from (monotonic)
        self.counters = RelayCounters()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-agent-relay", daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        log.debug("host relay listening on %s", self.path)
        return self

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def take(self) -> list[HeartbeatBatch]:
        """The heartbeat batches handed over since the last call."""
        with self._lock:
            out, self._pending, self._pending_rows = list(self._pending), deque(), 0
        return out

    def fan_out(self, records: Iterable[ControlRecord]) -> None:
        """Forward control records to every agent heard from (a full or gone agent is skipped, never waited for)."""
        frames = [frame(CONTROL, encode(r)) for r in records]
        for peer in self.peers:
            for data in frames:
                if not self._send(data, peer):
                    self.counters.control_failed += 1
                    break
                self.counters.control_out += 1

    def _send(self, data: bytes, peer: str) -> bool:
        try:
            self._sock.sendto(data, socket.MSG_DONTWAIT, peer)
            return True
        except (FileNotFoundError, ConnectionRefusedError):
            self._peers.pop(peer, None)  # that agent ended
        except OSError:
            pass  # its queue is full: it is stalled; it hears from us next time
        return False

    def _run(self) -> None:
        interval = HOUSEKEEPING_S
        next_round = 0.0
        while not self._stop.is_set():
            try:
                select.select([self._sock], [], [], max(0.0, next_round - time.monotonic()))
                self._drain()
            except Exception:  # a bug here must not end the relay's thread (the agents' hand-overs would pile up)
                if self._stop.is_set():
                    return
                log.exception("host relay: receiving failed; continuing")
                time.sleep(interval)
            now = time.monotonic()
            if now >= next_round:
                next_round = now + interval
                for peer_path, seen in list(self._peers.items()):
                    if now - seen > PEER_FORGET_S:
                        self._peers.pop(peer_path, None)

    def _drain(self, answer: bool = True) -> None:
        """Take every datagram waiting (never waits: the socket is non-blocking)."""
        while True:
            try:
                data, peer = self._sock.recvfrom(MAX_DATAGRAM + HEADER)
            except BlockingIOError:
                return
            self._take_datagram(data, peer if answer else None)

    def _take_datagram(self, data: bytes, peer: str | None) -> None:
        if not data:
            return  # close()'s wake-up
        try:
            kind, payload = parse_frame(data)
            batch = decode(payload, HeartbeatBatch) if kind == HEARTBEATS else None
        except (FrameError, RecordError) as exc:
            self.counters.bad_frames += 1
            log.debug("host relay: ignoring a datagram: %s", exc)
            return
        if peer:
            new = peer not in self._peers
            self._peers[peer] = time.monotonic()
            if new or kind == HELLO:
                self._send(frame(ALIVE), peer)  # a hello is answered at once
        if batch is None:
            return
        rows = len(batch.worker)
        with self._lock:
            self._pending.append(batch)
            self._pending_rows += rows
            while self._pending_rows > self._pending_rows_max and len(self._pending) > 1:
                old = self._pending.popleft()
                self._pending_rows -= len(old.worker)
                self.counters.dropped_rows += len(old.worker)
        self.counters.batches_in += 1
        self.counters.rows_in += rows

    def close(self) -> None:
        """Stop taking hand-overs (the socket is removed first, so that agents fall back at once), then keep what
        had arrived for the last :meth:`take`."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
            wake.sendto(b"", str(self.path))  # the thread's wait ends now, not at its next ping
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        if self._thread.is_alive():
            self._thread.join(timeout=HOUSEKEEPING_S + 2.0)
        with contextlib.suppress(OSError):
            self._drain(answer=False)
        self._sock.close()


# --------------------------------------------------------------------------- an agent's link to it (other local ranks)


class RelayLink:
    """An agent's end: hands heartbeats to the relay, receives control records and pings from it."""

    def __init__(self, directory: Path, *, join_s: float = 3.0, retry_s: float = 5.0):
        _private_dir(directory)
        self.relay_path = str(directory / RELAY_SOCKET)
        self.path = directory / f"agent-{os.getpid()}-{next(_LINKS)}.sock"
        self._sock = _bind(self.path)
        self._sock.setblocking(False)
        self._retry_s = retry_s
        self._backoff_s = FIRST_RETRY_S  # hello again after this long; doubles up to retry_s
        self.handed = 0  # heartbeat batches handed over
        self.fallbacks = 0  # times the agent went its own way
        self.bad_frames = 0
        self._closed = False
        # a hello the relay's socket takes: handing over from the first flush on; else wait ``join_s`` for a relay
        self.relayed = True  # the relay takes our heartbeats and sends us control records
        self._next_hello = 0.0
        self._joining_until = 0.0  # a relay that starts a little later is waited for until then (monotonic)
        self._held: list[HeartbeatBatch] = []  # heartbeats kept for it meanwhile
        self._held_rows = 0
        self._hello_ok = self._send(frame(HELLO))  # only a relay our last hello reached is taken back
        if not self._hello_ok:
            self.relayed = False
            self._joining_until = time.monotonic() + join_s
            self._next_hello = time.monotonic() + self._backoff_s

    @property
    def joining(self) -> bool:
        """Whether the agent still waits for a relay that was not there when it started (it keeps its heartbeats)."""
        return not self.relayed and time.monotonic() < self._joining_until

    def leave(self) -> None:
        """Wait for the relay no longer (the agent closes): what was kept for it goes with the next hand-over."""
        self._joining_until = 0.0

    def hand_over(self, batches: list[HeartbeatBatch]) -> list[HeartbeatBatch]:
        """Hand ``batches`` to the relay; returns those it could not take (the agent sends them itself)."""
        if self._held:
            batches, self._held, self._held_rows = [*self._held, *batches], [], 0
        if not self.relayed:
            if self.joining and self._held_rows + sum(len(b.worker) for b in batches) <= HELD_ROWS_MAX:
                self._held, self._held_rows = batches, sum(len(b.worker) for b in batches)
                return []
            if self._joining_until:
                self._joining_until = 0.0
                log.debug("no host relay at %s: this agent sends to Kafka itself until one answers", self.relay_path)
            return batches
        for i, b in enumerate(batches):
            for data in heartbeat_frames([b]):
                if not self._send(data):
                    self._fall_back("the relay does not take hand-overs")
                    return batches[i:]  # a batch partly handed over goes again whole: at-least-once
            self.handed += 1
        return []

    def _send(self, data: bytes) -> bool:
        try:
            self._sock.sendto(data, self.relay_path)
        except UNREACHABLE:
            return False
        except OSError as exc:  # anything else too: the agent sends itself rather than lose a flush
            if exc.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED, errno.ENOENT):
                log.warning("relay link: cannot send to %s: %s", self.relay_path, exc)
            return False
        return True

    def _fall_back(self, why: str) -> None:
        if self.relayed:
            self.fallbacks += 1
            log.warning("host relay lost (%s): this agent sends to Kafka itself", why)
        self.relayed = False
        self._hello_ok = False  # a ping the relay sent before it ended, read now, does not bring it back
        self._joining_until = 0.0
        self._backoff_s = FIRST_RETRY_S
        self._next_hello = time.monotonic() + self._backoff_s

    def poll(self, timeout_s: float = 0.0) -> list[ControlRecord]:
        """Control records the relay forwarded, waiting up to ``timeout_s`` for the first (only while relayed or
        joining; else at once: the agent then waits on the control topic).  A ping does not end the wait (the
        publishing thread wakes once per flush interval, as without relay).  Says hello every ``retry_s`` while
        not relayed, and notices a relay that went silent."""
        now = time.monotonic()
        if not self.relayed and now >= self._next_hello:
            self._backoff_s = min(self._retry_s, 2 * self._backoff_s)
            self._next_hello = now + self._backoff_s
            self._hello_ok = self._send(frame(HELLO))
        out = self._read()
        deadline = now + timeout_s
        while not out and (self.relayed or self.joining):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                select.select([self._sock], [], [], left)
            except (OSError, ValueError):
                break
            out = self._read()
        return out

    def _read(self) -> list[ControlRecord]:
        out: list[ControlRecord] = []
        while not self._closed:
            try:
                data = self._sock.recv(MAX_DATAGRAM + HEADER)
            except OSError:
                break
            try:
                kind, payload = parse_frame(data)
                rec = decode(payload, (ProfileTrigger, RawRequest)) if kind == CONTROL else None
            except (FrameError, RecordError) as exc:
                self.bad_frames += 1
                log.debug("relay link: ignoring a datagram: %s", exc)
                continue
            if not self.relayed and self._hello_ok:
                self.relayed, self._joining_until = True, 0.0
                log.debug("handing heartbeats to the host relay %s", self.relay_path)
            if rec is not None:
                out.append(rec)
        return out

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
