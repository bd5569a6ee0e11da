"""Kafka clients: how they are made (:class:`Clients`) and how each kind is configured.

Every confluent-kafka client of the project is configured here, so that the settings the
pipeline depends on cannot drift apart:

* producers use ``murmur2_random``, the partitioner faust, aiokafka and Java use, so that every
  client puts ``job:step`` in the same partition (librdkafka's default is CRC32);
* producers never auto-create a topic (``allow.auto.create.topics=false``): a broker would create it
  with its own partition count (Tansu: 4), which :func:`~lockstep.kafka.topics.ensure_topics` refuses;
* consumers use a short ``fetch.wait.max.ms`` (the embedded broker does not answer a waiting fetch
  early when data arrives) and a short session timeout (a group forms in about half of it);
* the pipeline's producers are idempotent (``acks=all``, zstd); the host agent's is not, and uses
  lz4 (:func:`agent_producer_config`).

Constructors that talk to Kafka (:class:`~lockstep.kafka.Publisher`, :class:`~lockstep.kafka.Tail`, the
sink, the agent's outbox and control follower) take ``clients``: confluent-kafka's by default,
:class:`~lockstep.kafka.memory.MemoryKafka`'s in unit tests.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from ..config import ConfigError, Settings
from ..schemas.errors import LockstepError
from ..schemas.records import MAX_RECORD_BYTES

#: librdkafka's own log lines go through Python logging (not straight to stderr)
librdkafka_log = logging.getLogger("lockstep.librdkafka")


#: the exit status of a command whose Kafka could not be reached or did not answer (sysexits' EX_UNAVAILABLE)
EXIT_UNAVAILABLE = 69


class KafkaUnavailable(LockstepError, ConnectionError):
    """Kafka at the given address could not be reached, or did not answer in time; the command exits with
    :data:`EXIT_UNAVAILABLE`."""

    exit_code = EXIT_UNAVAILABLE


def check_reachable(bootstrap_servers: str, timeout_s: float) -> None:
    """Raise :class:`KafkaUnavailable`, in one line naming each address and what failed (``connection refused``,
    ``timed out``, an unknown host), unless a TCP connection to one of the bootstrap servers opens within
    ``timeout_s`` in all: a command that would otherwise wait on librdkafka's retries says so at once."""
    addresses = [a.strip() for a in bootstrap_servers.split(",") if a.strip()]
    deadline = time.monotonic() + timeout_s
    failures = []
    for i, address in enumerate(addresses):
        hostport = address.split("://", 1)[-1]
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]")  # [::1]:9092
        try:
            number = int(port)
        except ValueError:
            raise ConfigError(f"bootstrap_servers: {address!r} is not HOST:PORT") from None
        share = max(0.1, (deadline - time.monotonic()) / (len(addresses) - i))
        try:
            socket.create_connection((host, number), timeout=share).close()
            return
        except socket.gaierror as exc:
            failures.append(f"{address}: unknown host ({exc.strerror})")
        except TimeoutError:
            failures.append(f"{address}: no answer within {share:g} s")
        except OSError as exc:
            failures.append(f"{address}: {(exc.strerror or str(exc)).lower()}")
    raise KafkaUnavailable(f"cannot reach Kafka at {'; '.join(failures)}")


class ProducerClient(Protocol):
    """The part of ``confluent_kafka.Producer`` the project uses."""

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        *,
        on_delivery: Callable[[Any, Any], None] | None = None,
        headers: Any = None,
    ) -> None: ...
    def poll(self, timeout: float = ...) -> int: ...
    def flush(self, timeout: float = ...) -> int: ...
    def purge(self, in_queue: bool = ..., in_flight: bool = ..., blocking: bool = ...) -> None: ...
    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> Any: ...
    def __len__(self) -> int: ...


class ConsumerClient(Protocol):
    """The part of ``confluent_kafka.Consumer`` the project uses."""

    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> Any: ...
    def get_watermark_offsets(self, partition: Any, timeout: float = ..., cached: bool = ...) -> tuple[int, int]: ...
    def assign(self, partitions: list[Any]) -> None: ...
    def subscribe(self, topics: list[str], on_assign: Callable[..., None] = ...) -> None: ...
    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Clients:
    """How Kafka clients are made from their configuration: confluent-kafka's by default."""

    producer: Callable[[dict[str, Any]], ProducerClient] = Producer
    consumer: Callable[[dict[str, Any]], ConsumerClient] = Consumer


#: the real clients
CONFLUENT = Clients()


#: the largest record batch a Lockstep client sends or fetches, and what its topics accept (``max.message.bytes``): the
#: largest record any stage reads (``MAX_RECORD_BYTES``, 32 MiB) and a margin for the batch's framing.  What Kafka
#: holds compressed is bounded by it; what librdkafka inflates from a compressed batch is not (it decompresses lz4, gzip
#: and snappy batches whole): restrict who may write to the pipeline's topics (Kafka ACLs), RELIABILITY.md.  aiokafka
#: (the processor) inflates at most this much a batch (:func:`~lockstep.kafka.inflate.bound_aiokafka`).
MAX_BATCH_BYTES = MAX_RECORD_BYTES + (1 << 20)


