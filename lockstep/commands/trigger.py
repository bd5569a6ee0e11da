"""``lockstep trigger JOB``: an operator's profiling window, decided by the detector.

The detector that owns the job's state (the processor holding the job's
partition of the heartbeats topic) decides, with the same policy checks as for
its own windows.  So the command sends a ``TriggerRequest`` into that partition
and waits for the answer on the control topic: the ``ProfileTrigger`` it
published, or a ``TriggerRefused`` with the reason.
"""

from __future__ import annotations

import getpass
import socket
import time
import uuid

from .. import config


class TriggerError(RuntimeError):
    """The detector refused the window, or no processor answered."""


def register(sub) -> None:
    p = sub.add_parser("trigger", help="ask the detector for a profiling window of a job (same policy checks as its own)")
    config.add_arguments(p, config.KAFKA)
    p.add_argument("job", help="the job to profile")
    p.add_argument("--steps", type=int, default=None, help="steps in the window (default: the policy's window_steps)")
    p.add_argument("--reason", default="", help="why, recorded in the trigger")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the detector's answer (default 30)")
    p.add_argument("--json", action="store_true", help="print the ProfileTrigger (or TriggerRefused) record as JSON")
    p.set_defaults(func=run)


def request_window(settings, job: str, *, steps: int | None, reason: str, timeout_s: float):
    """Send a TriggerRequest and return the detector's answer (ProfileTrigger or TriggerRefused)."""
    from confluent_kafka import Consumer, TopicPartition

    from ..kafka import Topics, consumer_config, producer_config
    from ..producers.publisher import Publisher
    from ..schemas.records import ProfileTrigger, RecordError, TriggerRefused, TriggerRequest, decode

    topics = Topics.named(settings.topic_prefix)
    req = TriggerRequest(job=job, request=uuid.uuid4().hex, steps=steps, reason=reason,
                         requested_by=f"{getpass.getuser()}@{socket.gethostname()}", requested_at=time.time())  # fmt: skip
    consumer = Consumer(consumer_config(settings, None))
    try:
        meta = consumer.list_topics(topics.control, timeout=10).topics.get(topics.control)
        if meta is None or meta.error is not None or not meta.partitions:
            raise TriggerError(f"topic {topics.control} does not exist at {settings.bootstrap_servers} (wrong --topic-prefix, or no processor ever ran?)")
        # read the control topic from its end as it is before the request: the answer comes after
        ends = [TopicPartition(topics.control, p, consumer.get_watermark_offsets(TopicPartition(topics.control, p), timeout=10, cached=False)[1]) for p in meta.partitions]
        consumer.assign(ends)
        pub = Publisher(producer_config(settings))
        pub.send(topics.heartbeats, job, req)
        pub.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error():
                    continue
                try:
                    rec = decode(msg.value())
                except RecordError:
                    continue
                if isinstance(rec, (ProfileTrigger, TriggerRefused)) and rec.request == req.request:
                    return rec
    finally:
        consumer.close()
    raise TriggerError(f"no stream processor answered within {timeout_s:g}s (is `lockstep processor` running against {settings.bootstrap_servers} with topic prefix {settings.topic_prefix!r}?)")


def run(args) -> int:
    from ..output import print_json, table
    from ..schemas.records import TriggerRefused, to_builtins

    settings = config.load(args)
    if not settings.bootstrap_servers:
        raise config.ConfigError("bootstrap_servers: `lockstep trigger` talks to the running processors; pass --bootstrap-servers")
    if args.steps is not None and not 1 <= args.steps <= 10_000:
        raise config.ConfigError(f"--steps: {args.steps} is not in 1..10000")
    answer = request_window(settings, args.job, steps=args.steps, reason=args.reason, timeout_s=args.timeout)
    if args.json:
        print_json(to_builtins(answer))
    if isinstance(answer, TriggerRefused):
        raise TriggerError(f"refused ({answer.code}): {answer.reason}")
    if not args.json:
        t = answer
        print(table(["job", "window", "steps", "workers", "kind", "policy", "reason"],
                    [[t.job, t.window, f"{t.start_step}..{t.start_step + t.steps - 1}", t.expected_workers, t.kind, t.policy_ref, t.reason]], max_width=100))  # fmt: skip
    return 0
