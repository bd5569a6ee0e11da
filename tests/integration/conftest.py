"""Fixtures of the integration tests."""

import pytest

from lockstep.app.runtime import Pipeline
from lockstep.kafka import ensure_topics
from lockstep.streams.app import changelog_topics


@pytest.fixture
def pipeline(settings, tmp_path):
    """The processor and the sink as child processes on the session's broker, under the default policy (a module with
    other needs, a webhook receiver say, defines its own)."""
    ensure_topics(settings, extra=dict.fromkeys(changelog_topics(settings.processor_id), settings.partitions))
    p = Pipeline(settings, tmp_path)
    p.start("sink", 60)
    p.start("processor", 60)
    yield p
    p.stop()