def common_config(settings: Settings) -> dict[str, Any]:
    if not settings.bootstrap_servers:
        raise ConfigError(
            "bootstrap_servers: no Kafka to connect to (start the embedded broker or pass --bootstrap-servers)"
        )
    return {"bootstrap.servers": settings.bootstrap_servers, "logger": librdkafka_log, **settings.kafka}


def producer_config(settings: Settings, **overrides: object) -> dict[str, Any]:
    """Idempotent, acks=all, zstd, murmur2 (the partitioner faust/aiokafka/Java use).

    Never auto-creates a topic: librdkafka's producer asks the broker to by default, and a
    broker then creates it with its own partition count (Tansu: 4), which the pipeline's
    check refuses.  Topics come from :func:`~lockstep.kafka.topics.ensure_topics`; a record for a
    topic that does not exist yet times out, and an agent keeps it in its spool until the topic appears.
    """
    cfg: dict[str, Any] = {
        "allow.auto.create.topics": False,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "zstd",
        "partitioner": "murmur2_random",
        "linger.ms": 5,
        "message.timeout.ms": 30000,
        "message.max.bytes": MAX_BATCH_BYTES,
    }
    cfg.update(common_config(settings))
    cfg.update(overrides)
    return cfg


def agent_producer_config(settings: Settings, delivery_timeout_s: float) -> dict[str, Any]:
    """The host agent's producer: what Kafka has not acknowledged within ``delivery_timeout_s`` goes to its spool."""
    return producer_config(
        settings,
        **{
            # duplicates are tolerated downstream (spool replays make them possible anyway);
            # a non-idempotent producer has no fatal state the agent would have to recover from
            "enable.idempotence": False,
            "message.timeout.ms": int(delivery_timeout_s * 1000),
            "queue.buffering.max.kbytes": 64 << 10,
            "linger.ms": 20,
            # lz4, not zstd: a batch of a few heartbeats costs zstd several times more CPU, on the training host;
            # feature batches carry their own zstd-compressed tables
            "compression.type": "lz4",
        },
    )


def consumer_config(settings: Settings, group: str | None, **overrides: object) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": max(500, settings.session_timeout_ms // 6),
        "enable.partition.eof": False,
        "fetch.wait.max.ms": settings.fetch_wait_ms,
        "fetch.max.bytes": MAX_BATCH_BYTES,
        "max.partition.fetch.bytes": MAX_BATCH_BYTES,
        "receive.message.max.bytes": MAX_BATCH_BYTES + (1 << 20),  # a fetch response: the batch and its framing
    }
    if group:
        cfg["group.id"] = group
    else:  # librdkafka wants a group id even for assign()-only consumers
        cfg["group.id"] = "lockstep-reader"
    cfg.update(common_config(settings))
    cfg.update(overrides)
    return cfg


def agent_consumer_config(settings: Settings, job: str) -> dict[str, Any]:
    """The host agent's control follower: no group (it reads from the end and commits nothing).

    A long fetch wait costs fewer wake-ups of librdkafka's thread (a third of the agent's idle CPU at
    250 ms) and no latency against Kafka, which answers a waiting fetch when a record arrives; the
    embedded broker does not, so there a trigger may take up to a second, which the detector measures
    (echoes)."""
    return consumer_config(settings, None, **{"group.id": f"lockstep-agent-{job}", "fetch.wait.max.ms": 1000})


def admin(settings: Settings) -> AdminClient:
    return AdminClient(common_config(settings))


def faust_broker_kwargs(settings: Settings) -> dict[str, Any]:
    """Translate librdkafka security settings into faust's ``broker_credentials``."""
    kwargs: dict[str, object] = {"broker": f"kafka://{settings.bootstrap_servers}"}
    k = settings.kafka
    protocol = k.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return kwargs
    import faust

    ctx = None
    if "SSL" in protocol:
        ctx = ssl.create_default_context(cafile=k.get("ssl.ca.location"))
        if k.get("ssl.certificate.location"):
            ctx.load_cert_chain(k["ssl.certificate.location"], k.get("ssl.key.location"), k.get("ssl.key.password"))
    if "SASL" in protocol:
        mech = k.get("sasl.mechanism", k.get("sasl.mechanisms", "PLAIN")).upper()
        kwargs["broker_credentials"] = faust.SASLCredentials(
            username=k.get("sasl.username"), password=k.get("sasl.password"), mechanism=mech, ssl_context=ctx
        )
    elif ctx is not None:
        kwargs["broker_credentials"] = faust.SSLCredentials(ctx)
    return kwargs
