"""A small data-parallel JAX job on the CPU, one process of several (``jax.distributed``, Gloo collectives).

Each process trains a replicated weight matrix on its shard of the batch; the gradient's all-reduce is XLA's.  From
step ``FAULT_AT`` on, process ``SLOW_RANK`` (none: -1) spends ``SLOW_MS`` more per step in the host function
``preprocess`` (a ``jax.profiler.TraceAnnotation``) that every process runs in 4 ms.

``MODE=trace``: steps ``TRACE_FROM`` .. ``TRACE_FROM + TRACE_STEPS - 1`` are profiled with ``jax.profiler.trace``
into ``OUT_DIR/rank<i>`` (a ``StepTraceAnnotation`` per step), then the job ends.  ``MODE=live``: the Lockstep agent
is attached (``attach(job=JOB)``, settings from ``LOCKSTEP_*`` variables) and the job trains until ``STOP_FILE``
exists or ``MAX_STEPS``; process 0 writes each step's end time to ``OUT_DIR/steps.txt``.

Started as ``python jax_job.py <process id> <processes> <coordinator host:port>``.
"""

import os
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402 - after the collectives are chosen
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MODE = os.environ.get("MODE", "trace")
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "30"))
FAULT_AT = int(os.environ.get("FAULT_AT", "0"))
OUT_DIR = Path(os.environ["OUT_DIR"])
STOP_FILE = Path(os.environ.get("STOP_FILE", OUT_DIR / "stop"))
MAX_STEPS = int(os.environ.get("MAX_STEPS", "3000"))
TRACE_FROM = int(os.environ.get("TRACE_FROM", "3"))
TRACE_STEPS = int(os.environ.get("TRACE_STEPS", "6"))


def preprocess(rng: np.random.Generator, slow: bool) -> np.ndarray:
    with jax.profiler.TraceAnnotation("preprocess"):
        time.sleep((4 + (SLOW_MS if slow else 0)) / 1000)
        return rng.standard_normal((16, 64)).astype(np.float32)


def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def main() -> int:
    pid, n, coordinator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    batch = NamedSharding(mesh, P("d"))
    w = jax.device_put(jnp.eye(64, dtype=jnp.float32), NamedSharding(mesh, P()))

    @jax.jit
    def train_step(w, x, stop):
        g = jax.grad(loss)(w, x)
        return w - 0.01 * g, jnp.max(stop)  # every process sees every process's stop flag: all stop at one step

    agent = None
    if MODE == "live":
        from lockstep.producers.agent import attach

        agent = attach(job=os.environ["JOB"])
    rng = np.random.default_rng(pid)
    log = open(OUT_DIR / "steps.txt", "w") if pid == 0 and MODE == "live" else None  # noqa: SIM115
    steps = MAX_STEPS if MODE == "live" else TRACE_FROM + TRACE_STEPS
    step = 0
    tracing = False
    while step < steps:
        if MODE == "trace" and step == TRACE_FROM:
            jax.profiler.start_trace(str(OUT_DIR / f"rank{pid}"), create_perfetto_trace=True)
            tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            xl = preprocess(rng, pid == SLOW_RANK and step >= FAULT_AT)
            x = jax.make_array_from_process_local_data(batch, xl)
            stop = jax.make_array_from_process_local_data(batch, np.array([float(STOP_FILE.exists())], np.float32))
            w, stopped = train_step(w, x, stop)
            stopped = float(stopped)  # waits for the step's result
        time.sleep(0.01)
        if log is not None:
            log.write(f"{step} {time.time():.3f}\n")
            log.flush()
        if agent is not None:
            agent.step()
        step += 1
        if stopped:
            break
    if tracing:
        jax.profiler.stop_trace()
    if log is not None:
        log.close()
    if agent is not None:
        agent.close()
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
