"""Every evidence feature the diagnosis writes has a label, a unit and a meaning for the page and the tables."""

from __future__ import annotations

import re

from lockstep.units import feature, value
from tests.paths import ROOT


def test_every_evidence_feature_the_diagnosis_writes_is_described():
    written = set()
    for path in (ROOT / "streams" / "diagnosis").glob("*.py"):
        written |= set(re.findall(r'feature="([a-z_]+)"', path.read_text()))
    assert {"own_work_us", "wait_us", "job_noise", "work_us"} <= written
    undescribed = sorted(name for name in written if not feature(name).meaning)
    assert undescribed == [], undescribed


def test_the_localisations_evidence_reads_in_its_units():
    assert value("own_work_us", 68_437.0) == "68.4 ms"  # was "68,437" with the unit "count"
    assert value("wait_us", 1_500.0) == "1.5 ms"
    assert value("job_noise", 0.0123) == "1.2%"
