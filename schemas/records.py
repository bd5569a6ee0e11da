"""Record contracts shared by every stage of the pipeline.

Every record is a msgspec struct carrying ``schema`` (its name) and ``v`` (its
version).  On the wire a record is a JSON object or a MessagePack map with the
same fields; the first byte tells which (``{`` is JSON).  Records that carry
binary payloads (``FeatureBatch``, ``StepReport``) are written as MessagePack,
the others as JSON so that people can read them with any Kafka tool.

``decode`` never raises anything but :class:`RecordError`, whose ``reason`` is
one of :data:`DEAD_LETTER_REASONS`; stream processors route such records to
the dead-letter topic.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar, cast, get_args, overload

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import LockstepError

# --------------------------------------------------------------------------- errors

DeadLetterReason = Literal[
    "malformed",  # not JSON/MessagePack, or no record header
    "unknown_schema",  # the ``schema`` field names no record we know
    "unsupported_version",  # a version of a known record this build cannot read
    "wrong_record",  # a valid record on a topic that does not carry it
    "invalid",  # a known record whose fields break the contract (missing, wrong type, negative time, NaN, ...)
    "bad_function_table",  # the Arrow payload of a FeatureBatch is unreadable or invalid
    "from_the_future",  # a step or timestamp implausibly far ahead of what was seen
    "processing_failed",  # a record the stage accepted but could not process (a bug: replay it after the fix)
]
#: every reason a record can be refused for, in the order above
DEAD_LETTER_REASONS: tuple[DeadLetterReason, ...] = get_args(DeadLetterReason)


class RecordError(LockstepError, ValueError):
    """A record that cannot be accepted; ``reason`` is a dead-letter reason code."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        if reason not in DEAD_LETTER_REASONS:  # a bug in the caller: the reason is a metric label and a contract
            raise ValueError(f"unknown dead-letter reason {reason!r}; one of {', '.join(DEAD_LETTER_REASONS)}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- helpers

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]
#: a step number; fits the findings store's 32-bit columns (6.8 years of training at 10 steps/s)
Step = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: workers of a job, or anything counted per window
Count = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]
Workers = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
WindowSteps = Annotated[int, msgspec.Meta(ge=1, le=10_000)]
#: unix seconds, 1970 to 2100: NaN, infinities or a year 3000 are a broken clock (or a forged record)
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=4_102_444_800.0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
#: workers per shard of a window's feature records (``WindowFeatures``), unless the trigger says otherwise
SHARD_WORKERS = 256
#: the most steps one HeartbeatBatch may span: an agent's (or a host relay's) batch covers one flush interval, a few
#: hundred steps at most; the heartbeat stage opens a step, with a flag per member of the shard, for each distinct one
MAX_BATCH_STEP_SPAN = 1024
ShardWorkers = Annotated[int, msgspec.Meta(ge=1, le=100_000)]

FUNCTION_KINDS = ("compute", "memcpy", "collective", "p2p", "python", "dataloader", "optimizer", "other", "sync")
SCOPES = ("worker", "group", "job")

#: cause categories of a finding (brief 5), with what each means
CAUSES: dict[str, str] = {
    # hardware
    "gpu_throttle_thermal": "GPU clock reduced by thermal slowdown",
    "gpu_throttle_power": "GPU clock reduced by the power cap or power brake",
    "gpu_throttle": "GPU clock reduced, reason not reported",
    "gpu_slow": "GPU slower than its peers at the same clock",
    "nvlink": "NVLink degraded",
    "pcie": "PCIe link degraded (host/device copies slow)",
    "nic": "NIC, bond or link degraded",
    "switch": "switch port congested or degraded (several hosts behind one switch)",
    "host_cpu_contention": "other processes on the host take the CPU the worker needs",
    "host_memory": "host memory pressure",
    "storage": "slow remote or local storage",
    # software
    "dataloader": "data loader too slow (workers, pin_memory, decoding)",
    "input_imbalance": "some workers get more input (sequence length, routing)",
    "pipeline_imbalance": "a pipeline stage has more work than the others",
    "rank_specific_code": "user code that runs on some ranks only (logging, evaluation)",
    "framework_config": "framework or communication-library configuration",
    "python_overhead": "Python garbage collection or launch overhead",
    "regression": "every worker slower in a function than in the job's earlier healthy windows",
    "hang": "the job stopped: the worker named is not where its peers wait (another function, an earlier collective, or no answer)",
    "worker_died": "the job stopped: the worker's process exited while its host's other workers answered",
    "unknown": "deviation found, cause not determined; see the evidence",
    "undetermined": "worker, function and device found; the samples that would tell the cause were not taken (the summary names them)",
}
#: causes located in a host's hardware: the deviating workers of one host form one finding (the diagnosis), and
#: the incident is the device's, whatever function showed it (paging)
HARDWARE_CAUSES = frozenset(
    {
        "gpu_throttle_thermal",
        "gpu_throttle_power",
        "gpu_throttle",
        "gpu_slow",
        "nvlink",
        "pcie",
        "nic",
        "switch",
        "host_cpu_contention",
        "host_memory",
        "storage",
    }
)
#: the hardware causes whose culprit is a device or a link: the report gives their findings rows of their own (a
#: saturated link slows every ring-mate alike, so its workers' work does not stand out against the peers')
DEVICE_CAUSES = HARDWARE_CAUSES - {"host_cpu_contention", "host_memory", "storage"}


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise RecordError("invalid", f"{name} must be a finite number, got {value!r}")


class _Record(msgspec.Struct, kw_only=True, tag_field="schema", forbid_unknown_fields=False):
    """Base of all records.  ``v`` is the version of the record's own schema."""

    v: int = 1

    def validate(self) -> None:  # overridden where there is more to check
        pass


# --------------------------------------------------------------------------- worker metadata


