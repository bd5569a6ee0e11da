"""The processor's stages as plain objects: fed records, timer ticks and partition changes, writing to an Output.

- :class:`HeartbeatStage` heartbeats of a job's shards -> one partial per shard and step, columnar -> step partials
- :class:`DetectStage`  step partials -> slowdown detector -> triggers (and the step-time series)
- :class:`ShardStage`   workers' window features -> a shard's workers per step, columnar -> step slices
- :class:`StepStage`    feature batches and step slices -> step assembly + analysis -> step reports
- :class:`WindowStage`  step reports -> window assembly + diagnosis -> findings, window reports, deviation maps
- :class:`HangStage`    agents' answers to a hang trigger -> hang diagnosis -> findings

No faust and no Kafka client in here: :mod:`lockstep.streams.app` is the faust adapter, and
:class:`MemoryOutput` runs the stages in memory.
"""

from .base import Output, Partition, Policies, RecordIn, Stage
from .detect import DetectStage
from .hang import HangStage
from .heartbeat import HeartbeatStage
from .memory import MemoryOutput
from .processor import Processor, Tables
from .shard import ShardStage
from .step import StepStage
from .window import WindowStage

__all__ = [
    "DetectStage",
    "HangStage",
    "HeartbeatStage",
    "MemoryOutput",
    "Output",
    "Partition",
    "Policies",
    "Processor",
    "RecordIn",
    "ShardStage",
    "Stage",
    "StepStage",
    "Tables",
    "WindowStage",
]
