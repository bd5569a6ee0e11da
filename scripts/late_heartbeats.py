"""Late heartbeats and expected workers of real jobs: `lockstep agent run -- torchrun` through a real broker and processor.

    .venv/bin/python scripts/late_heartbeats.py [--ranks 2 3] [--seconds 60] [--out DIR]

Starts the embedded broker and a `lockstep processor`, then one CPU DDP job (gloo, ~11 steps per second, no agent
code: `lockstep agent run` attaches the agent to every rank) per ``--ranks`` value, all with one ``--spool-dir``.
Once a job's heartbeats reach the detector it asks for a manual window; when the jobs end it prints the processor's
heartbeats, those counted late (``lockstep_late_records_total{stage="heartbeats"}``), the shards' partials by how
they closed, each trigger's ``expected_workers`` and the per-run, per-rank spool directories.  Issue 20 measured
1,689 late of ~6,900 before the heartbeat stage waited for a shard's members.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from lockstep.app.operator import request_window
from lockstep.app.runtime import Child, settings_flags
from lockstep.broker import EmbeddedBroker, free_port
from lockstep.config import Settings
from lockstep.kafka import ensure_topics
from lockstep.schemas.records import ProfileTrigger
from lockstep.streams.app import changelog_topics

TRAIN = """
import os, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

torch.set_num_threads(1)
dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
t0, run_s = time.monotonic(), float(os.environ["RUN_S"])
while True:
    stop = torch.tensor([float(time.monotonic() - t0 > run_s)])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    if stop.item():
        break
    model(torch.randn(64, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.08)
dist.destroy_process_group()
"""


def metric(text: str, pattern: str) -> float:
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3], help="one job per value, with this many ranks")
    ap.add_argument("--seconds", type=float, default=60.0, help="each job trains this long")
    ap.add_argument("--out", type=Path, default=None, help="logs and spools (default: a temporary directory)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="late-heartbeats-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.py").write_text(TRAIN)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:6]
        s = Settings(
            bootstrap_servers=broker.bootstrap_servers, topic_prefix=f"m{tag}", processor_id=f"p{tag}", partitions=3
        )
        ensure_topics(s, extra=dict.fromkeys(changelog_topics(s.processor_id), s.partitions))
        port = free_port()
        proc = Child(
            "processor",
            ["processor", *settings_flags(s, "processor"), "--http-port", str(port)],
            out,
            f"http://127.0.0.1:{port}/healthz",
        )
        try:
            proc.wait_healthy(60)
            env = {**os.environ, "RUN_S": str(args.seconds), "OMP_NUM_THREADS": "1"}
            jobs = {}
            for n in args.ranks:
                cmd = [
                    *(sys.executable, "-m", "lockstep", "agent", "run", "--job", f"real{n}"),
                    *("--bootstrap-servers", s.bootstrap_servers, "--topic-prefix", s.topic_prefix),
                    *("--spool-dir", str(out / "spool"), "--", torchrun, "--nproc-per-node", str(n)),
                    *("--master-port", str(free_port()), str(out / "train.py")),
                ]
                log = open(out / f"job{n}.log", "wb")  # noqa: SIM115 - closed with the process
                jobs[n] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            triggers: dict[int, ProfileTrigger] = {}
            deadline = time.monotonic() + args.seconds
            while len(triggers) < len(jobs) and time.monotonic() < deadline:
                time.sleep(3)
                for n in jobs.keys() - triggers.keys():
                    t = request_window(s, f"real{n}", steps=4, reason="late_heartbeats.py", timeout_s=20)
                    if isinstance(t, ProfileTrigger):
                        triggers[n] = t
            for p in jobs.values():
                p.wait(args.seconds + 120)
            time.sleep(6)  # the last steps wait at most the lateness bound
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        finally:
            proc.kill()
    beats = metric(text, r"^lockstep_heartbeats_total (\S+)$")
    late = metric(text, r'^lockstep_late_records_total\{stage="heartbeats"\} (\S+)$')
    print(f"heartbeats {beats:.0f}, late {late:.0f} ({late / max(beats, 1):.2%})")
    print(
        "partials by how they closed:",
        dict(re.findall(r'^lockstep_step_partials_total\{closed="(\w+)"\} (\S+)$', text, re.M)),
    )
    for n in args.ranks:
        t = triggers.get(n)
        print(f"{n} ranks: trigger expects {t.expected_workers if t else '- (no trigger)'} worker(s)")
    print("spools:", ", ".join(sorted(str(p.relative_to(out)) for p in (out / "spool").glob("*/*"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
