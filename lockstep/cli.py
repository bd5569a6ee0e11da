"""``lockstep`` command line.  Errors print one line, never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .broker import BrokerError
from .config import ConfigError
from .kafka import TopicError

EXIT_USAGE = 2


def known_errors() -> tuple[type[BaseException], ...]:
    from .commands.diagnose import DiagnoseError
    from .commands.raw import RawError
    from .commands.trigger import TriggerError
    from .producers.publisher import DeliveryError
    from .producers.simulator.faults import FaultError
    from .producers.simulator.fleet import ScenarioError
    from .producers.simulator.topology import TopologyError
    from .schemas.records import RecordError
    from .sinks.routes import RoutesError
    from .sinks.store import StoreError
    from .streams.policy import PolicyError
    from .runtime import RuntimeFailure

    return (ConfigError, BrokerError, TopicError, PolicyError, ScenarioError, FaultError, TopologyError, StoreError, RoutesError, RecordError,
            DeliveryError, RuntimeFailure, TriggerError, DiagnoseError, RawError)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from .commands import COMMANDS

    parser = argparse.ArgumentParser(prog="lockstep", description="Diagnose slowdowns of synchronous training jobs online.")
    parser.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS:
        mod.register(sub)
    return parser


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("faust", "mode", "aiokafka", "kafka", "lockstep.librdkafka"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except known_errors() as exc:
        print(f"lockstep {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        print(f"lockstep {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
