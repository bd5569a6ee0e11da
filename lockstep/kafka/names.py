"""The pipeline's topic names and record keys.  Pure (no Kafka client): the stream stages import it, and
``import lockstep.streams.stages`` loads no Kafka client (``tests/streams/test_stages_pure.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topics:
    """Every topic of the pipeline, with its key."""

    heartbeats: str  # HeartbeatBatch, key job/shard; StepHeartbeat, TriggerRequest, key job
    control: str  # ProfileTrigger, RawRequest, key job
    features: str  # FeatureBatch, key job:step; StepSlice (internal, from the shard stage), key job:step
    stepreports: str  # StepReport / WindowTimeout / WindowExpected (internal), key job
    findings: str  # Finding, key job
    windows: str  # WindowReport, key job
    deadletter: str  # DeadLetter, key: the original key
    raw: str  # RawTrace (answers to a RawRequest on control), key job
    series: str  # StepSeries, DeviationMap (the pictures: step times, deviation maps), key job
    windowfeatures: str  # WindowFeatures (one worker's window), key job:window:shard
    #: StepPartial (internal: a shard's heartbeats of a step), DetectorTick, TriggerRequest (passed on); key job
    partials: str
    hangs: str  # HangReport (agents' answers to a hang window's trigger), key job

    @classmethod
    def named(cls, prefix: str = "lockstep") -> Topics:
        return cls(**{f: f"{prefix}.{f}" for f in cls.__dataclass_fields__})

    def all(self) -> list[str]:
        return [getattr(self, f) for f in self.__dataclass_fields__]


def features_key(job: str, step: int) -> bytes:
    return f"{job}:{step}".encode()


def heartbeat_key(job: str, shard: int) -> bytes:
    """A ``HeartbeatBatch``: a job's heartbeats spread over partitions by worker shard (``worker // shard_workers``)."""
    return f"{job}/{shard}".encode()


def window_features_key(job: str, window: str, shard: int) -> bytes:
    """A worker's ``WindowFeatures``: the workers of one shard meet in one partition, a window's shards spread."""
    return f"{job}:{window}:{shard}".encode()
