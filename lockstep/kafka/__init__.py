"""Everything the project says to Kafka.

* :mod:`~lockstep.kafka.topics`: the pipeline's topics and keys, created with one partition count;
* :mod:`~lockstep.kafka.clients`: how clients are made (:class:`Clients`) and configured;
* :mod:`~lockstep.kafka.publisher`: :class:`Publisher`, records out, delivery checked;
* :mod:`~lockstep.kafka.tail`: :class:`Tail`, records in from a topic's end or start, without a group;
  :func:`ask`, a request and its answers; :func:`read_all`;
* :mod:`~lockstep.kafka.memory`: :class:`MemoryKafka`, clients in memory for unit tests.

The sink's group consumer and the host agent's spooling outbox build on the same clients and
configuration; faust (the stream processor) has its own client and takes :func:`faust_broker_kwargs`.
"""

from .clients import (
    CONFLUENT,
    EXIT_UNAVAILABLE,
    Clients,
    ConsumerClient,
    KafkaUnavailable,
    ProducerClient,
    admin,
    agent_consumer_config,
    agent_producer_config,
    check_reachable,
    consumer_config,
    faust_broker_kwargs,
    producer_config,
)
from .memory import MemoryKafka
from .publisher import DeliveryError, Publisher, PublishStats
from .tail import Message, Tail, ask, read_all
from .topics import (
    TopicError,
    Topics,
    ensure_topics,
    features_key,
    heartbeat_key,
    topic_ids,
    window_features_key,
)

__all__ = [
    "CONFLUENT",
    "EXIT_UNAVAILABLE",
    "Clients",
    "ConsumerClient",
    "DeliveryError",
    "KafkaUnavailable",
    "MemoryKafka",
    "Message",
    "ProducerClient",
    "PublishStats",
    "Publisher",
    "Tail",
    "TopicError",
    "Topics",
    "admin",
    "agent_consumer_config",
    "agent_producer_config",
    "ask",
    "check_reachable",
    "consumer_config",
    "ensure_topics",
    "faust_broker_kwargs",
    "features_key",
    "heartbeat_key",
    "producer_config",
    "read_all",
    "topic_ids",
    "window_features_key",
]
