"""The stream stages are pure: importing them loads no Kafka client (they need topic names and keys only,
from lockstep.kafka.names), nor faust, DuckDB or an HTTP server."""

import subprocess
import sys

import pytest

CLIENTS = ("confluent_kafka", "aiokafka", "faust", "mode", "duckdb", "aiohttp")


@pytest.mark.parametrize(
    "module", ["lockstep.streams.stages", "lockstep.streams.detector", "lockstep.streams.diagnosis", "lockstep.kafka"]
)
def test_importing_loads_no_kafka_client(module):
    probe = f"import sys, {module}\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {set(CLIENTS)!r}))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import {module} loaded {out.strip()}"


def test_a_kafka_name_used_loads_its_module():
    probe = "import sys, lockstep.kafka as k\nk.Publisher\nprint('confluent_kafka' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
