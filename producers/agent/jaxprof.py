"""The host agent in a JAX training loop: ``attach(job=...)`` and ``agent.step()`` as under PyTorch.

A window is ``jax.profiler.start_trace`` at the boundary into its first step and ``stop_trace`` at the boundary
after its last.  The agent marks each of the window's steps itself with a ``jax.profiler.StepTraceAnnotation``
named :data:`STEP_NAME` (opened at one ``step()`` call, closed at the next), so the trace's steps carry the job's
own step numbers whatever the training loop annotates.  The trace (``perfetto_trace.json.gz``) is read by
:func:`~lockstep.producers.agent.jaxtrace.read_jax_trace` and summarised into the same ``WindowFeatures``, with
the same hardware sampler, as a PyTorch window.

Who the worker is: explicit settings, else ``jax.process_index()`` / ``jax.process_count()`` once
``jax.distributed`` is initialised (a multi-process job), else the launcher's variables (Slurm, Open MPI,
torchrun's), as for PyTorch.

Unlike torch.profiler, ``stop_trace`` collects and writes the trace on the calling thread: the step that ends a
window waits for it (here, for a small single-process job: 4-7 ms for a 10-step window, 56 ms for 50 steps;
``benchmarks/bench_jax_window.py``).
"""

from __future__ import annotations

import gzip
import logging
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from ...schemas.records import Sampling
from .jaxtrace import PERFETTO_NAME, read_jax_trace
from .profiler import ProfilerBusy, ProfilerKind

log = logging.getLogger("lockstep.agent")

#: the name of the step annotations the agent writes into a window's trace
STEP_NAME = "lockstep.step"


class JaxWindow:
    """``jax.profiler`` for one step-aligned window (the interface of :class:`~.profiler.TorchWindow`)."""

    def __init__(self, sampling: Sampling):
        import jax

        self._jax = jax
        self._dir = Path(tempfile.mkdtemp(prefix="lockstep-jax-"))
        self._options = jax.profiler.ProfileOptions()
        self._options.python_tracer_level = 0  # every Python call of JAX's own tracing: the trace's bulk, no function
        self._options.host_tracer_level = 2  # the user's TraceAnnotations and XLA's runtime spans
        self._step: Any = None
        self._n = 0
        self.recording = False

    def start(self, step: int) -> None:
        try:
            self._jax.profiler.start_trace(str(self._dir), create_perfetto_trace=True, profiler_options=self._options)
        except RuntimeError as exc:  # "Profile has already been started": the user's own, or a leftover
            shutil.rmtree(self._dir, ignore_errors=True)
            raise ProfilerBusy(
                f"a JAX profiler is already recording in this process ({exc}); the window is skipped"
            ) from None
        self.recording = True
        self._open(step)

    def _open(self, step: int) -> None:
        self._n = step
        self._step = self._jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step)
        self._step.__enter__()

    def _close(self) -> None:
        if self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def step(self) -> None:
        """The boundary into the next step (the agent has counted it already)."""
        self._close()
        self._open(self._n + 1)

    def stop(self) -> Path:
        """End recording; returns the folder the trace is in (read and removed by :func:`export_jax_trace`)."""
        self._close()
        self.recording = False
        try:
            self._jax.profiler.stop_trace()
        except Exception:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        return self._dir


def export_jax_trace(folder: Path, path: Path) -> bytes:
    """Move the window's trace (``perfetto_trace.json.gz``, decompressed) to ``path``; returns its bytes."""
    try:
        found = sorted(Path(folder).glob(f"plugins/profile/*/{PERFETTO_NAME}"))
        if not found:
            raise FileNotFoundError(f"jax.profiler wrote no {PERFETTO_NAME} under {folder}")
        raw = gzip.decompress(found[-1].read_bytes())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        return raw
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def jax_kind() -> ProfilerKind:
    return ProfilerKind("jax", JaxWindow, export_jax_trace, partial(read_jax_trace, step_name=STEP_NAME))


def jax_identity(overrides: dict[str, Any]) -> dict[str, Any]:
    """Rank and world size from ``jax.process_index()`` / ``process_count()`` where the settings give none and
    ``jax.distributed`` is initialised.  Before that nothing of JAX is asked: a backend started now would make the
    job's own ``jax.distributed.initialize()`` fail; the launcher's variables say who the worker is then."""
    import jax

    if not jax.distributed.is_initialized():
        return overrides
    out = dict(overrides)
    if out.get("rank") is None:
        out["rank"] = jax.process_index()
    if out.get("world_size") is None:
        out["world_size"] = jax.process_count()
    return out
