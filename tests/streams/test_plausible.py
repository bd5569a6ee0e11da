"""The "from the future" rule, written once for the detector (one record) and the heartbeat stage (a batch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lockstep.streams.plausible import FUTURE_CLOCK_S, FUTURE_PACE, FUTURE_STEPS, allowed_steps, clock_detail, future


@dataclass
class Seen:
    highest: int
    last_seen_at: float
    interval: float

    def interval_s(self) -> float:
        return self.interval


def test_a_step_far_beyond_what_was_shown_is_refused_unless_the_pace_allows_it():
    shown = Seen(highest=100, last_seen_at=1000.0, interval=0.5)
    now = 1010.0  # 10 s silent at 0.5 s per step: the pace allows FUTURE_PACE * 20 steps more
    allowed = FUTURE_STEPS + FUTURE_PACE * 20
    assert allowed_steps(shown, now) == allowed
    steps = np.array([100 + int(allowed), 101 + int(allowed)])
    assert future(steps, np.full(2, now), now, shown).tolist() == [False, True]


def test_the_allowance_is_never_below_the_flat_one():
    assert allowed_steps(Seen(5, 2000.0, 1.0), now=1000.0) == FUTURE_STEPS  # a clock run backwards
    assert allowed_steps(Seen(5, 0.0, math.nan), now=1000.0) == FUTURE_STEPS  # pace unknown


def test_a_clock_a_day_ahead_is_refused_and_a_single_first_row_can_be_any_step():
    now = 50.0
    assert future(10**9, now, now, None).tolist() is False
    assert bool(future(3, now + FUTURE_CLOCK_S + 1, now, None))
    assert "25 h ahead" in clock_detail(25 * 3600.0, "a host's clock")


def test_a_batch_seen_first_is_judged_against_its_own_median():
    rows = np.array([10, 11, 12, 12 + FUTURE_STEPS + 1])
    assert future(rows, np.zeros(4), 0.0, None).tolist() == [False, False, False, True]
    assert future(rows, np.zeros(4), 0.0, Seen(-1, 0.0, 1.0)).tolist() == [False, False, False, True]
