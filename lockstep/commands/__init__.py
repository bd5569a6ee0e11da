"""One module per subcommand; each has ``register(subparsers)``.  Order is the help order."""

from . import agent, broker, demo, findings, processor, query, schemas, simulate, sink, topics

COMMANDS = [demo, processor, sink, agent, broker, topics, simulate, findings, query, schemas]
