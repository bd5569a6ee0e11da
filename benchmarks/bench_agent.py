"""Benchmarks of the host agent, one command each (CPU PyTorch; medians; prints what it measured).

    python benchmarks/bench_agent.py overhead    # agent cost when not profiling, % of a realistic step
    python benchmarks/bench_agent.py overhead --local-rank 1   # the same for an agent that hands its heartbeats
                                                 # to its host's relay (local rank 0's agent, another process)
    python benchmarks/bench_agent.py bytes       # bytes per worker per window vs the raw profiler trace
    python benchmarks/bench_agent.py summarise   # time to turn one window's trace into its feature record
    python benchmarks/bench_agent.py sampler     # hardware sampler at 1 and 10 kHz: achieved rate, CPU cost, training-step impact
    python benchmarks/bench_agent.py outage      # step time while Kafka is away, with agent.step() vs without (ABBA)
    python benchmarks/bench_agent.py connections # the TCP-connection snapshot a window takes twice: time, record bytes

The model is a transformer encoder (d_model 256, batch 4 x 32 tokens, AdamW): 8 layers, about
100 ms a step on this machine's CPU, for ``overhead`` and ``sampler``; 24 layers (the depth of
a mid-size language model, so the trace holds as many operators per step as a real one) for
``bytes`` and ``summarise``.  ``overhead`` starts the embedded broker: heartbeats really go to Kafka.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import torch
from torch import nn

from lockstep.broker import EmbeddedBroker
from lockstep.config import Settings
from lockstep.kafka import ensure_topics
from lockstep.producers.agent import attach
from lockstep.producers.agent.probe import Probe
from lockstep.producers.agent.profiler import TorchWindow
from lockstep.producers.agent.redact import Redaction
from lockstep.producers.agent.retention import RawStore
from lockstep.producers.agent.sampler import HardwareSampler
from lockstep.producers.agent.window import process_window, read_chrome_trace, summarise
from lockstep.schemas import functions as ft
from lockstep.schemas.records import ProfileTrigger, Sampling, WorkerMeta, encode


def model_step(layers: int = 8, d: int = 256, batch: int = 4, tokens: int = 32):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True), layers), nn.Linear(d, 16)
    )
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, tokens, d)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()  # warm-up
    return step


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU time of another thread (Linux: its pthread CPU clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def tasks_cpu_s(native_ids: frozenset[int]) -> dict[int, float]:
    """CPU seconds of this process's librdkafka threads (``rdk:*``) and of the given threads (/proc schedstat, ns)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if comm.startswith("rdk:") or int(tid) in native_ids:
                out[int(tid)] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError):
            pass  # the thread ended
    return out


def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


# --------------------------------------------------------------------------- overhead

#: the host's relay for ``overhead --local-rank N``: local rank 0's agent in a process of its own, stepping like
#: a training process (argv: bootstrap servers, relay directory, step seconds)
RELAY_HOST = """
import sys, time
from lockstep.producers.agent import attach
agent = attach(job="bench", bootstrap_servers=sys.argv[1], topic_prefix="bench", rank=0, local_rank=0, world_size=2,
               relay_dir=sys.argv[2], spool_dir=sys.argv[2] + "-spool")
while True:
    time.sleep(float(sys.argv[3]))
    agent.step()
"""


