"""Structure-aware fuzzing of the processor's stages: valid records mutated, then run through the stages in memory.

Every record type that carries a binary payload is built valid by the fleet simulator (``WindowFeatures``,
``FeatureBatch``, ``StepSlice``, ``StepReport``, ``HeartbeatBatch``), then mutated where an attacker would aim:

- ``table``: bytes flipped inside the Arrow IPC stream of its table (sent uncompressed, so the flips reach Arrow);
- ``index``: a dictionary index of a name column set to a value outside its dictionary (negative, or past it);
- ``zstd``: bytes flipped inside the compressed payload;
- ``record``: bytes flipped in the encoded record itself (MessagePack/JSON framing);
- ``size``: a declared size (``functions_size``, ``window_steps``, ``expected_workers``, ``shard_workers``) set absurd.

Each mutated record goes to the stage that reads its topic *beside its window's valid records*, the stages are timed
out, and what they sent is fed on (a step slice to the step stage, a step report to the window stage): the stages run
on what survives decoding, not only the decoders.  The property: a mutated record decodes or becomes a dead letter with
a reason; the process never crashes; no stage hands a record to its bug path (``processing_failed``); memory stays
bounded.  A crash (a segfault in Arrow) ends the process, so run this in a subprocess and read its exit status
(``tests/adversarial/test_fuzz.py`` does).

    python scripts/fuzz.py --seconds 600 --seed 1     # the 10-minute run RELIABILITY.md quotes

Prints one JSON line: iterations, mutations by kind, dead letters by reason, bug-path records, peak RSS in MiB.
Exit 0 when the property held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable

import cramjam
import msgspec
import pyarrow as pa

from lockstep.kafka import Topics, features_key, heartbeat_key, window_features_key
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.fleet import FleetSimulator, Scenario, Window
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import (
    DeadLetter,
    FeatureBatch,
    HeartbeatBatch,
    Record,
    StepReport,
    StepSlice,
    WindowFeatures,
    batch_heartbeats,
    decode,
    encode,
)
from lockstep.streams.policy import Policy
from lockstep.streams.stages import MemoryOutput, Processor, Tables

TOPICS = Topics.named("fuzz")
MUTATIONS = ("table", "index", "zstd", "record", "size")


class Clock:
    def __init__(self) -> None:
        self.t = 1.8e9

    def __call__(self) -> float:
        return self.t


def _flip(data: bytes, rng: random.Random, n: int) -> bytes:
    b = bytearray(data)
    for _ in range(n):
        i = rng.randrange(len(b))
        b[i] = rng.randrange(256) if rng.random() < 0.7 else b[i] ^ (1 << rng.randrange(8))
    return bytes(b)


def _raw_table(rec: Record, data: bytes, codec: str) -> bytes:
    if codec == "zstd":
        return bytes(cramjam.zstd.decompress(data))
    if codec == "lz4":
        return bytes(cramjam.lz4.decompress_block(data, output_len=rec.functions_size))  # type: ignore[attr-defined]
    return data


def _bad_index(raw: bytes, rng: random.Random) -> bytes:
    """The table with one dictionary column's indices replaced by values outside its dictionary."""
    t = pa.ipc.open_stream(raw).read_all()
    dicts = [i for i, f in enumerate(t.schema) if pa.types.is_dictionary(f.type)]
    if not dicts:
        return raw
    i = rng.choice(dicts)
    col = t.column(i).combine_chunks()
    idx = [rng.choice((-5, -1, 1 << 20, len(col.dictionary), rng.randrange(-(2**31), 2**31))) for _ in range(len(col))]
    bad = pa.DictionaryArray.from_buffers(
        col.type, len(col), [None, pa.array(idx, pa.int32()).buffers()[1]], col.dictionary
    )
    t = t.set_column(i, t.schema.field(i), bad)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return bytes(sink.getvalue().to_pybytes())