class WorkerMeta(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Who a worker is and where it runs.  ``labels`` carry the peer-group keys."""

    rank: Rank
    host: Name
    device: str = ""  # e.g. "host03/gpu5", or an NVML UUID
    local_rank: NonNegInt = 0
    nic: str = ""  # NIC or bond the worker's inter-node traffic leaves through
    switch: str = ""  # leaf switch behind that NIC
    labels: dict[str, str] = {}  # dp / pp / tp ranks, role, model chunk, ...


# --------------------------------------------------------------------------- records


class AgentCounters(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What a worker's host agent had to give up, cumulative since it started."""

    dropped_records: NonNegInt = 0  # records dropped because the memory queue or the on-disk spool was full
    spooled_records: NonNegInt = 0  # records waiting in the on-disk spool for Kafka to come back
    refused_triggers: NonNegInt = 0  # triggers refused: start step already past, or overlapping a window
    failed_windows: NonNegInt = 0  # accepted windows that could not be profiled or summarised


class StepHeartbeat(_Record, tag="StepHeartbeat", kw_only=True):
    """The always-on signal: one worker finished one step. Key: ``job``."""

    job: Name
    worker: Rank
    step: Step
    step_time_s: float
    host: Name
    sent_at: Timestamp  # unix seconds on the worker's own clock
    tenant: str = ""
    # optional (absent from the wire unless set, so the always-on signal stays small):
    # agents echo the last trigger they received, once, so that the detector measures the
    # control topic's latency instead of assuming it
    trigger_window: str | msgspec.UnsetType = msgspec.UNSET  # the window of that trigger
    trigger_latency_s: float | msgspec.UnsetType | None = (
        msgspec.UNSET
    )  # its receipt (worker clock) - its created_at (processor clock)
    final: bool | msgspec.UnsetType = msgspec.UNSET  # true on the worker's last heartbeat: it shuts down (not a hang)
    agent: AgentCounters | msgspec.UnsetType = (
        msgspec.UNSET
    )  # the agent's counters, on the first heartbeat after one changed
    # workers in the job as the agent knows it (torch.distributed, WORLD_SIZE): the job's membership, which steps and
    # windows are counted against; on the agent's first heartbeats and every so often (absent: unknown)
    world_size: Count | msgspec.UnsetType = msgspec.UNSET
    # with the echo: the worker refused that trigger, and why (AgentRefusal: ``past``, ``overlap``); absent: accepted
    trigger_refused: AgentRefusal | msgspec.UnsetType = msgspec.UNSET

    def echo(self) -> Echo | None:
        """The worker's echo of the last trigger it received, when this heartbeat carries one."""
        if isinstance(self.trigger_window, str) and isinstance(self.trigger_latency_s, float):
            refused = self.trigger_refused if isinstance(self.trigger_refused, str) else ""
            return Echo(
                worker=self.worker, window=self.trigger_window, latency_s=self.trigger_latency_s, refused=refused
            )
        return None

    def validate(self) -> None:
        _finite("step_time_s", self.step_time_s)
        if isinstance(self.trigger_latency_s, float):
            _finite("trigger_latency_s", self.trigger_latency_s)
        if self.step_time_s <= 0:
            raise RecordError("invalid", f"step_time_s must be > 0, got {self.step_time_s}")


#: rows of one HeartbeatBatch at most (a host relays its workers' heartbeats of a flush, an agent its own)
MAX_BATCH_ROWS = 65_536
#: workers a StepPartial names when some of its shard's workers are behind its step
MAX_MISSING = 16
#: workers a StepReport or a WindowReport names of those expected that delivered nothing
MAX_NAMED_MISSING = 64
#: a StepSlice's missing workers: at most this many ranges (a shard has at most 4,096 workers: 2,048 runs) ...
MAX_MISSING_RANGES = 4096
#: ... covering at most this many workers (what its ``missing`` list allows)
MAX_MISSING_RANKS = 100_000
#: a step time: positive and finite (NaN fails both bounds)
Seconds = Annotated[float, msgspec.Meta(gt=0.0, lt=1e9)]
#: why an agent refused a trigger (``past``, ``overlap``; "" accepted): a word, not a closed list, so that a newer
#: agent's reason does not make an older processor refuse the whole heartbeat batch
AgentRefusal = Annotated[str, msgspec.Meta(max_length=32)]


class Echo(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A worker's echo of the last trigger it received: the detector measures the control topic's latency from it."""

    worker: Rank
    window: Name
    latency_s: float  # its receipt (worker clock) - the trigger's created_at (processor clock)
    # added after the first echoes: why the worker refused the trigger ("" accepted, or an agent older than refusals):
    # ``past`` (its start step had begun when the trigger reached the worker), ``overlap`` (an accepted window)
    refused: AgentRefusal = ""


class WorkerCounters(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One worker's agent counters, as they changed."""

    worker: Rank
    counters: AgentCounters


class HeartbeatBatch(_Record, tag="HeartbeatBatch", kw_only=True):
    """Heartbeats of workers of one job shard, as columns: row ``i`` says worker ``worker[i]`` finished step
    ``step[i]`` in ``step_time_s[i]``, sent at ``sent_at[i]`` on its own host's clock.  Key: ``job/shard``
    (:func:`lockstep.kafka.heartbeat_key`), so that one job's heartbeats spread over partitions and processors.

    Every worker belongs to shard ``worker // shard_workers``.  An agent sends one per flush (its own heartbeats
    since the last one); a host relay one per host and flush.  What is rare travels sparsely: ``final`` (the rows
    that are a worker's last heartbeat: its agent shut down, not a hang), ``echoes`` (trigger receipts) and
    ``agents`` (counters that changed), by worker.  ``StepHeartbeat`` (one heartbeat, key ``job``) stays readable.
    """

    job: Name
    tenant: str = ""
    shard: Rank
    shard_workers: ShardWorkers = SHARD_WORKERS
    host: str = ""  # the host that sent it ("" for a relay of several)
    worker: Annotated[list[Rank], msgspec.Meta(max_length=MAX_BATCH_ROWS)]
    step: list[Step]
    step_time_s: list[Seconds]
    sent_at: list[Timestamp]
    final: list[NonNegInt] = []  # row numbers
    echoes: list[Echo] = []
    agents: list[WorkerCounters] = []
    world_size: Count = 0  # workers in the job as its agents know it (0: unknown): the job's membership

    def validate(self) -> None:
        n = len(self.worker)
        if not len(self.step) == len(self.step_time_s) == len(self.sent_at) == n:
            raise RecordError("invalid", "worker, step, step_time_s and sent_at must have the same length")
        lo, hi = self.shard * self.shard_workers, (self.shard + 1) * self.shard_workers
        if self.final and max(self.final) >= n:
            raise RecordError("invalid", f"final names row {max(self.final)} of {n}")
        named = [*self.worker, *(e.worker for e in self.echoes), *(a.worker for a in self.agents)]
        if named and not (lo <= min(named) and max(named) < hi):
            outside = next(w for w in named if not lo <= w < hi)
            raise RecordError(
                "invalid", f"worker {outside} is not in shard {self.shard} of {self.shard_workers} workers"
            )
        for e in self.echoes:
            _finite("echoes.latency_s", e.latency_s)
        if n and (span := max(self.step) - min(self.step)) >= MAX_BATCH_STEP_SPAN:
            raise RecordError(
                "invalid",
                f"steps {min(self.step)}..{max(self.step)} span {span + 1}, over the {MAX_BATCH_STEP_SPAN} "
                "a batch may cover (an agent's batch covers one flush interval)",
            )

    def heartbeats(self) -> list[StepHeartbeat]:
        """The batch as one ``StepHeartbeat`` per row, for readers that want records, not columns: counters on the
        worker's first row, its echoes one a row in order."""
        echo: dict[int, list[Echo]] = {}
        for sent in self.echoes:  # a worker's echoes in order, one per row of its own (an agent sends one a beat)
            echo.setdefault(sent.worker, []).append(sent)
        agent = {a.worker: a.counters for a in self.agents}
        final = set(self.final)
        out = []
        for i, (w, step, t, at) in enumerate(zip(self.worker, self.step, self.step_time_s, self.sent_at)):
            extra: dict[str, Any] = {"final": True} if i in final else {}
            if (e := echo[w].pop(0) if echo.get(w) else None) is not None:
                extra.update(trigger_window=e.window, trigger_latency_s=e.latency_s)
                if e.refused:
                    extra["trigger_refused"] = e.refused
            if (c := agent.pop(w, None)) is not None:
                extra["agent"] = c
            if self.world_size:
                extra["world_size"] = self.world_size
            out.append(
                StepHeartbeat(
                    job=self.job,
                    worker=w,
                    step=step,
                    step_time_s=t,
                    host=self.host or "?",
                    sent_at=at,
                    tenant=self.tenant,
                    **extra,
                )
            )
        return out


def batch_heartbeats(beats: list[StepHeartbeat], shard_workers: int) -> list[tuple[int, HeartbeatBatch]]:
    """Heartbeats of one job (an agent's flush, a host's) as one ``HeartbeatBatch`` per shard, with its shard."""
    by_shard: dict[int, list[StepHeartbeat]] = {}
    for hb in beats:
        by_shard.setdefault(hb.worker // shard_workers, []).append(hb)
    out = []
    for shard, hbs in by_shard.items():
        hosts = {hb.host for hb in hbs}
        out.append(
            (
                shard,
                HeartbeatBatch(
                    job=hbs[0].job,
                    tenant=hbs[0].tenant,
                    shard=shard,
                    shard_workers=shard_workers,
                    host=hosts.pop() if len(hosts) == 1 else "",
                    worker=[hb.worker for hb in hbs],
                    step=[hb.step for hb in hbs],
                    step_time_s=[hb.step_time_s for hb in hbs],
                    sent_at=[hb.sent_at for hb in hbs],
                    final=[i for i, hb in enumerate(hbs) if hb.final],
                    echoes=[echo for hb in hbs if (echo := hb.echo()) is not None],
                    agents=[
                        WorkerCounters(worker=hb.worker, counters=hb.agent)
                        for hb in hbs
                        if isinstance(hb.agent, AgentCounters)
                    ],
                    world_size=max((hb.world_size for hb in hbs if isinstance(hb.world_size, int)), default=0),
                ),
            )
        )
    return out


#: why a shard sent its partial: every worker it expects; (older processors: a later step); waited as long as the
#: processor's lateness bound allows; news only (echoes, counters)
PartialClosed = Literal["complete", "later", "timeout", "news"]
#: how the step stage closed a step: every expected worker's features came (``complete``), or not (``timeout``, or
#: closed early to stay within the stage's memory budget)
StepClosed = Literal["complete", "timeout"]


class StepPartial(_Record, tag="StepPartial", kw_only=True):
    """Internal: one shard's heartbeats of one step, aggregated by the heartbeat stage for the detector.  Key:
    ``job``, topic ``<prefix>.partials``.

    A partial is identified by ``(job, step, shard, partition)``: only the processor that owns heartbeats partition
    ``partition`` makes it, so the detector keeps the first of each (a replay sends it again).  ``shard`` -1: the
    ``StepHeartbeat`` records (key ``job``) of that partition.  ``workers`` 0: no step, only the news (final
    heartbeats, echoes, counters) of heartbeats whose step was sent before.
    """

    job: Name
    tenant: str = ""
    step: Step
    shard: Annotated[int, msgspec.Meta(ge=-1, le=10_000_000)]
    partition: NonNegInt
    workers: Count  # workers that reported the step
    slowest_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] = 0.0  # the slowest one's step time ...
    slowest_worker: int = -1  # ... and who
    median_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] = 0.0  # the workers' median step time (the pictures)
    clock_worker: int = -1  # the shard's clock (its lowest worker), if it reported the step ...
    clock_sent_at: Timestamp = 0.0  # ... and its sent_at: one host's clock, for the job's pace and the lag
    newest_sent_at: Timestamp = 0.0
    highest: Step  # the shard's highest step seen so far
    missing: Annotated[
        list[Rank], msgspec.Meta(max_length=MAX_MISSING)
    ] = []  # workers of the shard behind the step (the first)
    missing_total: Count = 0
    final: Count = 0  # workers that sent their last heartbeat
    echoes: list[Echo] = []  # the slowest receipt of each window
    agents: AgentCounters | None = None  # the shard's agents' counters, summed, when one changed
    closed: PartialClosed = "complete"
    at: Timestamp = 0.0
    # added after the first partials: the shard's membership when the partial was made (the workers it waited for: seen
    # lately or named by the job's world size, less those that ended; 0: an older processor) ...
    members: Count = 0
    # ... and the job's world size as the shard's agents report it (0: unknown)
    world_size: Count = 0
    # the sent_at of the shard's newest heartbeat (of about its ``highest`` step; 0: an older processor): how far
    # behind the job the detector's view is, which the step's own sent_at is not while the processor catches up
    highest_sent_at: Timestamp = 0.0

    def validate(self) -> None:
        if self.workers and not (self.step <= self.highest):
            raise RecordError("invalid", f"step {self.step} above the highest step {self.highest}")
        for e in self.echoes:
            _finite("echoes.latency_s", e.latency_s)


class Sampling(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """How agents profile during a window."""

    hardware_hz: Annotated[float, msgspec.Meta(gt=0, le=10_000)] = 100.0
    record_shapes: bool = False
    with_stack: bool = False


class ProfileTrigger(_Record, tag="ProfileTrigger", kw_only=True):
    """Start a step-aligned profiling window on every worker of a job. Key: ``job``."""

    job: Name
    window: Name
    start_step: Step
    steps: WindowSteps
    expected_workers: Workers
    sampling: Sampling = Sampling()
    policy: str = "default"  # policy id
    policy_hash: str = ""
    reason: str = ""
    created_at: Timestamp = 0.0  # unix seconds on the processor's clock
    tenant: str = ""
    kind: Literal["slowdown", "hang", "manual", "baseline"] = "slowdown"  # what opened the window
    request: str = ""  # the TriggerRequest this window answers (manual windows)
    shard_workers: ShardWorkers = SHARD_WORKERS  # workers per shard of the window's WindowFeatures

    @property
    def policy_ref(self) -> str:
        """``id@hash``: what feature batches and findings record."""
        return f"{self.policy}@{self.policy_hash}" if self.policy_hash else self.policy


class TriggerRequest(_Record, tag="TriggerRequest", kw_only=True):
    """An operator asks for a window (``lockstep trigger``). Key: ``job``, on the heartbeats topic.

    It travels on the heartbeats topic so that it reaches the detector that owns
    the job's state (its partition); the answer is a ``ProfileTrigger`` or a
    ``TriggerRefused`` on the control topic carrying the same ``request``.
    """

    job: Name
    request: Name  # unique id of this request
    steps: Annotated[int, msgspec.Meta(ge=1, le=10_000)] | None = None  # None: the policy's length for the job
    reason: str = ""
    requested_by: str = ""  # user@host
    requested_at: Timestamp = 0.0


#: why the detector refused a window
RefusalCode = Literal["excluded", "unknown_job", "ended", "too_long", "job_limit", "cooldown", "fleet_limit"]


class TriggerRefused(_Record, tag="TriggerRefused", kw_only=True):
    """The detector's answer to a ``TriggerRequest`` it refused. Key: ``job``, on the control topic."""

    job: Name
    request: Name
    code: RefusalCode
    reason: str  # one line, for people
    policy: str = "default"
    policy_hash: str = ""
    at: Timestamp = 0.0


class DetectorTick(_Record, tag="DetectorTick", kw_only=True):
    """Internal: the detector's timer asks it to check a silent job for a hang. Key: ``job``, on the heartbeats topic."""

    job: Name
    at: Timestamp = 0.0


#: what older senders may still send, read until the version named (docs/contracts.md: Deprecated); new senders
#: use what each entry names instead
DEPRECATED: dict[str, tuple[str, str]] = {
    "StepHeartbeat keyed by job": ("0.2", "HeartbeatBatch keyed job/shard (heartbeat_shard_workers > 0)"),
    "FeatureBatch": ("0.2", "WindowFeatures, one per worker and window"),
    "DetectorTick": ("0.2", "the detect stage's own timer"),
    "detector rule median": ("0.2", "rule cusum (the default)"),
}


#: what a worker's hardware sampler could see: NVML (GPU and host), the host only, or nothing
HardwareSeen = Literal["nvml", "host", "none"]


class FeatureBatch(_Record, tag="FeatureBatch", kw_only=True):
    """One worker's summary of one step of a window.  Key: ``job:step``.

    ``functions`` is an Arrow IPC stream holding the function table
    (:mod:`lockstep.schemas.functions`), compressed with ``functions_codec``.
    """

    job: Name
    window: Name
    step: Step
    window_start: Step
    window_steps: WindowSteps
    expected_workers: Workers
    worker: WorkerMeta
    step_time_us: float
    functions: bytes
    functions_codec: Literal["zstd", "none"] = "zstd"
    hardware: HardwareSeen = "none"  # what the sampler could see
    policy: str = "default"
    sent_at: Timestamp = 0.0
    tenant: str = ""

    def validate(self) -> None:
        _finite("step_time_us", self.step_time_us)
        if self.step_time_us <= 0:
            raise RecordError("invalid", f"step_time_us must be > 0, got {self.step_time_us}")
        if not self.window_start <= self.step < self.window_start + self.window_steps:
            raise RecordError(
                "invalid",
                f"step {self.step} lies outside window {self.window} "
                f"[{self.window_start}, {self.window_start + self.window_steps})",
            )


#: the most TCP connections one worker's window carries (those that sent most, where it has more)
MAX_CONNECTIONS = 256
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]  # "address:port"


class Connection(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One TCP connection of the worker's training process over a window, from the kernel's ``tcp_info``: a row of
    the connection table (:data:`lockstep.schemas.events.CONNECTION_SCHEMA`, which adds the worker)."""

    local: Endpoint
    peer: Endpoint
    segs_out: NonNegInt  # data segments it sent in the window
    retrans: NonNegInt  # ... and sent again
    bytes_sent: NonNegInt | None = None
    rtt_us: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] | None = None  # smoothed RTT at the window's end
    min_rtt_us: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] | None = None
    busy_us: NonNegInt | None = None  # time with data in flight (linux >= 4.10)
    rwnd_limited_us: NonNegInt | None = None  # ... of it held back by the peer's receive window
    sndbuf_limited_us: NonNegInt | None = None  # ... of it held back by the sender's own buffer


class WindowFeatures(_Record, tag="WindowFeatures", kw_only=True):
    """One worker's summary of the steps of a window it profiled, in one record.  Key: ``job:window:shard``
    (:func:`lockstep.kafka.window_features_key`), topic ``<prefix>.windowfeatures``.

    ``functions`` is a window table (:data:`lockstep.schemas.functions.WINDOW_SCHEMA`, Arrow IPC compressed with
    ``functions_codec``): one row per (step, function) of the steps in ``steps``, function names dictionary-encoded
    once, only the columns the diagnosis reads.  The worker belongs to shard ``worker.rank // shard_workers``: the
    processor collects a shard's records and hands each step of the shard on as one columnar ``StepSlice``.
    ``FeatureBatch`` (one worker, one step) stays readable.
    """

    job: Name
    window: Name
    window_start: Step
    window_steps: WindowSteps
    expected_workers: Workers
    shard: Rank  # worker.rank // shard_workers
    shard_workers: ShardWorkers = SHARD_WORKERS
    worker: WorkerMeta
    steps: Annotated[list[Step], msgspec.Meta(min_length=1, max_length=10_000)]  # the steps summarised, ascending
    step_time_us: list[float]  # of each step in ``steps``
    functions: bytes
    functions_codec: Literal["zstd", "none"] = "zstd"
    hardware: Literal["nvml", "host", "none"] = "none"  # what the sampler could see
    policy: str = "default"
    sent_at: Timestamp = 0.0
    tenant: str = ""
    # added with issue 21: the worker's TCP connections over the window (empty where its agent could not read them)
    connections: Annotated[list[Connection], msgspec.Meta(max_length=MAX_CONNECTIONS)] = []

    def validate(self) -> None:
        if len(self.step_time_us) != len(self.steps):
            raise RecordError("invalid", f"{len(self.steps)} steps but {len(self.step_time_us)} step times")
        for x in self.step_time_us:
            _finite("step_time_us", x)
            if x <= 0:
                raise RecordError("invalid", f"step_time_us must be > 0, got {x}")
        end = self.window_start + self.window_steps
        if (
            self.steps[0] < self.window_start
            or self.steps[-1] >= end
            or any(a >= b for a, b in zip(self.steps, self.steps[1:]))
        ):
            raise RecordError("invalid", f"steps must ascend inside window {self.window} [{self.window_start}, {end})")
        if self.shard != self.worker.rank // self.shard_workers:
            raise RecordError(
                "invalid",
                f"worker {self.worker.rank} is in shard {self.worker.rank // self.shard_workers}, not {self.shard}",
            )


class StepSlice(_Record, tag="StepSlice", kw_only=True):
    """Internal: one step of a shard's workers, columnar, from the shard stage to the step stage.  Key: ``job:step``,
    on the features topic (where the step's ``FeatureBatch``es from agents that send those meet it).

    ``workers`` (Arrow IPC, zstd; :data:`lockstep.streams.diagnosis.frame.WORKER_SCHEMA`): one row per worker, its
    metadata, step time and how many rows it has in ``functions`` (a compact function table, the workers' rows in
    that order).  ``missing``: workers of the shard that sent no features for this step (the step stage counts them
    as accounted for, so a step does not wait for what will not come).
    """

    job: Name
    window: Name
    step: Step
    window_start: Step
    window_steps: WindowSteps
    expected_workers: Workers
    shard: Rank
    missing: Annotated[list[Rank], msgspec.Meta(max_length=100_000)] = []
    bytes_in: NonNegInt = 0  # the agents' bytes for these workers and this step
    workers: bytes
    functions: bytes
    functions_codec: Literal["zstd", "lz4"] = "zstd"  # lz4: one block of ``functions_size`` bytes
    functions_size: Annotated[int, msgspec.Meta(ge=0, le=64 << 20)] = 0
    policy: str = "default"
    tenant: str = ""
    # added after the first slices: the missing workers as inclusive ``[first, last]`` ranges, ascending and disjoint (a shard's
    # missing members come in runs: a host, a rack, everyone after a crash).  Newer writers send these, and
    # ``missing`` only when it names at most MAX_NAMED_MISSING workers (what older readers see); a reader takes both
    missing_ranges: Annotated[list[tuple[Rank, Rank]], msgspec.Meta(max_length=MAX_MISSING_RANGES)] = []
    # added with issue 21: the TCP connections of the workers whose first summarised step this is (an Arrow IPC
    # stream, CONNECTION_SCHEMA; empty: none): each worker's once per window, on the way to the window stage
    connections: bytes = b""

    def validate(self) -> None:
        if not self.window_start <= self.step < self.window_start + self.window_steps:
            raise RecordError("invalid", f"step {self.step} lies outside window {self.window}")
        covered, last = 0, -1
        for first, end in self.missing_ranges:
            if not last < first <= end:
                raise RecordError(
                    "invalid", f"missing_ranges: [{first}, {end}] is empty, or not after the range before it"
                )
            covered += end - first + 1
            last = end
        if covered > MAX_MISSING_RANKS:
            raise RecordError("invalid", f"missing_ranges cover {covered} workers, over {MAX_MISSING_RANKS}")

    def missing_workers(self) -> list[int]:
        """Every worker the slice says sent nothing: ``missing`` and ``missing_ranges`` together (at most
        MAX_MISSING_RANKS from the ranges, which validate() checked)."""
        out = list(self.missing)
        for first, end in self.missing_ranges:
            out.extend(range(first, end + 1))
        return out


def ranks_as_ranges(ranks: npt.ArrayLike) -> list[tuple[int, int]]:
    """Ascending distinct ranks as inclusive ``(first, last)`` runs: ``[0, 1, 2, 5, 7, 8]`` -> ``[(0, 2), (5, 5), (7, 8)]``."""
    r = np.asarray(ranks, dtype=np.int64)
    if not r.size:
        return []
    breaks = np.flatnonzero(np.diff(r) != 1)
    firsts = np.concatenate(([r[0]], r[breaks + 1]))
    lasts = np.concatenate((r[breaks], [r[-1]]))
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


class RawRequest(_Record, tag="RawRequest", kw_only=True):
    """Ask named workers for a slice of their retained raw profiler trace.  Topic: control, key ``job``.

    Each named worker answers with one :class:`RawTrace` on the raw topic (an empty
    one with ``error`` set when it has nothing to send).
    """

    job: Name
    request: Name  # id of this request, echoed in every answer
    workers: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=100_000)]
    window: str = ""  # window whose trace is wanted; "" = the last window the worker retained
    steps: list[NonNegInt] = []  # steps to include; [] = every step of the window
    max_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 << 20)] = 512 << 10  # bound on each compressed answer
    created_at: float = 0.0
    tenant: str = ""


class RawTrace(_Record, tag="RawTrace", kw_only=True):
    """One worker's answer to a :class:`RawRequest`.  Topic: raw, key ``job``.

    ``trace`` is a Chrome-trace JSON object (the profiler's own format, redacted like
    everything that leaves the host) compressed with ``codec``; it holds the events
    of ``steps`` that fitted into the request's ``max_bytes``, longest first.
    """

    job: Name
    request: Name
    window: str
    worker: Rank
    host: str = ""
    steps: list[NonNegInt] = []
    events: NonNegInt = 0  # events in the slice
    events_total: NonNegInt = 0  # events of those steps in the retained trace
    truncated: bool = False  # some events of the steps did not fit into max_bytes
    trace: bytes = b""
    codec: Literal["zstd"] = "zstd"
    redaction: str = ""  # redaction applied before upload, e.g. "paths=strip,stacks=drop,names=keep"
    error: str = ""  # why nothing was sent (no retained window, unknown window, ...)
    sent_at: float = 0.0
    tenant: str = ""


class Evidence(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What deviated, by how much, against which peers.  ``None``: not measured."""

    feature: str
    value: float | None
    peer_value: float | None
    deviation: float | None  # robust z-score for work_us; relative change (value/peer - 1) otherwise


class Impact(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    step_time_share: float  # share of the step that fixing the finding would save (0..1)
    gpu_hours_per_day: float


#: what a job's workers compute on, as their agents found it: ``cpu`` no accelerator (an agent that finds no CUDA
#: device names its worker's device ``<host>/cpu``), ``gpu`` an accelerator, ``""`` not known (records from before it)
DeviceKind = Literal["", "gpu", "cpu"]


def device_kind_of(devices: Iterable[str]) -> DeviceKind:
    """The kind of the workers whose devices these are: ``cpu`` when every one is its host's CPU (``<host>/cpu``,
    ``cpu``), ``gpu`` when any is another device, ``""`` when none is named."""
    named = [d for d in devices if d]
    if not named:
        return ""
    return "cpu" if all(d == "cpu" or d.endswith("/cpu") for d in named) else "gpu"


class Finding(_Record, tag="Finding", kw_only=True):
    """A diagnosed anomaly.  Key: ``job``.  Also the ``--json`` shape of every command."""

    id: str
    job: Name
    window: Name
    steps: list[Step]  # steps of the window in which the deviation was seen
    scope: Literal["worker", "group", "job"]
    workers: list[Rank]
    hosts: list[str]
    devices: list[str]
    group: dict[str, str] | None = None
    function: str
    function_kind: str
    cause: str
    confidence: Fraction
    evidence: list[Evidence]
    impact: Impact
    policy: str
    created_at: Timestamp
    tenant: str = ""
    summary: str = ""
    window_steps: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = (
        0  # how many steps the window had (persistence = len(steps)/window_steps)
    )
    # added after the first findings: what the job's workers compute on (their agents' devices): ``cpu`` makes the
    # impact's hours CPU-hours (``gpu_hours_per_day`` keeps its name: the job's devices' hours); "" older windows
    device_kind: DeviceKind = ""

    def validate(self) -> None:
        if self.scope not in SCOPES:
            raise RecordError("invalid", f"scope must be one of {SCOPES}")
        _finite("impact.step_time_share", self.impact.step_time_share)
        _finite("impact.gpu_hours_per_day", self.impact.gpu_hours_per_day)


class StepReport(_Record, tag="StepReport", kw_only=True):
    """Internal: the step stage's reduction of one step for the window stage. Key: ``job``.

    ``outliers`` and ``groups`` are Arrow IPC streams (zstd), see
    :mod:`lockstep.streams.diagnosis.step`.
    """

    job: Name
    window: Name
    step: Step
    window_start: Step
    window_steps: WindowSteps
    expected_workers: Workers
    workers_seen: Count
    bytes_in: NonNegInt  # feature bytes received for this step
    step_time_us: float  # synchronised step time: the slowest worker's
    step_time_median_us: float
    work_max_us: float  # most work (step minus waits) of any worker; NaN if unknown
    healthy_work_max_us: float  # most work of any worker with no deviating function
    outliers: bytes
    groups: bytes
    policy: str = "default"
    tenant: str = ""
    closed: StepClosed = "complete"
    # added after the first step reports: the expected workers (ranks 0..expected_workers-1) that delivered nothing for the step
    # (the first MAX_NAMED_MISSING), and how many
    missing: Annotated[list[Rank], msgspec.Meta(max_length=MAX_NAMED_MISSING)] = []
    missing_total: Count = 0
    # added with issue 21: every worker's own work against its peers' (an Arrow IPC stream, WORKER_SCHEMA of
    # lockstep.streams.diagnosis.step; empty from a step stage older than the localisation)
    workers: bytes = b""
    # added with issue 21: the step's slices' TCP connections (an Arrow IPC stream, CONNECTION_SCHEMA; empty: none)
    connections: bytes = b""


class WindowTimeout(_Record, tag="WindowTimeout", kw_only=True):
    """Internal: ask the window stage to close a window that waited too long. Key: ``job``."""

    job: Name
    window: Name


class WindowRefused(_Record, tag="WindowRefused", kw_only=True):
    """Internal: every expected worker refused the window's trigger (their agents echoed why, on their heartbeats):
    the detect stage asks the window stage to close it now, ``failed`` with the reasons, instead of at its deadline.
    Key: ``job``, on the step reports topic (after the window's ``WindowExpected``)."""

    job: Name
    window: Name
    expected_workers: Workers
    reasons: Annotated[
        dict[AgentRefusal, Count], msgspec.Meta(max_length=16)
    ]  # refusal -> workers that gave it (``past``, ``overlap``)
    start_step: Step = 0
    retry: bool = False  # the detector may open another window for the same slowdown at once (not after a cool-down)
    at: Timestamp = 0.0


#: how a profiling window ended: every step reported (``complete``), not every step by the window stage's timeout
#: (``timeout``), or something went wrong that the window's report names in ``closed_reason`` (``failed``: invalid
#: step reports, no step report at all by the trigger's deadline, a bug in the diagnosis)
Closed = Literal["complete", "timeout", "failed"]


class WindowExpected(_Record, tag="WindowExpected", kw_only=True):
    """Internal: the detect stage tells the window stage that it triggered a window, so that the window ends in a
    ``WindowReport`` even if no step report ever comes (``failed`` once ``deadline`` passed).  Key: ``job``, on the
    step reports topic (the window's own partition there)."""

    job: Name
    window: Name
    start_step: Step
    steps: WindowSteps
    expected_workers: Workers
    kind: Literal["slowdown", "hang", "manual", "baseline"] = "slowdown"
    policy: str = "default"  # the trigger's policy_ref (id@hash)
    tenant: str = ""
    created_at: Timestamp = 0.0
    deadline: Timestamp = 0.0  # processor clock: by then its workers should have profiled and sent every step

    def validate(self) -> None:
        _finite("deadline", self.deadline)


class WindowReport(_Record, tag="WindowReport", kw_only=True):
    """The observability budget of one closed profiling window. Key: ``job``."""

    job: Name
    window: Name
    start_step: Step
    steps: WindowSteps
    steps_seen: Annotated[int, msgspec.Meta(ge=0, le=10_000)]
    expected_workers: Workers
    workers_seen: Count  # most workers seen in any step of the window
    coverage: Fraction  # share of expected workers that delivered features, over all the window's steps (a missing step counts 0)
    bytes_per_worker: float
    findings: Count
    actionable: bool  # at least one finding with a cause (not ``unknown``, not ``undetermined``)
    reached_device: bool  # at least one finding names a device
    closed: Closed
    closed_at: Timestamp
    policy: str = "default"
    tenant: str = ""
    #: training progress lost while profiling, as a share of the window's step time; None until measured
    profiling_overhead: float | None = None
    #: why a window closed ``failed`` or ``timeout`` (one line, for people); "" when it closed ``complete``
    closed_reason: str = ""
    # added after the first window reports: the expected workers missing from any step of the window that reported (they refused the
    # trigger, were late or failed; the first MAX_NAMED_MISSING), and how many: a window with any is never
    # ``complete`` (a step that no report came for is the window's ``timeout``, not attributed to workers)
    missing_workers: Annotated[list[Rank], msgspec.Meta(max_length=MAX_NAMED_MISSING)] = []
    missing_total: Count = 0

    def validate(self) -> None:
        _finite("bytes_per_worker", self.bytes_per_worker)
        if self.profiling_overhead is not None:
            _finite("profiling_overhead", self.profiling_overhead)


#: points of a StepSeries, cells of a DeviationMap: bounds that keep either record small
MAX_SERIES_POINTS = 4096
MAX_MAP_WORKERS = 64
MAX_MAP_FUNCTIONS = 32


class StepSeries(_Record, tag="StepSeries", kw_only=True):
    """A job's step times for the pictures, compact: per step, the synchronised step time (the slowest
    worker's), the workers' median and how many workers reported it.  Key: ``job``; topic ``<prefix>.series``.

    The processor publishes the steps it saw every few seconds; the sink keeps them in ``step_series``.
    """

    job: Name
    tenant: str = ""
    steps: Annotated[list[Step], msgspec.Meta(min_length=1, max_length=MAX_SERIES_POINTS)]
    step_time_us: list[float]  # the slowest worker's step time
    median_us: list[float]  # the workers' median step time
    workers: list[Count]  # workers that reported the step
    sent_at: Timestamp = 0.0

    def validate(self) -> None:
        n = len(self.steps)
        if not len(self.step_time_us) == len(self.median_us) == len(self.workers) == n:
            raise RecordError("invalid", "steps, step_time_us, median_us and workers must have the same length")
        for name in ("step_time_us", "median_us"):
            for x in getattr(self, name):
                _finite(name, x)
                if not 0 < x < 1e15:
                    raise RecordError("invalid", f"{name} must be in (0, 1e15) µs, got {x}")


class DeviationMap(_Record, tag="DeviationMap", kw_only=True):
    """A window's worst workers x functions by deviation from their peers, for the heatmap.  Key: ``job``;
    topic ``<prefix>.series``.

    ``z[i][j]`` is the median, over the steps in which worker ``workers[i]`` was flagged in function
    ``functions[j]``, of its robust z-score against its peer group (positive: slower than its peers);
    None where it was never flagged (within its peers' spread).  ``flagged[i][j]`` counts those steps.
    At most 64 workers and 32 functions: the worst, of ``workers_total`` and ``functions_total``.
    """

    job: Name
    window: Name
    tenant: str = ""
    start_step: Step
    steps: WindowSteps
    workers: Annotated[list[Rank], msgspec.Meta(max_length=MAX_MAP_WORKERS)]
    functions: Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=MAX_MAP_FUNCTIONS)]
    z: list[list[float | None]]
    flagged: list[list[NonNegInt]]
    workers_total: Count = 0  # workers with a flagged cell in the window
    functions_total: Count = 0  # functions with a flagged cell in the window
    created_at: Timestamp = 0.0

    def validate(self) -> None:
        shape = (len(self.workers), len(self.functions))
        for name in ("z", "flagged"):
            rows = getattr(self, name)
            if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows):
                raise RecordError("invalid", f"{name} must be {shape[0]} rows of {shape[1]} values")
        for row in self.z:
            for x in row:
                if x is not None:
                    _finite("z", x)


#: what a JobChange says: a slowdown was profiled; its step time is back at the level before it; the job ended
JobChangeKind = Literal["slowdown", "recovered", "ended"]
#: how a job ended: every worker sent its final heartbeat, or a final heartbeat came and then silence past the hang bound
JobEnd = Literal["final", "silent"]


class JobChange(_Record, tag="JobChange", kw_only=True):
    """The detector's news of a job for the sink's incidents.  Key: ``job``; topic ``<prefix>.series``.

    ``slowdown``: a window (``window``) was opened for a slowdown that began at ``onset_step`` (``onset_at``, the
    processor's clock, estimated from the job's pace), when the step time went from ``before_s`` to ``during_s``.
    ``recovered``: the median of the ``steps`` steps up to ``step`` is back at ``after_s``, within half the
    slowdown threshold of ``before_s`` (the onset's fields repeated).  ``ended``: the job ended at step ``step``
    (``end``: how the detector knows).  The detector may send one again (a replay after a restart): the sink's
    effects are idempotent.
    """

    job: Name
    tenant: str = ""
    change: JobChangeKind
    step: Step  # slowdown: the last step seen when the window was opened; recovered: the last step back; ended: the last step
    window: str = ""  # slowdown, recovered: the window opened for the slowdown
    onset_step: Step = 0
    onset_at: Timestamp = 0.0
    before_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] = 0.0  # median step time before the onset
    during_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] = 0.0  # the slowdown's level
    after_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1e9)] = 0.0  # recovered: the level back; ended: the last steps'
    steps: Count = 0  # recovered: the steps whose median is after_s
    end: JobEnd | None = None  # ended: how
    reason: str = ""  # one line, for people
    at: Timestamp = 0.0  # the processor's clock