@contextlib.contextmanager
def relay_host(bootstrap: str, relay_dir: Path, step_s: float):
    proc = subprocess.Popen([sys.executable, "-c", RELAY_HOST, bootstrap, str(relay_dir), str(step_s)])
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def overhead(args) -> None:
    step = model_step()
    t_start = time.monotonic()
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        settings = Settings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="bench", partitions=1)
        ensure_topics(settings)
        relay_dir = Path(tmp) / "relay"
        identity = {}
        if args.local_rank:  # this process is a non-zero local rank: local rank 0's agent (the relay) runs beside it
            stack.enter_context(relay_host(broker.bootstrap_servers, relay_dir, 0.077))
            identity = {"rank": args.local_rank, "local_rank": args.local_rank, "world_size": 2, "relay_dir": relay_dir}
        ratios: list[float] = []  # per block pair: median step with the agent / median step without
        base: list[float] = []
        calls: list[float] = []
        io_cpu: list[float] = []  # the agent's publishing thread, per step
        bg_cpu_s = 0.0  # the agent's threads and its Kafka clients' (librdkafka) threads, over every agent block
        agent_wall_s = 0.0  # the measured steps' wall time, over every agent block
        kafka_clients = 0  # agent blocks that ended with a Kafka client of the agent's own (--local-rank)
        for block in range(args.blocks):
            medians = {}
            for mode in ("base", "agent") if block % 2 == 0 else ("agent", "base"):  # ABBA: drift cancels
                agent = (
                    attach(
                        job="bench",
                        bootstrap_servers=broker.bootstrap_servers,
                        topic_prefix="bench",
                        spool_dir=Path(tmp) / "spool",
                        **identity,
                    )
                    if mode == "agent"
                    else None
                )
                for _ in range(
                    args.warmup
                ):  # not measured: the agent connects to Kafka and reads the control topic's end
                    step()
                    if agent is not None:
                        agent.step()
                if agent is not None:
                    # connected both ways before measuring: the control consumer at the topic's end, and the producer
                    # past its first delivery (its connection, metadata and first batch are start-up, not per-step cost)
                    # with a relay: handing over to it, which answers (and no Kafka client of its own)
                    while (
                        (not agent._control.connected or agent._outbox.counters.sent == 0)
                        if not args.local_rank
                        else (agent.relay_role != "relayed" or agent.report().handed_over == 0)
                    ):
                        step()
                        agent.step()
                    io0 = thread_cpu_s(agent._outbox._thread)
                    own = frozenset(agent._own_threads)
                    bg0 = tasks_cpu_s(own)
                times = []
                for _ in range(args.steps):
                    s0 = time.perf_counter()
                    step()
                    if agent is not None:
                        c0 = time.perf_counter()
                        agent.step()
                        calls.append(time.perf_counter() - c0)
                    times.append(time.perf_counter() - s0)
                if agent is not None:
                    if args.local_rank:
                        assert agent.relay_role == "relayed", "the relay stopped answering during the block"
                        kafka_clients += agent._outbox.connected or agent._control.connected
                    io_cpu.append((thread_cpu_s(agent._outbox._thread) - io0) / args.steps)
                    bg_cpu_s += sum(v - bg0.get(t, 0.0) for t, v in tasks_cpu_s(own).items())
                    agent_wall_s += sum(times)
                    agent.close()
                else:
                    base += times
                medians[mode] = statistics.median(times)
            ratios.append(medians["agent"] / medians["base"])
    mb = statistics.median(base)
    call, io = statistics.median(calls), statistics.median(io_cpu)
    bg = bg_cpu_s / (args.blocks * args.steps)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"agent overhead when not profiling: {args.blocks} blocks x {args.steps} steps per mode (after {args.warmup} unmeasured), "
        f"alternating (ABBA), same process, heartbeats to the embedded broker ({time.monotonic() - t_start:.0f} s)"
    )
    if args.local_rank:
        print(
            f"  measured: an agent of local rank {args.local_rank}, handing its heartbeats to its host's relay (local rank 0's "
            f"agent, another process); blocks that ended with a Kafka client of its own: {kafka_clients}"
        )
    print(f"  step: 8-layer transformer, median {1e3 * mb:.1f} ms without the agent")
    print(
        f"  wall clock: median step with / without the agent, per block pair: {statistics.median(ratios):.4f} "
        f"(quartiles {q[0]:.4f}..{q[2]:.4f}; this machine's step-to-step noise is larger than the effect)"
    )
    print(f"  agent.step() in the training thread: median {1e6 * call:.1f} us = {pct(call / mb)} of the step")
    print(
        f"  publishing thread CPU per step (batching, encoding, Kafka, control polling): {1e6 * io:.1f} us = {pct(io / mb)}"
    )
    print(
        f"  all background threads of the agent per step (publishing thread + librdkafka's): {1e6 * bg:.1f} us = {pct(bg / mb)}"
    )
    cost = call + max(bg, io)
    # the background threads wake on the clock (flushes, pings, librdkafka's timers), not per step: their CPU per
    # second of training, at a 74 ms step, is what the target means when this machine's step is not 74 ms
    rate = bg_cpu_s / agent_wall_s
    print(
        f"  background CPU per second of training: {1e3 * rate:.2f} ms/s; at a 74 ms step: {1e6 * (call + rate * 0.074):.0f} us"
        f" = {pct((call + rate * 0.074) / 0.074)} of the step (target <= 0.1%: {'met' if call + rate * 0.074 <= 74e-6 else 'NOT met'})"
    )
    print(
        f"  agent cost per step (training-thread call + background CPU): {1e6 * cost:.0f} us = {pct(cost / mb)} of the step;"
        f" {pct(cost / 0.074)} of a 74 ms step (target <= 0.1%: {'met' if cost <= 74e-6 else 'NOT met'})"
    )


# --------------------------------------------------------------------------- one profiled window