def _with_table(rec: Record, name: str, codec_field: str | None, codec: str, raw: bytes) -> bytes:
    """``rec`` encoded with the IPC stream ``raw`` as its table: uncompressed where the record allows, so that the
    bytes reach Arrow as they are; an lz4 block of the size the record then declares; zstd otherwise."""
    changes: dict[str, object] = {}
    if codec == "lz4":
        changes = {name: bytes(cramjam.lz4.compress_block(raw, store_size=False)), "functions_size": len(raw)}
    elif codec_field:
        changes = {name: raw, codec_field: "none"}
    else:
        changes = {name: bytes(cramjam.zstd.compress(raw))}
    return encode(msgspec.structs.replace(rec, **changes))  # type: ignore[arg-type]


#: the bytes field of each record type that holds a table, and its codec field
_TABLES: dict[type, tuple[str, str | None]] = {
    WindowFeatures: ("functions", "functions_codec"),
    FeatureBatch: ("functions", "functions_codec"),
    StepSlice: ("functions", "functions_codec"),
    StepReport: ("outliers", None),
}
_SIZES: dict[type, tuple[str, ...]] = {
    WindowFeatures: ("window_steps", "expected_workers", "shard_workers"),
    FeatureBatch: ("window_steps", "expected_workers"),
    StepSlice: ("functions_size", "expected_workers"),
    StepReport: ("window_steps", "expected_workers"),
    HeartbeatBatch: ("shard_workers",),
}


def mutate(rec: Record, kind: str, rng: random.Random) -> bytes:
    """``rec`` encoded, then mutated as ``kind`` says (a mutation that does not apply to ``rec`` flips record bytes)."""
    field = _TABLES.get(type(rec))
    if kind == "size" and type(rec) in _SIZES:
        name = rng.choice(_SIZES[type(rec)])
        value = rng.choice((0, -1, 10_000_000, 2**31, 2**62))
        return encode(msgspec.structs.replace(rec, **{name: value}))  # type: ignore[arg-type]
    if field is not None and kind in ("table", "index", "zstd"):
        name, codec_field = field
        data: bytes = getattr(rec, name)
        codec = getattr(rec, codec_field) if codec_field else "zstd"
        if kind == "zstd" and codec == "zstd":
            return encode(msgspec.structs.replace(rec, **{name: _flip(data, rng, rng.randint(1, 4))}))  # type: ignore[arg-type]
        raw = _raw_table(rec, data, codec)
        raw = _bad_index(raw, rng) if kind == "index" else _flip(raw, rng, rng.randint(1, 8))
        return _with_table(rec, name, codec_field, codec, raw)
    return _flip(encode(rec), rng, rng.randint(1, 6))


def corpus(job: str) -> dict[str, list[tuple[str, Record]]]:
    """Valid records of one window of ``job`` (8 workers, shards of 4, one slow GPU), by the topic they travel on:
    what agents send, and what the stages send each other (built by running the stages once)."""
    sim = FleetSimulator(
        Scenario(
            job=job,
            topology=Topology(workers=8, gpus_per_host=8),
            faults=(Fault(type="gpu_slow", workers=(3,), severity=0.4),),
        )
    )
    window = Window(60, 2)
    trigger = msgspec.structs.replace(sim.trigger(window), shard_workers=4)
    steps = [sim.step(s) for s in window.range]
    wf = sim.window_features(steps, trigger, sent_at=1.8e9)
    fb = [b for s in steps for b in sim.feature_batches(s, trigger, sent_at=1.8e9)]
    beats = [b for s in range(40, 60) for b in sim.heartbeats(sim.step(s), sent_at=1.8e9 + s)]
    hb = batch_heartbeats(beats, 4)
    out = {
        TOPICS.windowfeatures: [(window_features_key(r.job, r.window, r.shard).decode(), r) for r in wf],
        TOPICS.features: [(features_key(r.job, r.step).decode(), r) for r in fb],
        TOPICS.heartbeats: [(heartbeat_key(job, shard).decode(), r) for shard, r in hb],
    }
    proc, mem, _ = _processor()
    _run(proc, mem, [(TOPICS.windowfeatures, k, encode(r)) for k, r in out[TOPICS.windowfeatures]])
    out["slices"] = [
        (r.key.decode(), x) for r in mem.records(TOPICS.features) if isinstance(x := decode(r.value), StepSlice)
    ]
    out[TOPICS.stepreports] = [
        (r.key.decode(), x) for r in mem.records(TOPICS.stepreports) if isinstance(x := decode(r.value), StepReport)
    ]
    return out