#: the most bytes a HangReport may have (its stack is cut from the outermost frame to fit)
MAX_HANG_REPORT_BYTES = 16 << 10
#: frames of a HangReport's stack at most
MAX_HANG_FRAMES = 64


class HangReport(_Record, tag="HangReport", kw_only=True):
    """One worker's answer to a hang window's trigger (``ProfileTrigger`` of kind ``hang``): where its training thread
    is, taken from a thread of the agent's own while the training thread is stuck.  Key: ``job``, on the hangs topic.

    ``frame`` and ``region`` are function names (redacted as feature records' are); ``stack`` (innermost first) is
    empty unless the agent's redaction keeps stacks.  ``collective*``: the last ``torch.distributed`` call the agent
    saw this process enter (``collective_open``: it has not returned), its sequence number among this process's calls
    on that process group, and the group.  ``host_workers``: the ranks the agent knows to share its host (torchrun's
    ``LOCAL_WORLD_SIZE``), which tells a worker that did not answer from a host that is gone; ``exited``: those of them
    whose process has exited (each agent registers its process in its host's run directory when it attaches)."""

    job: Name
    window: Name
    worker: Rank
    host: Name
    expected_workers: Workers
    device: str = ""
    tenant: str = ""
    last_step: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] = -1  # the last step it completed (-1: none)
    thread: Literal["found", "gone", "unknown"] = "found"  # whether the training thread was found
    frame: str = ""  # the training thread's innermost Python frame, "file.py(line): function"
    region: str = ""  # the innermost record_function region open on the training thread
    stack: Annotated[list[str], msgspec.Meta(max_length=MAX_HANG_FRAMES)] = []
    collective: str = ""  # e.g. "all_reduce"; "" if none was seen
    collective_seq: NonNegInt = 0
    collective_group: str = ""
    collective_open: bool = False
    host_workers: Annotated[list[Rank], msgspec.Meta(max_length=4096)] = []
    # workers of its host whose process the agent saw gone (registered at attach, not closed, no longer running)
    exited: Annotated[list[Rank], msgspec.Meta(max_length=4096)] = []
    truncated: bool = False  # frames were left out to stay within MAX_HANG_REPORT_BYTES
    sent_at: Timestamp = 0.0
    # why it was sent: ``hang``, the answer to a hang trigger; ``exit``, the agent closes (its training thread ended,
    # e.g. on a collective's error) and saw workers of its host exit before it without closing (``exited``); the
    # window is then ``exit-r<rank>-p<pid>`` of the first of them, and only its host's workers are expected
    reason: Literal["hang", "exit"] = "hang"


