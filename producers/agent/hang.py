"""Where a stuck worker is: the agent's answer to a hang window's trigger (a ``HangReport``).

A hang trigger (``ProfileTrigger`` of kind ``hang``) reaches an agent whose training thread is stuck, so it
is answered on the agent's own thread (the one that follows the control topic), from what costs nothing while
the job runs:

- the last step the training thread completed (the agent counts steps anyway);
- the training thread's Python stack, read once with ``sys._current_frames()`` when the trigger comes;
- the innermost ``record_function`` region open on the training thread: :class:`RegionTracker` keeps the open
  regions of that one thread (a list append and pop per region, beside the profiler op ``record_function``
  already runs);
- the last ``torch.distributed`` collective this process entered and whether it returned: :class:`CollectiveTracker`
  wraps the module's collective functions with a counter update per call (sequence number per process group).

The Python thread of the agent runs while the training thread is stuck in C (a sleep, a socket, a collective: the
GIL is released) and while it loops in Python (the interpreter hands the GIL over every ``sys.getswitchinterval()``).
A training thread stuck in C code that holds the GIL stops the agent's Python thread too: that worker does not
answer, which the processor reads as such (:mod:`lockstep.streams.diagnosis.hang`).  What happens below Python
(a device kernel, NCCL's own threads) shows as the Python frame and collective the thread waits in.

Collectives that the framework calls from C++ (DDP's gradient all-reduce in its reducer) do not go through the
Python functions and are not counted; the stack still shows where the training thread waits (``backward``).
Functions a user imported by name (``from torch.distributed import all_reduce``) before the agent attached keep
the unwrapped function.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from types import FrameType
from typing import Any, cast

from ...schemas.records import MAX_HANG_FRAMES, MAX_HANG_REPORT_BYTES, HangReport, ProfileTrigger, WorkerMeta, encode
from .redact import Redaction
from .relay import _private_dir

log = logging.getLogger("lockstep.agent")

#: the torch.distributed functions counted as collectives (and point-to-point calls), where torch has them
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "monitored_barrier",
)
#: regions a RegionTracker keeps open at most (deeper nesting is not followed)
MAX_OPEN_REGIONS = 256
#: attribute set on a wrapped function (so that a second agent in one process does not wrap twice)
_WRAPPED = "__lockstep_collective__"


class CollectiveTracker:
    """The last collective this process entered: a counter update per call, read only when a hang trigger comes.

    ``seq`` counts the calls per process group (``None``: the default group), so ranks that run the same collectives
    on a group have the same numbers there; ``open`` is true between a call's entry and its return (for an
    ``async_op`` call, until it returned its work handle)."""

    def __init__(self) -> None:
        self.name = ""
        self.group: object = None
        self.seq = 0
        self.open = False
        self.counts: dict[object, int] = {}
        self.installed: list[str] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        counts = self.counts

        @wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            seq = counts[group] = counts.get(group, 0) + 1
            self.name, self.group, self.seq, self.open = name, group, seq, True
            try:
                return fn(*args, **kwargs)
            finally:
                self.open = False

        setattr(collective, _WRAPPED, self)
        return collective

    def install(self) -> CollectiveTracker:
        """Wrap ``torch.distributed``'s collectives (in ``torch.distributed`` and ``distributed_c10d``) and return the
        tracker that counts them: this one, or the one a first agent of this process installed."""
        try:
            import torch.distributed as dist
            import torch.distributed.distributed_c10d as c10d
        except Exception as exc:  # no torch.distributed in this build: nothing to track
            log.info("no torch.distributed to track collectives in (%s)", exc)
            return self
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or not callable(fn):
                continue
            first = getattr(fn, _WRAPPED, None)
            if first is not None:  # wrapped already, by a first agent of this process: it counts
                return cast(CollectiveTracker, first)
            wrapped = self.wrap(name, fn)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is fn:
                setattr(c10d, name, wrapped)
            self.installed.append(name)
        return self

    def group_name(self) -> str:
        """The last collective's process group, by name (``default``: the default group)."""
        g = self.group
        if g is None:
            return "default"
        try:
            import torch.distributed.distributed_c10d as c10d

            return str(c10d._get_process_group_name(g))  # type: ignore[arg-type]
        except Exception:
            return type(g).__name__


