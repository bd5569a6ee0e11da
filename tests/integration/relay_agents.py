"""One agent process of a host for tests/integration/test_relay.py: ``attach()`` and a plain loop of short steps
(no torch: the subject is how heartbeats leave the host), identity from RANK / LOCAL_RANK / WORLD_SIZE.

Every few steps it writes ``OUT_DIR/progress-RANK.json``: its step, its relay role, whether it holds a Kafka
producer or follows the control topic, the most librdkafka threads (``rdk:*``) it ever had, the triggers it
refused.  It stops when ``STOP_FILE`` exists (closing its agent: final heartbeat) or after ``MAX_S``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def rdkafka_threads() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            n += Path(f"/proc/self/task/{tid}/comm").read_text().startswith("rdk:")
        except OSError:
            pass
    return n


def main() -> int:
    from lockstep.producers.agent import attach

    out, rank = Path(os.environ["OUT_DIR"]), int(os.environ["RANK"])
    stop, deadline = Path(os.environ["STOP_FILE"]), time.monotonic() + float(os.environ.get("MAX_S", "120"))
    agent = attach(job=os.environ["JOB"], flush_interval_s=0.1)
    most_rdk = 0
    while not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
        agent.step()
        if agent.current_step % 5 == 0:
            most_rdk = max(most_rdk, rdkafka_threads())
            report = agent.report()
            tmp = out / f".progress-{rank}.json"
            tmp.write_text(
                json.dumps(
                    {
                        "step": agent.current_step,
                        "role": report.relay_role,
                        "producer": report.kafka_producer,
                        "control": agent._control.connected,
                        "rdk_threads_most": most_rdk,
                        "refused": report.refused,
                        "handed_over": report.handed_over,
                        "relayed_rows": report.relayed_rows,
                        "fallbacks": report.relay_fallbacks,
                    }
                )
            )
            tmp.replace(out / f"progress-{rank}.json")
    agent.close()
    (out / f"done-{rank}").write_text(str(agent.current_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
