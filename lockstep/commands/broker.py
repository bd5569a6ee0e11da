"""``lockstep broker``: the embedded Kafka-protocol broker in the foreground."""

from __future__ import annotations

import signal
import threading


def register(sub) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu, memory storage) until stopped")
    p.add_argument("--port", type=int, default=9092, help="loopback port (default 9092; 0 = any free port)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..broker import EmbeddedBroker

    broker = EmbeddedBroker(port=args.port or None).start()
    print(f"embedded broker listening: --bootstrap-servers {broker.bootstrap_servers}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            if broker._proc is not None and broker._proc.poll() is not None:
                print(f"broker exited with {broker._proc.returncode}")
                return 1
    finally:
        broker.stop()
    return 0
