"""What a record's step and clock can plausibly be: the "from the future" rule, written once.

Steps and clocks from the future poison a job's state (a step 10^9 ahead would schedule its windows at steps
never reached and complete every real step early; a ``sent_at`` years ahead would hide every later restart), so
such records are refused before they touch it.  The detector checks one record at a time against a job, the
heartbeat stage a batch of rows against a shard: both call :func:`future` (arrays; a scalar is an array of one).
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import numpy.typing as npt

#: a new heartbeat this many steps behind the job is a restart (from a checkpoint), not a late record
RESTART_STEPS = 16
#: a heartbeat more steps than this beyond the job's highest step (plus what its pace allows since it was
#: last heard) is from the future: a forged or corrupted record, not progress
FUTURE_STEPS = 1000
#: ... the pace allowance: this many times the job's own wall-clock step rate
FUTURE_PACE = 10.0
#: a heartbeat whose clock is more than this ahead of the processor's is from a broken clock
FUTURE_CLOCK_S = 86_400.0


class Shown(Protocol):
    """What a job (or a shard) has shown: its highest step (below 0: none yet), when it was last heard
    (processor clock), and its wall-clock seconds per step (NaN while unknown; asked only when needed)."""

    @property
    def highest(self) -> int: ...

    @property
    def last_seen_at(self) -> float: ...

    def interval_s(self) -> float: ...


def allowed_steps(progress: Shown, now: float) -> float:
    """Steps beyond ``progress.highest`` a record may be: ``FUTURE_STEPS`` plus ``FUTURE_PACE`` times the steps
    the job's pace allows since it was last heard (never less than ``FUTURE_STEPS``)."""
    interval = progress.interval_s()
    pace = FUTURE_PACE * (now - progress.last_seen_at) / interval if math.isfinite(interval) and interval > 0 else 0.0
    return FUTURE_STEPS + max(0.0, pace)


def clock_ahead(sent_at: npt.ArrayLike, now: float) -> npt.NDArray[np.bool_]:
    """Rows whose clock is more than ``FUTURE_CLOCK_S`` ahead of the processor's."""
    return np.asarray(sent_at) > now + FUTURE_CLOCK_S


def future(step: npt.ArrayLike, sent_at: npt.ArrayLike, now: float, progress: Shown | None) -> npt.NDArray[np.bool_]:
    """Rows no real worker can have sent: a clock a day ahead, or a step far beyond what ``progress`` has shown.
    With nothing shown yet (``progress`` None or its highest below 0) a batch of rows is judged against its own
    median; a single row can be any step."""
    steps = np.asarray(step)
    bad = clock_ahead(sent_at, now)
    if progress is not None and progress.highest >= 0:
        if steps.size and steps.max() > progress.highest + FUTURE_STEPS:  # the pace only matters beyond this
            bad = bad | (steps > progress.highest + allowed_steps(progress, now))
    elif steps.size > 1:
        bad = bad | (steps > float(np.median(steps)) + FUTURE_STEPS)
    return bad


def clock_detail(ahead_s: float, clock: str) -> str:
    """The refusal's text for a clock ``ahead_s`` ahead of the processor's; ``clock`` names whose it is."""
    return (
        f"sent_at is {ahead_s / 3600:.0f} h ahead of the processor's clock "
        f"(at most {FUTURE_CLOCK_S / 3600:.0f} h): {clock} is broken"
    )
