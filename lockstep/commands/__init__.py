"""One module per subcommand; each has ``register(subparsers)``.  Order is the help order."""

from . import broker, demo, diagnose, findings, processor, query, schemas, simulate, sink, topics

COMMANDS = [demo, processor, sink, broker, topics, simulate, diagnose, findings, query, schemas]
