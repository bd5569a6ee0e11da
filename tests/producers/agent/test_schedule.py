"""The window state machine: which triggers are accepted and what happens at each boundary."""

from lockstep.producers.agent.schedule import WindowSchedule
from lockstep.schemas.records import ProfileTrigger


def trig(window: str, start: int, steps: int = 3, job: str = "j") -> ProfileTrigger:
    return ProfileTrigger(job=job, window=window, start_step=start, steps=steps, expected_workers=4)


def test_a_window_starts_steps_and_stops_at_its_boundaries():
    s = WindowSchedule()
    assert s.offer(trig("w", 10), current_step=5).accepted
    assert [s.boundary(b) for b in (6, 7, 8, 9)] == [[], [], [], []]
    (start,) = s.boundary(10)
    assert start[0] == "start" and start[1].name == "w"
    assert [a for a, _ in s.boundary(11)] == ["step"]
    assert [a for a, _ in s.boundary(12)] == ["step"]
    assert [a for a, _ in s.boundary(13)] == ["stop"]
    assert not s.busy and s.boundary(14) == []


def test_a_trigger_for_a_step_that_has_begun_is_refused():
    s = WindowSchedule()
    assert s.offer(trig("now", 5), current_step=5).reason == "past"
    assert s.offer(trig("old", 2), current_step=5).reason == "past"
    assert s.offer(trig("next", 6), current_step=5).accepted  # the next step has not begun
    assert not s.offer(trig("next", 6), current_step=5).accepted  # the same trigger read again
    assert s.offer(trig("next", 6), current_step=5).reason == "duplicate"


def test_overlapping_windows_are_refused_adjacent_ones_follow_each_other():
    s = WindowSchedule()
    assert s.offer(trig("a", 10, 4), 0).accepted
    assert s.offer(trig("b", 12, 4), 0).reason == "overlap"
    assert s.offer(trig("c", 14, 2), 0).accepted
    assert [(a, w.name) for a, w in s.boundary(10)] == [("start", "a")]
    for b in (11, 12, 13):
        s.boundary(b)
    assert [(a, w.name) for a, w in s.boundary(14)] == [("stop", "a"), ("start", "c")]
    assert [(a, w.name) for a, w in s.boundary(16)] == [("stop", "c")]


def test_a_window_whose_start_the_step_counter_jumped_over_is_missed():
    s = WindowSchedule()
    s.offer(trig("w", 10), 0)
    assert [(a, w.name) for a, w in s.boundary(20)] == [("missed", "w")]
    assert not s.busy
