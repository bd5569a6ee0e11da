"""Record the heartbeats of a real multi-process PyTorch job (CPU, gloo DDP, the host agent attached).

    .venv/bin/python scripts/record_steptimes.py OUT.csv.gz --workload mlp --seconds 120 [--ranks 4]

Starts the embedded broker, runs ``--ranks`` training processes with ``lockstep.producers.agent.attach()``
for ``--seconds``, reads every ``StepHeartbeat`` back from Kafka and writes ``worker,step,step_time_s``
(gzip CSV).  The detector evaluation (``lockstep evaluate --detector``) replays these files as the
"recorded" series: what real step times look like, scheduler and contention noise included.

Workloads: ``mlp`` (fixed shapes: the step time varies only by accident), ``testjob`` (the loop of
``tests/integration/agent_torch_job.py``: the MLP plus a 5 ms ``preprocess`` and a 20 ms pause, so
that the step is more regular than the machine's CPU contention) and ``varlen`` (each step's batch has
a random sequence length, 32..256 tokens, the same on every rank, through an embedding and
self-attention: the step time varies by design).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main() -> int:
    """One rank (run by this script with ``--rank``): trains until ``STOP_FILE`` exists."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import lockstep.producers.agent

    torch.set_num_threads(1)
    stop_file, workload = Path(os.environ["STOP_FILE"]), os.environ["WORKLOAD"]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if workload in ("mlp", "testjob"):
        net: nn.Module = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)
        )
    else:
        net = nn.ModuleDict(
            {
                "emb": nn.Embedding(1000, 64),
                "attn": nn.MultiheadAttention(64, 4, batch_first=True),
                "out": nn.Linear(64, 16),
            }
        )
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = lockstep.producers.agent.attach(job=os.environ["JOB"])
    gen = torch.Generator().manual_seed(1)  # the same sequence lengths on every rank
    while True:
        stop = torch.tensor([float(stop_file.exists())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            break
        if workload in ("mlp", "testjob"):
            if workload == "testjob":
                time.sleep(0.005)  # preprocess
            loss = model(torch.randn(64, 256)).square().mean()
        else:
            length = int(torch.randint(32, 257, (1,), generator=gen))
            tokens = torch.randint(0, 1000, (8, length))
            h = model.module["emb"](tokens)
            a, _ = model.module["attn"](h, h, h)
            loss = model.module["out"](a).square().mean() + 0 * sum(p.sum() for p in model.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if workload == "testjob":
            time.sleep(0.02)
        agent.step()
    agent.close()
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--workload", choices=("mlp", "testjob", "varlen"), default="mlp")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--ranks", type=int, default=4)
    a = ap.parse_args()

    from confluent_kafka import Consumer, TopicPartition

    from lockstep.broker import EmbeddedBroker, free_port
    from lockstep.config import Settings
    from lockstep.kafka import consumer_config, ensure_topics
    from lockstep.schemas.records import StepHeartbeat, decode

    job = f"recorded-{a.workload}"
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="lockstep-record-") as tmp:
        settings = Settings(bootstrap_servers=broker.bootstrap_servers)
        topics = ensure_topics(settings)
        port, stop = free_port(), Path(tmp) / "stop"
        procs = []
        for rank in range(a.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(a.ranks),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "JOB": job,
                "WORKLOAD": a.workload,
                "STOP_FILE": str(stop),
                "LOCKSTEP_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
                "LOCKSTEP_AGENT_SPOOL_DIR": f"{tmp}/spool{rank}",
                "LOCKSTEP_AGENT_HOST": f"node{rank}",
            }
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank"], env=env))
        time.sleep(a.seconds)
        stop.touch()
        codes = [p.wait(timeout=60) for p in procs]
        if any(codes):
            print(f"a rank failed: exit codes {codes}", file=sys.stderr)
            return 1
        consumer = Consumer(consumer_config(settings, None))
        consumer.assign([TopicPartition(topics.heartbeats, p, 0) for p in range(settings.partitions)])
        rows: dict[tuple[int, int], float] = {}
        quiet = 0
        while quiet < 3:
            msgs = consumer.consume(5000, timeout=1.0)
            quiet = 0 if msgs else quiet + 1
            for m in msgs:
                if not m.error():
                    hb = decode(m.value(), StepHeartbeat)
                    rows[(hb.worker, hb.step)] = hb.step_time_s
        consumer.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(a.out, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["worker", "step", "step_time_s"])
        for (worker, step), t in sorted(rows.items()):
            w.writerow([worker, step, f"{t:.6f}"])
    steps = len({s for _, s in rows})
    print(f"{a.out}: {len(rows)} heartbeats, {steps} steps of {a.ranks} ranks ({a.workload})")
    return 0


if __name__ == "__main__":
    sys.exit(rank_main() if sys.argv[1:] == ["--rank"] else main())