class DeadLetter(_Record, tag="DeadLetter", kw_only=True):
    """A record a stage could not accept, with the reason. Key: the original key."""

    topic: str
    partition: int
    offset: int
    reason: str
    detail: str
    stage: str
    payload: bytes  # the original value, cut to 64 KiB
    at: float


RECORD_TYPES: dict[str, type[_Record]] = {
    cast(str, t.__struct_config__.tag): t
    for t in (
        StepHeartbeat,
        HeartbeatBatch,
        StepPartial,
        ProfileTrigger,
        FeatureBatch,
        WindowFeatures,
        StepSlice,
        Finding,
        StepReport,
        WindowTimeout,
        WindowExpected,
        WindowRefused,
        WindowReport,
        DeadLetter,
        TriggerRequest,
        TriggerRefused,
        DetectorTick,
        RawRequest,
        RawTrace,
        StepSeries,
        DeviationMap,
        JobChange,
        HangReport,
    )
}
#: versions of each record this build reads
SUPPORTED_VERSIONS: dict[str, frozenset[int]] = {name: frozenset({1}) for name in RECORD_TYPES}
BINARY_RECORDS = frozenset({"FeatureBatch", "WindowFeatures", "StepSlice", "StepReport", "RawTrace"})

Record = (
    StepHeartbeat
    | HeartbeatBatch
    | StepPartial
    | ProfileTrigger
    | FeatureBatch
    | WindowFeatures
    | StepSlice
    | Finding
    | StepReport
    | WindowTimeout
    | WindowExpected
    | WindowRefused
    | WindowReport
    | DeadLetter
    | TriggerRequest
    | TriggerRefused
    | DetectorTick
    | RawRequest
    | RawTrace
    | StepSeries
    | DeviationMap
    | JobChange
    | HangReport
)


