"""One module per subcommand; each has ``register(subparsers)``.  Order is the help order."""

from . import (
    agent,
    broker,
    demo,
    diagnose,
    evaluate,
    findings,
    processor,
    query,
    raw,
    report,
    schemas,
    simulate,
    sink,
    testpage,
    topics,
    trigger,
)

COMMANDS = [
    demo,
    processor,
    sink,
    testpage,
    agent,
    broker,
    topics,
    simulate,
    trigger,
    raw,
    diagnose,
    evaluate,
    findings,
    query,
    report,
    schemas,
]