def profile_window(step, steps: int, sampling: Sampling, tmp: Path, rank: int = 0):
    """Profile ``steps`` steps exactly as the agent does; returns the finished profiler, samples and boundaries."""
    start = 100
    sampler = HardwareSampler(rank, sampling.hardware_hz).start()
    window = TorchWindow(sampling)
    boundaries = {start: time.time() * 1e6}
    window.start(start)
    for s in range(start, start + steps):
        step()
        if s + 1 < start + steps:
            boundaries[s + 1] = time.time() * 1e6
            window.step()
    prof = window.stop()
    samples, stats = sampler.stop()
    trig = ProfileTrigger(
        job="bench",
        window=f"w{time.monotonic_ns()}",
        start_step=start,
        steps=steps,
        expected_workers=1,
        sampling=sampling,
    )
    return prof, samples, boundaries, trig, stats


SETTINGS = {
    "default": Sampling(hardware_hz=100),  # what the detector asks for
    "with_stack+shapes": Sampling(
        hardware_hz=100, with_stack=True, record_shapes=True
    ),  # what people use to debug by hand
}


def bytes_(args) -> None:
    step = model_step(layers=args.layers)
    meta = WorkerMeta(rank=0, host="bench-host", device="bench-host/cpu", nic="eth0", labels={"pp": "0"})
    print(
        f"bytes per worker per window: {args.steps} steps of a {args.layers}-layer transformer, raw Chrome trace vs the record sent "
        f"(one WindowFeatures; before issue 13 one FeatureBatch per step, 26.7 KB default, 69.8 KB with stack+shapes)"
    )
    for name, sampling in SETTINGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            store = RawStore(Path(tmp), 1 << 34)
            prof, samples, boundaries, trig, _ = profile_window(step, args.steps, sampling, Path(tmp))
            out = process_window(
                prof, trig, meta, samples, boundaries, "host", Redaction(), store, min_share=args.min_share
            )
            kept = sum(p.stat().st_size for p in Path(tmp).glob("*.zst"))
        assert out.record is not None, "no step of the window was summarised"
        sent = len(encode(out.record))
        rows = ft.read_compact(out.record.functions).num_rows / len(out.record.steps)
        print(
            f"  {name:18s} raw trace {out.trace_bytes / 1e6:8.2f} MB ({out.events:6d} events kept by the reader; zstd {kept / 1e6:.2f} MB)"
            f" -> WindowFeatures {sent / 1e3:5.1f} KB for {len(out.record.steps)} steps ({rows:.0f} functions/step)"
            f" = {out.trace_bytes / sent:7.0f}x smaller"
            f" (targets: <= 10 KB: {'met' if sent <= 10_000 else 'NOT met'}; >= 1000x)"
        )


# --------------------------------------------------------------------------- summariser


def summarise_(args) -> None:
    step = model_step(layers=args.layers)
    meta = WorkerMeta(rank=0, host="bench-host")
    print(
        f"summariser per window ({args.steps} steps of a {args.layers}-layer transformer), median of {args.repeats} runs on one trace:"
    )
    for name, sampling in SETTINGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            store = RawStore(Path(tmp), 1 << 34)
            prof, samples, boundaries, trig, _ = profile_window(step, args.steps, sampling, Path(tmp))
            t0 = time.perf_counter()
            out = process_window(
                prof, trig, meta, samples, boundaries, "host", Redaction(), store, min_share=args.min_share
            )
            whole = time.perf_counter() - t0
            _, trace, _ = store.load()
            path = Path(tmp) / "trace.json"
            path.write_bytes(msgspec.json.encode(trace))
            read_s, summ_s = [], []
            for _ in range(args.repeats):
                t1 = time.perf_counter()
                te = read_chrome_trace(path, worker=0)  # from the file, as the agent reads it
                t2 = time.perf_counter()
                summarise(te.events, None, te.step_bounds, min_share=args.min_share)
                t3 = time.perf_counter()
                read_s.append(t2 - t1)
                summ_s.append(t3 - t2)
        print(
            f"  {name:18s} {out.trace_bytes / 1e6:6.2f} MB trace, {out.events} events: read {1e3 * statistics.median(read_s):7.1f} ms,"
            f" summarise {1e3 * statistics.median(summ_s):7.1f} ms; whole window on the agent's thread (export, parse,"
            f" read, summarise, pack, keep raw) {whole:.2f} s"
        )


# --------------------------------------------------------------------------- sampler


def python_step(n: int = 40_000):
    """A training step spent in Python (a data loader's collate, a tokenizer): holds the GIL throughout."""

    def step() -> None:
        d: dict[int, int] = {}
        for i in range(n):
            d[i & 1023] = i

    return step