# --------------------------------------------------------------------------- codec


class _Header(msgspec.Struct, forbid_unknown_fields=False):
    schema: str
    v: int = 1


def _numpy_scalar(obj: object) -> object:
    """numpy scalars (np.str_, np.int64, ...) that a vectorised stage left in a record encode as their values."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_json_enc = msgspec.json.Encoder(enc_hook=_numpy_scalar)
_mp_enc = msgspec.msgpack.Encoder(enc_hook=_numpy_scalar)
_json_header = msgspec.json.Decoder(_Header)
_mp_header = msgspec.msgpack.Decoder(_Header)
_json_dec = {name: msgspec.json.Decoder(t) for name, t in RECORD_TYPES.items()}
_mp_dec = {name: msgspec.msgpack.Decoder(t) for name, t in RECORD_TYPES.items()}


def encode(record: _Record) -> bytes:
    """Serialise a record: MessagePack for records with binary payloads, JSON otherwise."""
    if record.__struct_config__.tag in BINARY_RECORDS:
        return _mp_enc.encode(record)
    return _json_enc.encode(record)


#: the largest record any stage reads (Kafka's default record limit is 1 MiB; a window's raw-trace
#: answer is at most 16 MiB): anything larger is refused before it is parsed
MAX_RECORD_BYTES = 32 << 20


R = TypeVar("R", bound=_Record)
R2 = TypeVar("R2", bound=_Record)
R3 = TypeVar("R3", bound=_Record)
R4 = TypeVar("R4", bound=_Record)
R5 = TypeVar("R5", bound=_Record)


# ``decode(data, FeatureBatch)`` is a FeatureBatch, ``decode(data, (StepReport, WindowTimeout))`` one of the two
@overload
def decode(data: bytes | None, expect: type[R]) -> R: ...
@overload
def decode(data: bytes | None, expect: tuple[type[R]]) -> R: ...
@overload
def decode(data: bytes | None, expect: tuple[type[R], type[R2]]) -> R | R2: ...
@overload
def decode(data: bytes | None, expect: tuple[type[R], type[R2], type[R3]]) -> R | R2 | R3: ...
@overload
def decode(data: bytes | None, expect: tuple[type[R], type[R2], type[R3], type[R4]]) -> R | R2 | R3 | R4: ...
@overload
def decode(
    data: bytes | None, expect: tuple[type[R], type[R2], type[R3], type[R4], type[R5]]
) -> R | R2 | R3 | R4 | R5: ...
@overload
def decode(data: bytes | None, expect: tuple[type[R], ...]) -> R: ...
@overload
def decode(data: bytes | None, expect: None = None) -> Record: ...
def decode(data: bytes | None, expect: type[_Record] | tuple[type[_Record], ...] | None = None) -> _Record:
    """Parse and validate one record of the ``expect``-ed type(s) (any without).  Raises :class:`RecordError`
    only, whatever the bytes: ``wrong_record`` for a valid record of another type."""
    if not data:
        raise RecordError("malformed", "empty value")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(
            "malformed", f"record of {len(data)} bytes, over the {MAX_RECORD_BYTES} bytes any record may have"
        )
    try:
        return _decode(data, expect)
    except RecordError:
        raise
    except RecursionError:  # msgspec bounds its own recursion: a record nested deeper than any of ours
        raise RecordError("malformed", "nested too deeply to be a Lockstep record") from None
    except Exception as exc:
        raise RecordError("malformed", f"unreadable record ({type(exc).__name__}: {exc})") from None


def _decode(data: bytes, expect: type[_Record] | tuple[type[_Record], ...] | None) -> _Record:
    is_json = data[:1] in (b"{", b" ", b"\n", b"\t", b"\r")
    try:
        header = (_json_header if is_json else _mp_header).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError("malformed", f"not a Lockstep record ({exc})") from None
    if header.schema not in RECORD_TYPES:
        raise RecordError("unknown_schema", f"unknown record schema {header.schema[:64]!r}")
    if header.v not in SUPPORTED_VERSIONS[header.schema]:
        supported = sorted(SUPPORTED_VERSIONS[header.schema])
        raise RecordError(
            "unsupported_version",
            f"{header.schema} version {header.v} is not supported (this build reads {supported}); "
            "upgrade the consumer or downgrade the producer",
        )
    try:
        record = (_json_dec if is_json else _mp_dec)[header.schema].decode(data)
    except msgspec.ValidationError as exc:  # missing field, wrong type, value out of range
        raise RecordError("invalid", f"{header.schema}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RecordError("malformed", f"{header.schema}: {exc}") from None
    if expect is not None and not isinstance(record, expect):
        names = [t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,))]
        raise RecordError("wrong_record", f"expected {' or '.join(names)}, got {header.schema}")
    record.validate()
    return record


def dead_letter(
    *, topic: str, partition: int, offset: int, error: RecordError, stage: str, payload: bytes | None
) -> DeadLetter:
    return DeadLetter(
        topic=topic,
        partition=partition,
        offset=offset,
        reason=error.reason,
        detail=error.detail[:2000],
        stage=stage,
        payload=(payload or b"")[:65536],
        at=time.time(),
    )


def finding_id(
    job: str, window: str, scope: str, workers: list[int], function: str, cause: str, group: dict[str, str] | None
) -> str:
    """Deterministic: the same diagnosis of the same window always gets the same id."""
    parts = [job, window, scope, ",".join(map(str, sorted(workers))), function, cause]
    if group:
        parts.append(",".join(f"{k}={group[k]}" for k in sorted(group)))
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


def to_builtins(record: msgspec.Struct) -> dict[str, Any]:
    """The record as plain JSON-able values (the ``--json`` shape)."""
    return cast("dict[str, Any]", msgspec.to_builtins(record))
