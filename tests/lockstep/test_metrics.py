"""The metrics catalogue is the one source of a metric's help, kind and labels."""

import pytest

from lockstep.metrics import CATALOGUE, Metrics, UnknownMetric, parse


def test_help_comes_from_the_catalogue():
    m = Metrics()
    m.inc("records_in_total", topic="heartbeats")
    text = m.render()
    assert f"# HELP lockstep_records_in_total {CATALOGUE['records_in_total'].help}" in text
    assert parse(text)[("lockstep_records_in_total", (("topic", "heartbeats"),))] == 1.0


def test_a_metric_missing_from_the_catalogue_is_refused():
    m = Metrics()
    with pytest.raises(UnknownMetric, match="not_declared_total"):
        m.inc("not_declared_total")
    assert "not_declared_total" not in m.render()
