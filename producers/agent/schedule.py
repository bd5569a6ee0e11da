"""Step-aligned profiling windows as a pure state machine (no torch, no Kafka, no clock).

Fed triggers (with the step now running) and step boundaries, it says what to do
with the profiler.  A window ``[start, start + steps)`` is accepted only if its
start step has not begun yet and it does not overlap a window already accepted;
at the boundary into ``start`` the profiler starts, at every boundary inside the
window it marks the next step, and at the boundary into ``start + steps`` it stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...schemas.records import ProfileTrigger

Action = Literal["start", "step", "stop", "missed"]


@dataclass(frozen=True)
class ScheduledWindow:
    trigger: ProfileTrigger

    @property
    def name(self) -> str:
        return self.trigger.window

    @property
    def start(self) -> int:
        return self.trigger.start_step

    @property
    def stop(self) -> int:
        """First step after the window."""
        return self.trigger.start_step + self.trigger.steps

    def overlaps(self, other: ScheduledWindow) -> bool:
        return self.start < other.stop and other.start < self.stop


@dataclass(frozen=True)
class Offer:
    accepted: bool
    reason: str  # "accepted", "duplicate", "past", "overlap"


@dataclass
class WindowSchedule:
    pending: list[ScheduledWindow] = field(default_factory=list)  # accepted, not started; by start step
    active: ScheduledWindow | None = None
    seen: set[str] = field(default_factory=set)

    @property
    def busy(self) -> bool:
        """Something is scheduled or running: the agent must look at the next boundary."""
        return self.active is not None or bool(self.pending)

    def offer(self, trigger: ProfileTrigger, current_step: int) -> Offer:
        """A trigger arrived while ``current_step`` runs."""
        if trigger.window in self.seen:
            return Offer(False, "duplicate")
        self.seen.add(trigger.window)
        w = ScheduledWindow(trigger)
        if w.start <= current_step:
            return Offer(False, "past")
        if any(w.overlaps(o) for o in ([self.active] if self.active else []) + self.pending):
            return Offer(False, "overlap")
        self.pending.append(w)
        self.pending.sort(key=lambda x: x.start)
        return Offer(True, "accepted")

    def boundary(self, step: int) -> list[tuple[Action, ScheduledWindow]]:
        """Step ``step`` is about to begin."""
        actions: list[tuple[Action, ScheduledWindow]] = []
        if self.active is not None:
            if step >= self.active.stop:
                actions.append(("stop", self.active))
                self.active = None
            else:
                actions.append(("step", self.active))
        while self.pending and self.pending[0].start < step:  # the step counter jumped past it
            actions.append(("missed", self.pending.pop(0)))
        if self.active is None and self.pending and self.pending[0].start == step:
            self.active = self.pending.pop(0)
            actions.append(("start", self.active))
        return actions

    def abort(self) -> ScheduledWindow | None:
        """Give up the running window (the profiler failed); returns it."""
        w, self.active = self.active, None
        return w
