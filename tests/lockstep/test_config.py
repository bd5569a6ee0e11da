import argparse
import dataclasses

import pytest

from lockstep import config
from lockstep.config import ConfigError


def parse(argv):
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p.parse_args(argv)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    f = tmp_path / "lockstep.yaml"
    f.write_text(
        "partitions: 4\ntopic_prefix: fromfile\nsession_timeout_ms: 7000\nkafka:\n  security.protocol: SSL\n  client.id: file\n"
    )
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
        ([], {"LOCKSTEP_HEARTBEAT_LATENESS_S": "0"}, "heartbeat_lateness_s (from LOCKSTEP_HEARTBEAT_LATENESS_S)"),
        ([], {"LOCKSTEP_HEARTBEAT_LATENESS_S": "900"}, "heartbeat_lateness_s: 900.0 s is beyond 600 s"),
        ([], {"LOCKSTEP_HEARTBEAT_LATENESS_STEPS": "0"}, "heartbeat_lateness_steps"),
        (["--stage-budget-mib", "0"], {}, "stage_budget_mib (from --stage-budget-mib)"),
        ([], {"LOCKSTEP_STAGE_BUDGET_MIB": "8"}, "stage_budget_mib: 8 MiB must lie in [64, 65536]"),
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


def test_every_setting_says_which_commands_read_it():
    for f in dataclasses.fields(config.Settings):
        assert f.metadata["read_by"], f"{f.name}: read by no command"
        assert f.metadata["read_by"] <= set(config.COMMANDS), f.name


def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("command", config.COMMANDS)
def test_a_commands_help_lists_the_settings_it_reads_and_no_other(command):
    """The flags come from the model: what ``--help`` lists is the settings whose ``read_by`` names the command."""
    from lockstep.commands.cli import build_parser

    names = {f.name for f in dataclasses.fields(config.Settings)}
    for path in ([command, "run"], [command, "env"]) if command == "agent" else ([command],):
        parser = _subparser(build_parser(), path)
        listed = {a.dest for a in parser._actions if a.dest in names and a.help is not argparse.SUPPRESS}
        assert listed == set(config.read_by(command)), path


def test_read_by_refuses_a_command_without_settings():
    with pytest.raises(ValueError, match="not a command with settings"):
        config.read_by("report")


def test_the_layers_merge_mappings_key_by_key_and_name_the_source_of_a_bad_value():
    fields = {f.name: f for f in dataclasses.fields(config.Settings)}
    values = config.layered(
        fields,
        [("kafka", {"a": "1", "b": "1"}, "file"), ("partitions", 3, "file")],
        [("kafka", "b=2", "env"), ("partitions", "4", "env")],
    )
    assert values == {"kafka": {"a": "1", "b": "2"}, "partitions": 4}
    with pytest.raises(ConfigError, match=r"partitions \(from LOCKSTEP_PARTITIONS\): '0' is not valid"):
        config.layered(fields, config.env_layer({"LOCKSTEP_PARTITIONS": "0"}, "LOCKSTEP_", fields))


def test_the_stage_budget_comes_from_the_file_then_the_environment_then_the_flag(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("stage_budget_mib: 256\n")
    assert config.load(parse(["--config", str(f)]), env={}).stage_budget_mib == 256
    env = {"LOCKSTEP_STAGE_BUDGET_MIB": "1024"}
    assert config.load(parse(["--config", str(f)]), env=env).stage_budget_mib == 1024
    assert config.load(parse(["--config", str(f), "--stage-budget-mib", "128"]), env=env).stage_budget_mib == 128
    assert config.load(parse([]), env={}).stage_budget_mib == 512


def test_ages_and_the_sinks_retention():
    from lockstep.config import age_s, load, optional_age_s

    assert [age_s(v) for v in ("30d", "12h", "90m", "45s", "2w", "3600", 7.5)] == [
        30 * 86400.0,
        43200.0,
        5400.0,
        45.0,
        14 * 86400.0,
        3600.0,
        7.5,
    ]
    for bad in ("soon", "d", "-1d", "0s", "1y"):
        with pytest.raises(ValueError):
            age_s(bad)
    assert [optional_age_s(v) for v in (None, "", "0", "off")] == [None] * 4
    assert load(None, env={"LOCKSTEP_RETENTION": "30d"}).retention == 30 * 86400.0
    assert load(None, env={}).retention is None
    with pytest.raises(ConfigError, match="retention"):
        load(None, env={"LOCKSTEP_RETENTION": "a while"})
