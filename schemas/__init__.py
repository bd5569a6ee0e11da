"""Versioned record contracts shared by every stage (see records.py and functions.py)."""

from .records import (  # noqa: F401
    DEAD_LETTER_REASONS,
    FUNCTION_KINDS,
    DeadLetter,
    Evidence,
    FeatureBatch,
    Finding,
    Impact,
    ProfileTrigger,
    RecordError,
    Sampling,
    StepHeartbeat,
    StepReport,
    WindowReport,
    WindowTimeout,
    WorkerMeta,
    decode,
    encode,
    finding_id,
    to_builtins,
)
