"""Everything the project says to Kafka.

* :mod:`~lockstep.kafka.names`: the pipeline's topics and record keys (pure: no Kafka client);
* :mod:`~lockstep.kafka.topics`: the topics created with one partition count, and their ids;
* :mod:`~lockstep.kafka.clients`: how clients are made (:class:`Clients`) and configured;
* :mod:`~lockstep.kafka.publisher`: :class:`Publisher`, records out, delivery checked;
* :mod:`~lockstep.kafka.tail`: :class:`Tail`, records in from a topic's end or start, without a group;
  :func:`ask`, a request and its answers; :func:`read_all`;
* :mod:`~lockstep.kafka.memory`: :class:`MemoryKafka`, clients in memory for unit tests.

The sink's group consumer and the host agent's spooling outbox build on the same clients and
configuration; faust (the stream processor) has its own client and takes :func:`faust_broker_kwargs`.

The package is lazy: importing it loads only :mod:`.names`; a name of another module loads that module (and
the Kafka client) when it is first used, so that the pure stream stages, which need topic names and keys
only, load no Kafka client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .names import Topics, features_key, heartbeat_key, window_features_key

if TYPE_CHECKING:
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
    from .publisher import DeliveryError, Publisher, PublisherClosed, PublishStats
    from .tail import Message, Tail, ask, read_all
    from .topics import TopicError, ensure_topics, topic_ids

#: name -> the module that defines it, for the names loaded when first used
_LAZY = {
    **dict.fromkeys(
        (
            "CONFLUENT",
            "EXIT_UNAVAILABLE",
            "Clients",
            "ConsumerClient",
            "KafkaUnavailable",
            "ProducerClient",
            "admin",
            "agent_consumer_config",
            "agent_producer_config",
            "check_reachable",
            "consumer_config",
            "faust_broker_kwargs",
            "producer_config",
        ),
        "clients",
    ),
    "MemoryKafka": "memory",
    **dict.fromkeys(("DeliveryError", "Publisher", "PublisherClosed", "PublishStats"), "publisher"),
    **dict.fromkeys(("Message", "Tail", "ask", "read_all"), "tail"),
    **dict.fromkeys(("TopicError", "ensure_topics", "topic_ids"), "topics"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "PublisherClosed",
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