def _block(step, seconds: float) -> list[float]:
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        s0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - s0)
    return times


def _sampled_block(mode: str, hz: float, step, seconds: float) -> tuple[list[float], float, float, float]:
    """Steps for ``seconds`` with the sampler in ``mode``; (step times, fast-tier Hz, /proc-tier Hz, sampler CPU share of a core)."""
    if mode == "none":
        return _block(step, seconds), 0.0, 0.0, 0.0
    if mode == "process":
        s = HardwareSampler(0, hz)
        s.wait_ready()
        s.start()
        times = _block(step, seconds)
        _, st = s.stop()
        return times, st.hz_achieved, st.tiers["slow"] / st.seconds, st.cpu_share
    # "thread": the same reads on a thread of the training process (what the sampler process avoids)
    p = Probe({"pid": os.getpid(), "hz": hz})
    t0, _ = p.run()
    cpu0 = thread_cpu_s(p.threads[0])
    times = _block(step, seconds)
    cpu = thread_cpu_s(p.threads[0]) - cpu0
    head = p.finish(t0, 0.0)
    return (
        times,
        head["tiers"]["fast"]["rows"] / head["seconds"],
        head["tiers"]["slow"]["rows"] / head["seconds"],
        cpu / head["seconds"],
    )


def sampler(args) -> None:
    steps = {"torch": model_step(), "python": python_step()}
    print(
        f"hardware sampler (host only on this machine, no GPU); blocks of {args.seconds:.1f} s, {args.repeats} x each mode in"
        f" rotating order; training steps: an 8-layer transformer on CPU (torch ops release the GIL) and a pure-Python step"
        f" (holds it); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    order = ("none", "process", "thread", "thread", "process", "none")
    for hz in args.hz:
        for kind, step in steps.items():
            ratios: dict[str, list[float]] = {
                "process": [],
                "thread": [],
            }  # per repeat: median step / median step without
            rates: dict[str, list[tuple[float, float, float]]] = {"process": [], "thread": []}
            base: list[float] = []
            for _ in range(args.repeats):
                times: dict[str, list[float]] = {m: [] for m in order}
                for mode in order:
                    t, fast, slow, cpu = _sampled_block(mode, hz, step, args.seconds)
                    times[mode] += t
                    if mode != "none":
                        rates[mode].append((fast, slow, cpu))
                b = statistics.median(times["none"])
                base.append(b)
                for mode in ratios:
                    ratios[mode].append(statistics.median(times[mode]) / b)
            for mode in ("process", "thread"):
                fast, slow, cpu = (statistics.median(r[i] for r in rates[mode]) for i in range(3))
                where = "sampler process" if mode == "process" else "thread in the training process"
                print(
                    f"  {hz:6.0f} Hz asked, {kind:6s} step ({1e3 * statistics.median(base):6.1f} ms), {where:31s}: achieved {fast:6.0f} Hz"
                    f" NIC + process CPU, {slow:4.0f} Hz /proc; sampler CPU {100 * cpu:5.1f}% of one core ({1e6 * cpu / max(fast, 1e-9):3.0f} us"
                    f" per reading); median step x{statistics.median(ratios[mode]):.3f} of without"
                )


# --------------------------------------------------------------------------- outage


def outage(args) -> None:
    """The outage test's loop (a small model's step plus a 4 ms wait, as for a GPU) while Kafka is away: blocks of
    steps with ``agent.step()`` against blocks of the same loop without it, interleaved ABBA in the same process
    (the machine's load drifts; a before/during comparison measured the drift, x0.96 to x1.6)."""
    from lockstep.broker import free_port

    logging.getLogger("lockstep.librdkafka").setLevel(
        logging.CRITICAL
    )  # the outage is the point: no line per reconnect
    logging.getLogger("lockstep.agent").setLevel(logging.ERROR)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run(agent, steps: int, calls: list[float]) -> float:
        """Median step time of ``steps`` steps; ``agent.step()`` after each unless ``agent`` is None."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(torch.randn(32, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.004)
            if agent is not None:
                t1 = time.perf_counter()
                agent.step()
                calls.append(time.perf_counter() - t1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    port = free_port()
    settings = Settings(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="bench-outage", partitions=1)
    broker = EmbeddedBroker(port=port).start()
    calls: list[float] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ensure_topics(settings)
            agent = attach(
                job="bench-outage",
                bootstrap_servers=settings.bootstrap_servers,
                topic_prefix=settings.topic_prefix,
                rank=0,
                world_size=1,
                host="h0",
                spool_dir=Path(tmp) / "spool",
                spool_max_bytes=256 << 10,
                delivery_timeout_s=1.0,
                flush_interval_s=0.05,
            )
            run(agent, args.steps, [])  # connected, warm
            broker.stop()
            run(agent, args.steps, [])  # until the agent has noticed and spools
            for block in range(args.blocks):
                medians = {}
                for mode in ("bare", "agent") if block % 2 == 0 else ("agent", "bare"):  # ABBA: drift cancels
                    medians[mode] = run(agent if mode == "agent" else None, args.steps, calls)
                ratios.append(medians["agent"] / medians["bare"])
            spooling = agent.report().kafka_down
            agent.close()
        finally:
            broker.stop()
    calls.sort()
    print(
        f"training loop while Kafka is away (agent spooling: {spooling}), {args.blocks} block pairs of {args.steps} steps, ABBA:"
    )
    print(
        f"  step time with agent.step() / without: median x{statistics.median(ratios):.3f} (pairs x{min(ratios):.3f} to x{max(ratios):.3f})"
    )
    print(
        f"  agent.step(): p50 {statistics.median(calls) * 1e6:.0f} us, p99 {calls[int(0.99 * (len(calls) - 1))] * 1e6:.0f} us, "
        f"max {calls[-1] * 1e3:.2f} ms (wall clock, {len(calls)} calls)"
    )


def connections(args) -> None:
    """What reading the process's TCP connections costs the training thread (twice a window: ``tcpdiag.snapshot``)
    with N connected pairs of sockets open in this process (2N connections, and 2N more file descriptors), and what
    they add to the window's record (every connection sends between the two snapshots, so none is left out as idle)."""
    import socket

    import msgspec

    from lockstep.producers.agent import tcpdiag
    from lockstep.schemas.events import connection_records
    from lockstep.schemas.records import Connection

    print(f"tcpdiag.snapshot(): median of {args.repeats} calls; record bytes: msgpack of WindowFeatures.connections")
    for n in args.pairs:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(n)
        socks = []
        for _ in range(n):
            c = socket.create_connection(srv.getsockname())
            a, _ = srv.accept()
            socks += [c, a]
        before = tcpdiag.snapshot()
        for c in socks:
            c.send(b"x")  # every connection carries data in the window: all are kept
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            after = tcpdiag.snapshot()
            times.append(time.perf_counter() - t0)
        table = tcpdiag.connections(0, before, after)
        kept = connection_records(table) if table is not None else []
        size = len(msgspec.msgpack.encode(kept))
        print(
            f"  {2 * n:5d} connections: snapshot {statistics.median(times) * 1e3:6.2f} ms (min {min(times) * 1e3:.2f}), "
            f"{len(kept)} kept in the record ({size / 1024:.1f} KiB, {size / max(1, len(kept)):.0f} B each)"
        )
        assert all(isinstance(k, Connection) for k in kept)
        for x in socks:
            x.close()
        srv.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--blocks", type=int, default=8)
    o.add_argument("--steps", type=int, default=25, help="measured steps per block")
    o.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="steps per block before measuring, at least until the agent delivered a "
        "heartbeat (the agent's start-up is not per-step cost)",
    )
    o.add_argument(
        "--local-rank",
        type=int,
        default=0,
        help="0: an agent alone (as on a host of one rank); N > 0: an agent of local rank N beside its host's relay",
    )
    o.set_defaults(func=overhead)
    for name, func in (("bytes", bytes_), ("summarise", summarise_)):
        q = sub.add_parser(name)
        q.add_argument("--steps", type=int, default=8, help="steps per window")
        q.add_argument("--layers", type=int, default=24, help="transformer layers")
        q.add_argument("--min-share", type=float, default=0.001, help="the agent's size budget (AgentConfig.min_share)")
        q.add_argument("--repeats", type=int, default=5)
        q.set_defaults(func=func)
    s = sub.add_parser("sampler")
    s.add_argument("--hz", type=float, nargs="+", default=[1000, 10000])
    s.add_argument("--seconds", type=float, default=2.0, help="length of one block")
    s.add_argument("--repeats", type=int, default=2, help="blocks per mode and rate (in rotating order)")
    s.set_defaults(func=sampler)
    g = sub.add_parser("outage")
    g.add_argument("--blocks", type=int, default=8, help="block pairs while the broker is stopped")
    g.add_argument("--steps", type=int, default=150, help="steps per block")
    g.set_defaults(func=outage)
    c = sub.add_parser("connections")
    c.add_argument(
        "--pairs", type=int, nargs="+", default=[4, 64, 512], help="connected socket pairs (2 connections each)"
    )
    c.add_argument("--repeats", type=int, default=50)
    c.set_defaults(func=connections)
    args = p.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
