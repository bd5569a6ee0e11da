"""One module per subcommand; each has ``register(subparsers)``.  Order is the help order."""

from . import broker, demo, evaluate, findings, processor, query, schemas, simulate, sink, topics, trigger

COMMANDS = [demo, processor, sink, broker, topics, simulate, trigger, evaluate, findings, query, schemas]