def _processor() -> tuple[Processor, MemoryOutput, Clock]:
    clock = Clock()
    mem = MemoryOutput(1, True)
    proc = Processor(Policy(), TOPICS, mem, Tables(), step_timeout_s=5.0, window_timeout_s=30.0, clock=clock)
    return proc, mem, clock


def _run(proc: Processor, mem: MemoryOutput, records: list[tuple[str, str, bytes]], clock: Clock | None = None) -> None:
    """Feed ``records`` (topic, key, value) to their stages, time everything out, and feed on what the stages sent."""
    stage_of = {
        TOPICS.heartbeats: proc.heartbeats,
        TOPICS.partials: proc.detect,
        TOPICS.windowfeatures: proc.shards,
        TOPICS.features: proc.steps,
        TOPICS.stepreports: proc.windows,
    }

    async def go() -> None:
        done = len(mem.sent)
        for topic, key, value in records:
            await stage_of[topic].on_record(mem.append(topic, key.encode(), value))
        for _ in range(4):
            while done < len(mem.sent):
                r = mem.sent[done].record
                done += 1
                if r.topic in stage_of:
                    await stage_of[r.topic].on_record(r)
            if clock is not None:
                clock.t += 60.0
            for stage in stage_of.values():
                await stage.on_timer(clock.t if clock is not None else 1.8e9)

    asyncio.run(go())


def fuzz(seconds: float, seed: int, max_iterations: int = 0, progress: Callable[[int], None] | None = None) -> dict:
    rng = random.Random(seed)
    started = time.monotonic()
    kinds: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    bugs: list[str] = []
    base = corpus("fz")
    topics = [t for t in base if base[t]]
    i = 0
    while time.monotonic() - started < seconds and (not max_iterations or i < max_iterations):
        proc, mem, clock = _processor()  # each iteration on a processor of its own: no state carries over
        topic = rng.choice(topics)
        kind = rng.choice(MUTATIONS)
        kinds[f"{topic.split('.')[-1]}/{kind}"] += 1
        records = base[topic]
        victim = rng.randrange(len(records))
        feed_topic = TOPICS.features if topic == "slices" else topic
        batch = [
            (feed_topic, key, mutate(rec, kind, rng) if j == victim else encode(rec))
            for j, (key, rec) in enumerate(records)
        ]
        before = len(mem.sent)
        _run(proc, mem, batch, clock)
        for s in mem.sent[before:]:
            if s.record.topic == TOPICS.deadletter:
                d = decode(s.record.value, DeadLetter)
                reasons[d.reason] += 1
                if d.reason == "processing_failed":
                    bugs.append(f"{kind} {topic}: {d.detail[:300]}")
        i += 1
        if progress is not None and i % 100 == 0:
            progress(i)
    return {
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "iterations": i,
        "mutations": dict(sorted(kinds.items())),
        "dead_letters": dict(sorted(reasons.items())),
        "bugs": bugs[:20],
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def peak_rss_mib() -> float:
    """This process's peak RSS: the kernel's high-water mark of its own memory (``VmHWM``). Not ``ru_maxrss``: Linux
    carries that over ``execve`` from the parent, so a fuzzer started by a large pytest process would report the
    parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    logging.disable(logging.CRITICAL)  # every mutated record is a dead letter the stages log; bugs are counted
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="how long to fuzz (default 30)")
    ap.add_argument("--seed", type=int, default=0, help="the random seed (default 0)")
    ap.add_argument("--iterations", type=int, default=0, help="stop after this many iterations (default: no limit)")
    ap.add_argument("--max-rss-mib", type=float, default=600.0, help="the bound on peak RSS (default 600)")
    args = ap.parse_args(argv)
    progress = (lambda n: print(f"{n} iterations", file=sys.stderr)) if sys.stderr.isatty() else None
    result = fuzz(args.seconds, args.seed, args.iterations, progress)
    result["max_rss_mib"] = args.max_rss_mib
    print(json.dumps(result))
    return 0 if not result["bugs"] and result["peak_rss_mib"] <= args.max_rss_mib else 1


if __name__ == "__main__":
    sys.exit(main())
