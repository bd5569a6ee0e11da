"""The agent's JAX window on a real (single-process, CPU) JAX computation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.producers.agent.jaxprof import STEP_NAME, JaxWindow, jax_identity, jax_kind
from lockstep.producers.agent.profiler import ProfilerBusy
from lockstep.schemas.records import Sampling

pytestmark = pytest.mark.slow


@pytest.fixture
def jax():
    """JAX, imported in the test (never at collection: DEVELOPING.md)."""
    return pytest.importorskip("jax", reason="JAX is not installed (pip install -e '.[jax]')")


def work(jax, n: int) -> None:
    import jax.numpy as jnp

    f = jax.jit(lambda a: jnp.tanh(a @ a))
    for _ in range(n):
        with jax.profiler.TraceAnnotation("preprocess"):
            a = jnp.ones((32, 32))
        f(a).block_until_ready()


def test_a_window_carries_the_agents_step_numbers_and_the_users_regions(jax, tmp_path: Path):
    kind = jax_kind()
    window = kind.window(Sampling())
    window.start(40)
    for _ in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=999):  # the user's own step annotations are not steps
            work(jax, 1)
        window.step()  # the boundary into steps 41, 42, 43
    work(jax, 1)
    folder = window.stop()
    raw = kind.export(folder, tmp_path / "w.json")
    assert raw and not folder.exists()  # the profiler's folder is removed once the trace is taken
    te = kind.read(tmp_path / "w.json", worker=5)
    assert sorted(te.step_bounds) == [40, 41, 42, 43] and te.worker == 5
    functions = set(te.events.column("function").to_pylist())
    assert "preprocess" in functions
    assert any(f.startswith("jit_") for f in functions), functions  # XLA's ops, by module and op
    assert STEP_NAME not in functions


def test_a_window_is_refused_while_another_jax_profile_runs(jax, tmp_path: Path):
    jax.profiler.start_trace(str(tmp_path / "user"))
    try:
        with pytest.raises(ProfilerBusy):
            JaxWindow(Sampling()).start(0)
    finally:
        jax.profiler.stop_trace()


def test_identity_is_left_to_the_launcher_before_jax_distributed_starts(jax):
    assert not jax.distributed.is_initialized()
    assert jax_identity({"job": "j"}) == {"job": "j"}  # rank and world then come from RANK, SLURM_PROCID, ...


def test_a_jax_process_does_not_import_torch_for_the_agent(jax):
    """The hang trackers look for torch only where the process uses it: a JAX job's agent never loads it."""
    code = (
        "import sys, jax\n"
        "from lockstep.producers.agent.hang import CollectiveTracker, RegionTracker\n"
        "CollectiveTracker().install(); RegionTracker(0).install()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
