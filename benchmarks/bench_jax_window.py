"""What a JAX profiling window costs the training thread (one process, CPU JAX; medians of 3; prints what it measured).

    python benchmarks/bench_jax_window.py [--steps 10 50] [--repeat 3]

Each step: a 5 ms host region (``TraceAnnotation``) and a jitted 64x64 matmul + tanh.  Measured: ``start`` and
``stop`` of the window on the training thread (``jax.profiler.start_trace`` / ``stop_trace``, which collects and
writes the trace there), and on the agent's window thread the export, read and summary of the trace.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from lockstep.producers.agent.jaxprof import jax_kind
    from lockstep.producers.agent.summarise import summarise
    from lockstep.schemas.records import Sampling

    f = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((64, 64))
    f(a).block_until_ready()
    kind = jax_kind()
    out = Path(tempfile.mkdtemp(prefix="bench-jax-"))
    for steps in args.steps:
        start, stop, after, size = [], [], [], 0
        for _ in range(args.repeat):
            window = kind.window(Sampling())
            t = time.perf_counter()
            window.start(0)
            start.append(time.perf_counter() - t)
            for _ in range(steps):
                with jax.profiler.TraceAnnotation("preprocess"):
                    time.sleep(0.005)
                f(a).block_until_ready()
                window.step()
            t = time.perf_counter()
            folder = window.stop()
            stop.append(time.perf_counter() - t)
            t = time.perf_counter()
            raw = kind.export(folder, out / "w.json")
            te = kind.read(out / "w.json", worker=0)
            summarise(te.events, None, te.step_bounds)
            after.append(time.perf_counter() - t)
            size = len(raw)
        print(
            f"{steps:3d}-step window: start {statistics.median(start) * 1e3:.1f} ms, "
            f"stop {statistics.median(stop) * 1e3:.1f} ms (training thread); "
            f"export + read + summarise {statistics.median(after) * 1e3:.0f} ms (window thread); trace {size / 1e3:.0f} kB"
        )


if __name__ == "__main__":
    main()
