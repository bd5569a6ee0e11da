"""torch.profiler for one step-aligned window, and nothing of it afterwards.

The profiler is created at the boundary into the window's first step with its
step counter set to that step, so the trace's ``ProfilerStep#N`` annotations carry
the job's own step numbers; ``step()`` marks each boundary inside the window; ``stop()``
ends recording and detaches every profiler hook.  Exporting the trace (slow) is left
to the caller's background thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...schemas.errors import LockstepError
from ...schemas.records import Sampling

log = logging.getLogger("lockstep.agent")


class ProfilerBusy(LockstepError, RuntimeError):
    """Another profiler (the user's own, or a leftover) is already recording in this process."""


def profiler_enabled() -> bool:
    """Is any autograd/Kineto profiler recording in this process?"""
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled())


class TorchWindow:
    def __init__(self, sampling: Sampling):
        import torch
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler.profiler import ProfilerAction

        if profiler_enabled():
            raise ProfilerBusy("a profiler is already recording in this process; the window is skipped")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=lambda _step: ProfilerAction.RECORD,  # a schedule makes the profiler annotate ProfilerStep#N
            record_shapes=sampling.record_shapes,
            with_stack=sampling.with_stack,
        )
        self.recording = False

    def start(self, step: int) -> None:
        self._prof.step_num = step
        self._prof.start()
        self.recording = True

    def step(self) -> None:
        self._prof.step()

    def stop(self):
        """End recording; returns the finished profiler, whose only use left is exporting its trace."""
        prof, self._prof = self._prof, None
        self.recording = False
        prof.stop()
        return prof


def export_trace(prof, path: Path) -> bytes:
    """Write the finished profiler's Chrome trace to ``path``; returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path.read_bytes()


@dataclass(frozen=True)
class ProfilerKind:
    """How the agent profiles a window in one framework: ``window(sampling)`` makes the window's profiler (``start``,
    ``step``, ``stop``, ``recording``), ``export(finished, path)`` writes what ``stop`` returned as a trace file and
    returns its bytes (the raw trace kept), ``read(path, worker)`` reads that file into op events."""

    name: str
    window: Callable[[Sampling], Any]
    export: Callable[[Any, Path], bytes]
    read: Callable[..., Any]


def torch_kind() -> ProfilerKind:
    from .trace import read_chrome_trace

    return ProfilerKind("torch", TorchWindow, export_trace, read_chrome_trace)
