import argparse

import pytest

from lockstep import config
from lockstep.config import ConfigError


def parse(argv):
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p.parse_args(argv)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    f = tmp_path / "lockstep.yaml"
    f.write_text("partitions: 4\ntopic_prefix: fromfile\nsession_timeout_ms: 7000\nkafka:\n  security.protocol: SSL\n  client.id: file\n")
    env = {"LOCKSTEP_PARTITIONS": "8", "LOCKSTEP_KAFKA": "client.id=env"}
    s = config.load(parse(["--config", str(f), "--partitions", "12", "--kafka-config", "linger.ms=9"]), env=env)
    assert s.partitions == 12  # flag
    assert s.topic_prefix == "fromfile"  # file
    assert s.session_timeout_ms == 7000
    assert s.step_timeout_s == 10.0  # default
    assert s.kafka == {"security.protocol": "SSL", "client.id": "env", "linger.ms": "9"}  # merged file < env < flags
    s2 = config.load(parse(["--config", str(f)]), env=env)
    assert s2.partitions == 8  # env over file


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("db: /tmp/x.duckdb\n")
    assert str(config.load(None, env={"LOCKSTEP_CONFIG": str(f)}).db) == "/tmp/x.duckdb"


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--partitions", "0"], {}, "partitions (from --partitions)"),
        ([], {"LOCKSTEP_STEP_TIMEOUT_S": "soon"}, "step_timeout_s (from LOCKSTEP_STEP_TIMEOUT_S)"),
        (["--log-level", "loud"], {}, "log_level"),
        (["--kafka-config", "novalue"], {}, "KEY=VALUE"),
        (["--kafka-config", "bootstrap.servers=x:1"], {}, "--bootstrap-servers"),
        (["--topic-prefix", "a b"], {}, "topic_prefix"),
    ],
)
def test_bad_settings_fail_with_one_line(argv, env, needle):
    with pytest.raises(ConfigError) as exc:
        config.load(parse(argv), env=env)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("partitoins: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'partitoins'"):
        config.load(parse(["--config", str(f)]), env={})
