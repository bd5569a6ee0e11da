"""The demo writes only files it created, and takes nothing from the environment or a settings file."""

import argparse
import json

import pytest

from lockstep.app.demo import claim_store, demo_settings, report_path
from lockstep.config import ConfigError, add_arguments, read_by


def demo_args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p, read_by("demo"), config_file=False, only=True)
    return p.parse_args(list(argv))


def test_a_new_file_is_claimed_and_a_demos_own_files_are_replaced(tmp_path):
    db = tmp_path / "d.duckdb"
    assert claim_store(db, explicit=True) == report_path(db) == tmp_path / "d-report.html"
    assert json.loads((tmp_path / "d.duckdb.demo").read_text())["written_by"] == "lockstep demo"
    db.write_text("a previous demo's store")
    report_path(db).write_text("its report")
    claim_store(db, explicit=True)
    assert not db.exists() and not report_path(db).exists()  # a failed run leaves no stale report beside a new store


@pytest.mark.parametrize("existing", ["d.duckdb", "d-report.html", "d.duckdb.wal"])
def test_a_file_the_demo_did_not_write_is_never_touched(tmp_path, existing):
    (tmp_path / existing).write_text("production data")
    with pytest.raises(ConfigError, match="was not written by `lockstep demo`"):
        claim_store(tmp_path / "d.duckdb", explicit=True)
    assert (tmp_path / existing).read_text() == "production data" and not (tmp_path / "d.duckdb.demo").exists()


def test_the_demo_reads_no_environment_and_never_uses_the_production_groups(tmp_path, monkeypatch):
    config = tmp_path / "prod.yaml"
    config.write_text(
        "bootstrap_servers: kafka-prod:9092\nprocessor_id: lockstep-processor\nsink_group: lockstep-sink\ndb: /var/lib/prod.duckdb\n"
    )
    monkeypatch.setenv("LOCKSTEP_CONFIG", str(config))
    monkeypatch.setenv("LOCKSTEP_DB", "/var/lib/prod.duckdb")
    monkeypatch.setenv("LOCKSTEP_BOOTSTRAP_SERVERS", "kafka-prod:9092")
    s = demo_settings(demo_args())
    s.db.parent.rmdir()  # the new temporary folder, empty until the demo runs
    assert s.bootstrap_servers is None  # its own embedded broker
    assert s.db.name == "lockstep.duckdb" and s.db.parent.name.startswith("lockstep-demo-")
    assert s.processor_id.startswith("lockstep-demo-") and s.sink_group.startswith("lockstep-demo-")
    # told explicitly: that Kafka, but topics and groups of the demo's own
    s = demo_settings(demo_args("--bootstrap-servers", "kafka-test:9092", "--db", str(tmp_path / "x.duckdb")))
    assert (
        s.bootstrap_servers == "kafka-test:9092"
        and s.topic_prefix.startswith("lockstep-demo-")
        and s.db == tmp_path / "x.duckdb"
    )
    other = demo_settings(demo_args("--db", str(tmp_path / "y.duckdb")))
    assert s.processor_id != other.processor_id  # a fresh group every run