class RegionTracker:
    """The ``record_function`` regions open on one thread (the training thread), innermost last."""

    def __init__(self, thread_ident: int) -> None:
        self.ident = thread_ident
        self.open: list[Any] = []

    def install(self) -> RegionTracker:
        """Patch ``torch.autograd.profiler.record_function``'s ``__enter__``/``__exit__`` (once per process)."""
        try:
            from torch.autograd import profiler
        except Exception as exc:
            log.info("no torch profiler to track regions in (%s)", exc)
            return self
        cls = profiler.record_function
        first = getattr(cls, _WRAPPED, None)
        if first is not None:  # patched by a first agent of this process: it follows this agent's thread from now on
            first.ident = self.ident
            first.open.clear()
            return cast(RegionTracker, first)
        enter, exit_ = cls.__enter__, cls.__exit__
        open_ = self.open
        get_ident = threading.get_ident

        def __enter__(rf):
            out = enter(rf)
            if get_ident() == self.ident and len(open_) < MAX_OPEN_REGIONS:  # bounded: an exit elsewhere leaks none
                open_.append(rf)
            return out

        def __exit__(rf, *exc):
            if open_ and open_[-1] is rf:
                open_.pop()
            return exit_(rf, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__  # type: ignore[method-assign]
        setattr(cls, _WRAPPED, self)
        return self

    def innermost(self) -> str:
        rf = self.open[-1] if self.open else None
        return str(getattr(rf, "name", "")) if rf is not None else ""


def frame_name(frame: FrameType) -> str:
    """``file.py(line): function``, the profiler's name for a Python function (the path as it is; redact it)."""
    code = frame.f_code
    return f"{code.co_filename}({frame.f_lineno}): {code.co_name}"


def thread_stack(thread_ident: int, limit: int = MAX_HANG_FRAMES) -> list[str] | None:
    """The thread's Python frames, innermost first (at most ``limit``); None when no such thread runs."""
    frame = sys._current_frames().get(thread_ident)
    if frame is None:
        return None
    out: list[str] = []
    f: FrameType | None = frame
    while f is not None and len(out) < limit:
        out.append(frame_name(f))
        f = f.f_back
    return out


def host_workers(rank: int, local_rank: int, env: dict[str, str] | None = None) -> list[int]:
    """The ranks on this worker's host as a launcher that numbers hosts' ranks contiguously says (torchrun's
    ``LOCAL_WORLD_SIZE``); [] when it does not say."""
    env = dict(os.environ) if env is None else env
    try:
        n = int(env.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return []
    first = rank - local_rank
    return list(range(first, first + n)) if n > 0 and first >= 0 and local_rank < n else []


class ProcessRegistry:
    """The workers of one run on one host, by process: each agent writes ``<rank>.pid`` (its pid and start time) when
    it attaches and removes it when it closes, once; at a hang trigger, an agent reads its host's others to tell which
    exited (a process gone, or a zombie, with its file left: it never closed)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def register(self, rank: int, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        _private_dir(self.dir.parent)  # the host's run directory: this user's alone, as the relay makes it
        self.dir.mkdir(mode=0o700, exist_ok=True)
        tmp = self.dir / f".{rank}.pid.tmp"
        tmp.write_text(f"{pid} {_start_time(pid)}\n")
        tmp.replace(self.dir / f"{rank}.pid")

    def unregister(self, rank: int) -> None:
        with contextlib.suppress(OSError):
            (self.dir / f"{rank}.pid").unlink()

    def exited(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` registered here whose process is no longer running."""
        return [rank for rank, _ in self.exited_pids(ranks)]

    def exited_pids(self, ranks: list[int]) -> list[tuple[int, int]]:
        """(rank, pid) of those of ``ranks`` registered here whose process is no longer running."""
        out = []
        for rank in ranks:
            try:
                pid_s, start = (self.dir / f"{rank}.pid").read_text().split()
            except (OSError, ValueError):
                continue  # never registered (no agent yet), or closed
            pid = int(pid_s)
            now = _start_time(pid)
            if now is None or str(now) != start:
                out.append((rank, pid))
        return out


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot) while it runs; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


class HangResponder:
    """Answers hang triggers for one agent: built at attach (it installs the trackers), asked on the agent's thread."""

    def __init__(
        self,
        meta: WorkerMeta,
        redact: Redaction,
        tenant: str = "",
        *,
        thread_ident: int | None = None,
        registry: ProcessRegistry | None = None,
    ):
        self.meta = meta
        self.registry = registry
        self.redact = redact
        self.tenant = tenant
        self.ident = threading.get_ident() if thread_ident is None else thread_ident
        self.collectives = CollectiveTracker().install()
        self.regions = RegionTracker(self.ident).install()
        self.host_workers = host_workers(meta.rank, meta.local_rank)
        if registry is not None:
            try:
                registry.register(meta.rank)
            except OSError as exc:
                log.warning("could not register this worker in %s (%s)", registry.dir, exc)
                self.registry = None
        self.answered: set[str] = set()  # windows answered (a trigger seen twice is answered once)

    def answer(self, trig: ProfileTrigger, last_step: int) -> HangReport | None:
        """The report for a hang trigger (None: not a hang trigger, or answered already)."""
        if trig.kind != "hang" or trig.window in self.answered:
            return None
        self.answered.add(trig.window)
        return self.report(trig, last_step)

    def report(self, trig: ProfileTrigger, last_step: int) -> HangReport:
        stack = thread_stack(self.ident)
        r = self.redact
        frames = [r.name(f) for f in stack] if stack else []
        c = self.collectives
        rep = HangReport(
            job=trig.job,
            window=trig.window,
            worker=self.meta.rank,
            host=self.meta.host,
            expected_workers=trig.expected_workers,
            device=self.meta.device,
            tenant=self.tenant,
            last_step=max(-1, last_step),
            thread="found" if stack is not None else "gone",
            frame=frames[0] if frames else "",
            region=r.name(self.regions.innermost()) if self.regions.innermost() else "",
            stack=frames if r.stacks == "keep" else [],
            collective=c.name,
            collective_seq=c.seq,
            collective_group=c.group_name() if c.name else "",
            collective_open=c.open,
            host_workers=self.host_workers,
            exited=self._exited(),
            sent_at=time.time(),
        )
        return fit(rep)

    def _exited(self) -> list[int]:
        if self.registry is None:
            return []
        others = [w for w in self.host_workers if w != self.meta.rank]
        return self.registry.exited(others)

    def exit_report(self, job: str, world_size: int, last_step: int) -> HangReport | None:
        """When the agent closes: if workers of its host exited before it without closing (a crash, a kill), a report
        (``reason="exit"``) that names them, so that the first one is named even though no hang followed (the gloo
        backend fails its peers' collectives: they end rather than hang).  None otherwise."""
        if self.registry is None:
            return None
        gone = self.registry.exited_pids([w for w in self.host_workers if w != self.meta.rank])
        if not gone:
            return None
        rank, pid = min(gone)
        return HangReport(
            job=job,
            window=f"exit-r{rank}-p{pid}",
            worker=self.meta.rank,
            host=self.meta.host,
            expected_workers=max(1, world_size),
            device=self.meta.device,
            tenant=self.tenant,
            last_step=max(-1, last_step),
            thread="gone",
            host_workers=self.host_workers,
            exited=[r for r, _ in gone],
            sent_at=time.time(),
            reason="exit",
        )

    def close(self) -> None:
        if self.registry is not None:
            self.registry.unregister(self.meta.rank)


def fit(rep: HangReport, max_bytes: int = MAX_HANG_REPORT_BYTES) -> HangReport:
    """The report within ``max_bytes`` encoded: outer frames go first, then long names are cut."""
    while len(encode(rep)) > max_bytes and rep.stack:
        keep = max(0, len(rep.stack) // 2 if len(rep.stack) > 1 else 0)
        rep.stack = rep.stack[:keep]
        rep.truncated = True
    if len(encode(rep)) > max_bytes:
        rep.frame, rep.region, rep.collective_group = rep.frame[:512], rep.region[:512], rep.collective_group[:256]
        rep.host_workers = rep.host_workers[:64]
        rep.truncated = True
    return rep
