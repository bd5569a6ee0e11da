"""``lockstep`` command line.  Errors print one line, never a traceback: a :class:`LockstepError` its message,
anything else as an internal error (a bug).

Exit statuses: 0 done; 1 the command failed (its line says why); 2 a usage or settings error; 69 Kafka could not be
reached or did not answer (``--connect-timeout-s``); 70 an internal error (a bug); 130 interrupted; 141 stdout closed."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..config import ConfigError
from ..schemas.errors import LockstepError

EXIT_USAGE = 2
#: Kafka could not be reached or did not answer (sysexits' EX_UNAVAILABLE; :data:`lockstep.kafka.EXIT_UNAVAILABLE`)
EXIT_UNAVAILABLE = 69


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors in one line (``lockstep findings: error: ... (see lockstep findings --help)``)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import COMMANDS

    parser = Parser(prog="lockstep", description="Diagnose slowdowns of synchronous training jobs online.")
    parser.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS:
        mod.register(sub)
    _name_leaves(parser)
    return parser


def _name_leaves(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's parser knows itself (``args.parser``), so that an unknown flag is reported by it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                p.set_defaults(parser=p)
                _name_leaves(p)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    name = getattr(args, "parser", parser).prog  # "lockstep agent env"
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return closed_pipe()
    except LockstepError as exc:  # every error a user can cause; its message says what to do
        print(f"{name}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else getattr(exc, "exit_code", 1)
    except OSError as exc:  # a file or socket the command was given: name it, say what is wrong
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{name}: error: {where}{exc.strerror or one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("LOCKSTEP_TRACEBACK"):
            raise
        if type(exc).__module__.startswith("confluent_kafka"):  # Kafka refused or failed a request: not our bug
            print(f"{name}: error: Kafka: {one_line(exc)}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(
            f"{name}: internal error: {type(exc).__name__}: {one_line(exc)} (a bug; LOCKSTEP_TRACEBACK=1 shows where)",
            file=sys.stderr,
        )
        return 70  # EX_SOFTWARE


def one_line(exc: BaseException) -> str:
    """The message's first line (details that follow, such as a log's tail, are in the file it names)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0].rstrip(":") if lines else type(exc).__name__


def closed_pipe() -> int:
    """The reader of stdout went away (``lockstep query ... | head``): stop quietly, as ``cat`` does.

    Python would print an error when it flushes stdout at exit; point stdout at /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
