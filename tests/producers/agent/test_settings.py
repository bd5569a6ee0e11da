"""Agent settings: attach() arguments > LOCKSTEP_AGENT_* > agent file > defaults; Kafka from the pipeline's settings."""

import pytest

from lockstep.config import ConfigError
from lockstep.producers.agent import settings as agent_settings
from lockstep.producers.agent.redact import Redaction

BASE = {"LOCKSTEP_BOOTSTRAP_SERVERS": "k1:9092"}


def test_precedence_and_kafka_from_the_pipeline_settings(tmp_path):
    f = tmp_path / "agent.yaml"
    f.write_text("job: from-file\nqueue_max: 7\nlabels: {pp: '1'}\n")
    env = {
        **BASE,
        "LOCKSTEP_AGENT_CONFIG": str(f),
        "LOCKSTEP_AGENT_QUEUE_MAX": "8",
        "LOCKSTEP_TOPIC_PREFIX": "px",
        "LOCKSTEP_AGENT_LABELS": "role=loss",
    }
    cfg = agent_settings.load({"queue_max": 9}, env)
    assert (cfg.job, cfg.queue_max, cfg.labels) == ("from-file", 9, {"pp": "1", "role": "loss"})
    assert (cfg.bootstrap_servers, cfg.settings().topic_prefix) == ("k1:9092", "px")
    assert (
        agent_settings.load({}, {**env, "LOCKSTEP_AGENT_BOOTSTRAP_SERVERS": "k2:9092"}).bootstrap_servers == "k2:9092"
    )


def test_the_job_falls_back_to_the_launchers_run_id():
    assert agent_settings.load({}, {**BASE, "TORCHELASTIC_RUN_ID": "run-42"}).job == "run-42"
    assert agent_settings.load({}, {**BASE, "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "977"}).job == "977"


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        ({}, BASE, "job"),
        ({"job": "j"}, {}, "bootstrap_servers: the agent needs a Kafka"),
        ({"job": "j", "queue_max": 0}, BASE, "queue_max (from attach(queue_max=...))"),
        ({"job": "j"}, {**BASE, "LOCKSTEP_AGENT_REDACT": "names=maybe"}, "redact (from LOCKSTEP_AGENT_REDACT)"),
        (
            {"job": "j"},
            {**BASE, "LOCKSTEP_AGENT_REDACT": "paths=hash"},
            "redact (from LOCKSTEP_AGENT_REDACT): 'paths=hash' is not valid: hashing (paths=hash or names=hash) needs a secret salt",
        ),
        ({"job": "j", "colour": "red"}, BASE, "unknown agent setting"),
    ],
)
def test_bad_settings_stop_with_one_line_naming_them(overrides, env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        agent_settings.load(overrides, env)


def test_to_env_reproduces_the_settings_in_a_child_process(tmp_path):
    cfg = agent_settings.load(
        {"job": "j", "labels": "pp=1,tp=2", "redact": "names=hash,salt=s", "spool_dir": tmp_path}, BASE
    )
    again = agent_settings.load({}, agent_settings.to_env(cfg))
    assert again == cfg
    assert again.redact == Redaction(names="hash", salt="s")


def test_spools_exports_and_raw_traces_are_per_rank_and_per_run_even_when_a_directory_is_set(tmp_path):
    """``lockstep agent run`` gives every rank of a host the same --spool-dir: each rank still gets its own spool (their
    window exports went to one file before), and a later run of the same job never opens what this one left."""
    one = agent_settings.load({"job": "j", "spool_dir": tmp_path, "run_id": "r1"}, BASE)
    two = agent_settings.load({"job": "j", "spool_dir": tmp_path, "run_id": "r2"}, BASE)
    dirs = {cfg.resolved_spool_dir(rank) for cfg in (one, two) for rank in (0, 1)}
    assert len(dirs) == 4 and all(d.is_relative_to(tmp_path) for d in dirs)
    assert one.resolved_spool_dir(1) == tmp_path / "run-r1" / "rank1"
    assert one.resolved_raw_dir(1) == tmp_path / "run-r1" / "rank1" / "raw"
    raw = agent_settings.load({"job": "j", "raw_dir": tmp_path / "raw", "run_id": "r1"}, BASE)
    assert {raw.resolved_raw_dir(r) for r in (0, 1)} == {tmp_path / "raw" / "run-r1" / f"rank{r}" for r in (0, 1)}
    default = agent_settings.load({"job": "a/b", "run_id": "../x"}, BASE).resolved_spool_dir(0)
    assert default.parts[-3:] == ("a_b", "run-.._x", "rank0")  # names as single path components


def test_the_run_id_comes_from_the_launcher_else_is_fresh_for_each_process():
    slurm = agent_settings.load({"job": "j"}, {**BASE, "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"})
    assert slurm.run_id == "77.0"  # a requeued Slurm job is the same run: it sends its own spool
    assert agent_settings.load({"job": "j"}, {**BASE, "TORCHELASTIC_RUN_ID": "rdzv9"}).run_id == "rdzv9"
    fresh = {agent_settings.load({"job": "j"}, {**BASE, "TORCHELASTIC_RUN_ID": "none"}).run_id for _ in range(2)}
    assert len(fresh) == 2  # torchrun's default rendezvous id names no run
    assert agent_settings.load({"job": "j"}, {**BASE, "LOCKSTEP_AGENT_RUN_ID": "mine"}).run_id == "mine"
