"""Per-connection TCP health while one network case of the real-fault corpus runs (a measurement, not a test).

    sudo .venv/bin/python scripts/tcp_connections.py tbf_burst-strong-w4   # as root: namespaces and qdiscs

Runs the case's job as ``tests/integration/real_faults.py --corpus`` does (each rank in a network namespace of its
own, one rank's link degraded by ``tc``; nothing is recorded into the corpus) and, every 0.2 s, ``ss -tin`` in each
rank's namespace.  Prints, per rank and peer address, the connections' smoothed RTT (median and p90 of the samples),
the segments retransmitted and the bytes acknowledged during the run.  What it showed is in docs/real-faults.md
("The network faults, connection by connection"): the question is whether the culprit is the common endpoint of the
connections that stand out, which the agent's per-worker samples cannot tell.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
import real_faults as rf

RTT = re.compile(r"\brtt:([\d.]+)/")
RETRANS = re.compile(r"\bretrans:\d+/(\d+)")
ACKED = re.compile(r"\bbytes_acked:(\d+)")


def _sample(rows: list[tuple[int, str, float | None, int, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        for ns in (line.split()[0] for line in listed if line.startswith(f"{rf.NS_PREFIX}-")):
            rank = int(ns.rsplit("-", 1)[1])
            cmd = ["ip", "netns", "exec", ns, "ss", "-tin", "state", "established"]
            lines = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[1:]
            for head, info in zip(lines[0::2], lines[1::2], strict=False):
                peer = head.split()[-1].rsplit(":", 1)[0]
                rtt, retrans, acked = RTT.search(info), RETRANS.search(info), ACKED.search(info)
                rows.append(
                    (
                        rank,
                        peer,
                        float(rtt.group(1)) if rtt else None,
                        int(retrans.group(1)) if retrans else 0,
                        int(acked.group(1)) if acked else 0,
                    )
                )
        time.sleep(0.2)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: tcp_connections.py CASE_ID (a network case of the corpus: tbf_burst-*, htb-*, u32_path-*)")
    case = next((c for c in rf.corpus_cases() if c.id == sys.argv[1]), None)
    if case is None or case.mechanism not in rf.NETWORK:
        sys.exit(f"tcp_connections.py: {sys.argv[1]} is not a network case of the corpus")
    rows: list[tuple[int, str, float | None, int, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(rows, stop), daemon=True)
    sampler.start()
    try:
        with tempfile.TemporaryDirectory() as out:
            rf.run_case(case, Path(out))
    finally:
        stop.set()
        sampler.join()
    print(f"{case.id}: culprit(s) {list(case.culprits)} of {case.world} ranks (rank r is 10.231.0.(r+1))")
    by: dict[tuple[int, str], list[tuple[float | None, int, int]]] = defaultdict(list)
    for rank, peer, rtt, retrans, acked in rows:
        by[(rank, peer)].append((rtt, retrans, acked))
    for (rank, peer), seen in sorted(by.items()):
        rtts = sorted(r for r, _, _ in seen if r is not None)
        med, p90 = (rtts[len(rtts) // 2], rtts[int(len(rtts) * 0.9)]) if rtts else (float("nan"),) * 2
        retrans = max(s[1] for s in seen) - min(s[1] for s in seen)
        acked = max(s[2] for s in seen) - min(s[2] for s in seen)
        print(
            f"rank {rank} -> {peer:20s} rtt ms median {med:6.2f} p90 {p90:6.2f}  retransmitted +{retrans:<6d} acked +{acked:,}"
        )


if __name__ == "__main__":
    main()
