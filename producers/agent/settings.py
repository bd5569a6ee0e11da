"""The agent's settings: keyword arguments > ``LOCKSTEP_AGENT_*`` environment > YAML file > defaults.

The Kafka connection comes from the project's own settings (``lockstep.config``:
``LOCKSTEP_BOOTSTRAP_SERVERS``, ``LOCKSTEP_TOPIC_PREFIX``, ``LOCKSTEP_KAFKA``, ``LOCKSTEP_CONFIG``),
so a launcher configures the agent and the pipeline the same way.  Agent settings have
their own prefix and file (``LOCKSTEP_AGENT_CONFIG``) because a training process has
settings that no pipeline command has (its job, its rank, its spool).  Everything is
checked once, when the agent is created; a bad value raises :class:`~lockstep.config.ConfigError`
naming the setting and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import config as lockstep_config
from ...config import ConfigError
from .redact import Redaction

ENV_PREFIX = "LOCKSTEP_AGENT_"


def _nonneg_int(v: Any) -> int:
    iv = int(v)
    if iv < 0:
        raise ValueError("must be >= 0")
    return iv


def _opt_int(v: Any) -> int | None:
    return None if v is None or v == "" else _nonneg_int(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None or v == "" else str(v)


def _opt_path(v: Any) -> Path | None:
    return None if v is None or v == "" else Path(v)


def _relay_mode(v: Any) -> str:
    mode = str(v).strip().lower()
    if mode not in ("auto", "off"):
        raise ValueError("must be auto or off")
    return mode


def _log_level(v: Any) -> str:
    level = str(v).strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
    return level


def _redaction(v: Any) -> Redaction:
    return v if isinstance(v, Redaction) else Redaction.parse(str(v))


@dataclass
class AgentConfig:
    """Every setting of the host agent.  Field metadata: help text and parser."""

    job: str = field(
        default="",
        metadata={"help": "job id every record carries (default: TORCHELASTIC_RUN_ID or SLURM_JOB_ID)", "parse": str},
    )
    tenant: str = field(default="", metadata={"help": "tenant the job belongs to", "parse": str})
    # identity: None / empty = discover (lockstep.producers.agent.meta)
    rank: int | None = field(
        default=None,
        metadata={"help": "global rank (default: torch.distributed, RANK, SLURM_PROCID)", "parse": _opt_int},
    )
    local_rank: int | None = field(
        default=None, metadata={"help": "rank on this host (default: LOCAL_RANK, SLURM_LOCALID)", "parse": _opt_int}
    )
    world_size: int | None = field(
        default=None,
        metadata={"help": "workers in the job (default: torch.distributed, WORLD_SIZE)", "parse": _opt_int},
    )
    host: str | None = field(default=None, metadata={"help": "host name (default: the system's)", "parse": _opt_str})
    device: str | None = field(
        default=None, metadata={"help": "device, e.g. host3/gpu5 (default: from CUDA and NVML)", "parse": _opt_str}
    )
    nic: str | None = field(
        default=None,
        metadata={
            "help": "NIC or bond of inter-node traffic (default: NCCL/Gloo settings, the default route)",
            "parse": _opt_str,
        },
    )
    switch: str = field(default="", metadata={"help": "leaf switch behind the NIC (not discoverable)", "parse": str})
    labels: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "peer-group labels, e.g. pp=1,tp=0 (added to discovered ones)",
            "parse": lockstep_config.kv_map,
        },
    )
    log_level: str = field(
        default="INFO",
        metadata={
            "help": "the agent's log lines on stderr (logger lockstep.agent): INFO, one line when it attaches, accepts, "
            "refuses or publishes a window, spools or drops records; WARNING for problems only; DEBUG for all",
            "parse": _log_level,
        },
    )
    start_step: int = field(
        default=0,
        metadata={"help": "number of the first step (e.g. the step a resumed job starts at)", "parse": _nonneg_int},
    )
    # publishing
    queue_max: int = field(
        default=10_000,
        metadata={
            "help": "records held in memory for the publishing thread; beyond, the oldest is dropped",
            "parse": lockstep_config.positive_int,
        },
    )
    flush_interval_s: float = field(
        default=0.5,
        metadata={
            "help": "how often the publishing thread sends what accumulated (heartbeats go in batches)",
            "parse": lockstep_config.positive_float,
        },
    )
    heartbeat_shard_workers: int = field(
        default=256,
        metadata={
            "help": "a flush's heartbeats go as one HeartbeatBatch keyed job/shard, shard = rank // this "
            "(0: one StepHeartbeat per step keyed job, for older processors)",
            "parse": _nonneg_int,
        },
    )
    relay: str = field(
        default="auto",
        metadata={
            "help": "auto: the agent of local rank 0 relays its host's heartbeats and triggers, the others hand theirs "
            "to it (each falls back to its own Kafka client when it does not answer); off: every agent its own",
            "parse": _relay_mode,
        },
    )
    relay_dir: Path | None = field(
        default=None,
        metadata={
            "help": "where a host's agents meet their relay (default: TMPDIR/lockstep-relay-UID/<hash of job, the "
            "launcher's run id and the parent process>)",
            "parse": _opt_path,
        },
    )
    delivery_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "a record Kafka has not acknowledged by then goes to the spool",
            "parse": lockstep_config.positive_float,
        },
    )
    run_id: str = field(
        default="",
        metadata={
            "help": "this run of the job: the spool, window exports and raw traces are kept per run and rank, so "
            "that a later job of the same name never sends what this one left, while a restart of the same run "
            "(same id) sends its spool (default: SLURM_JOB_ID, TORCHELASTIC_RUN_ID unless 'none'; `lockstep agent "
            "run` makes a fresh one for its command; else one per process)",
            "parse": str,
        },
    )
    spool_dir: Path | None = field(
        default=None,
        metadata={
            "help": "on-disk spool for when Kafka is unreachable, kept in SPOOL_DIR/run-RUN_ID/rankN "
            "(default: TMPDIR/lockstep-agent/JOB/run-RUN_ID/rankN)",
            "parse": _opt_path,
        },
    )
    spool_max_bytes: int = field(
        default=64 << 20,
        metadata={
            "help": "bound of the spool; beyond, the oldest records are dropped and counted",
            "parse": lockstep_config.positive_int,
        },
    )
    # profiling windows
    hardware_hz_max: float = field(
        default=10_000.0,
        metadata={
            "help": "upper bound on the hardware sampling rate a trigger may ask for",
            "parse": lockstep_config.positive_float,
        },
    )
    min_share: float = field(
        default=0.001,
        metadata={
            "help": "leave out of feature batches functions below this share of the step (critical path and total)",
            "parse": float,
        },
    )
    raw_dir: Path | None = field(
        default=None,
        metadata={
            "help": "where the last window's raw trace is kept, in RAW_DIR/run-RUN_ID/rankN (default: the spool's raw/)",
            "parse": _opt_path,
        },
    )
    raw_max_bytes: int = field(
        default=256 << 20,
        metadata={
            "help": "bound of the kept raw trace (zstd); a larger one keeps its longest events",
            "parse": lockstep_config.positive_int,
        },
    )
    raw_upload_max_bytes: int = field(
        default=900_000,
        metadata={
            "help": "bound of one raw-trace answer (Kafka's default record limit is 1 MiB)",
            "parse": lockstep_config.positive_int,
        },
    )
    redact: Redaction = field(
        default_factory=Redaction,
        metadata={
            "help": "what leaves the host: paths=keep|strip|hash,stacks=keep|drop,names=keep|hash,salt=S",
            "parse": _redaction,
        },
    )
    # Kafka (from lockstep.config unless given)
    bootstrap_servers: str | None = field(
        default=None, metadata={"help": "Kafka (default: LOCKSTEP_BOOTSTRAP_SERVERS)", "parse": _opt_str, "kafka": True}
    )
    topic_prefix: str | None = field(
        default=None,
        metadata={
            "help": "topic prefix (default: LOCKSTEP_TOPIC_PREFIX or lockstep)",
            "parse": _opt_str,
            "kafka": True,
        },
    )
    kafka: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "librdkafka properties (default: LOCKSTEP_KAFKA)",
            "parse": lockstep_config.kv_map,
            "kafka": True,
        },
    )

    def settings(self) -> lockstep_config.Settings:
        """The pipeline settings the agent's Kafka clients use."""
        return lockstep_config.Settings(
            bootstrap_servers=self.bootstrap_servers,
            topic_prefix=self.topic_prefix or "lockstep",
            kafka=dict(self.kafka),
        ).validate()

    def validate(self) -> AgentConfig:
        if not 0 <= self.min_share < 1:
            raise ConfigError(f"min_share: {self.min_share} must be in [0, 1)")
        if not self.job or len(self.job) > 256:
            raise ConfigError(
                f"job: {self.job!r} must be 1..256 characters (set LOCKSTEP_AGENT_JOB or attach(job=...))"
            )
        if not self.bootstrap_servers:
            raise ConfigError(
                "bootstrap_servers: the agent needs a Kafka to publish to (LOCKSTEP_BOOTSTRAP_SERVERS or attach(bootstrap_servers=...))"
            )
        self.settings()  # the pipeline's own checks (topic prefix, kafka properties)
        return self

    def _per_run(self, base: Path, rank: int) -> Path:
        """``base/run-RUN_ID/rankN``: one rank of one run (every rank of a host may share ``base``)."""
        return base / f"run-{_safe(self.run_id or 'default')}" / f"rank{rank}"

    def resolved_spool_dir(self, rank: int) -> Path:
        base = (
            self.spool_dir
            if self.spool_dir is not None
            else Path(tempfile.gettempdir()) / "lockstep-agent" / _safe(self.job)
        )
        return self._per_run(base, rank)

    def resolved_raw_dir(self, rank: int) -> Path:
        return self._per_run(self.raw_dir, rank) if self.raw_dir is not None else self.resolved_spool_dir(rank) / "raw"


def _safe(name: str) -> str:
    """A name as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


#: launchers' variables naming one run of a job (kept across restarts of that run)
RUN_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def new_run_id() -> str:
    """A fresh run id: the time and a random part (``20261201T201530-3fa9c2``)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def discovered_run_id(env: dict[str, str]) -> str:
    """The launcher's id of this run (Slurm's job id, with its step; torchrun's rendezvous id unless its default)."""
    slurm = env.get("SLURM_JOB_ID", "")
    if slurm:
        step = env.get("SLURM_STEP_ID", "")
        return f"{slurm}.{step}" if step else slurm
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    return elastic if elastic not in ("", "none") else ""


FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig)}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def load(
    overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None, *, source: str = "attach({name}=...)"
) -> AgentConfig:
    """Merge defaults < agent file < environment < ``overrides`` (:func:`lockstep.config.layered`), fill Kafka from
    ``lockstep.config``, validate.

    ``source`` says, in error messages, where the overrides came from.
    """
    env = dict(os.environ if env is None else env)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(overrides) - set(FIELDS)
    if unknown:
        raise ConfigError(f"unknown agent setting(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
    path = env.get(ENV_PREFIX + "CONFIG")
    file = lockstep_config.file_layer(Path(path), f"agent config file {path}", FIELDS) if path else ()
    given = ((name, raw, source.format(name=name, flag=name.replace("_", "-"))) for name, raw in overrides.items())
    values = lockstep_config.layered(FIELDS, file, lockstep_config.env_layer(env, ENV_PREFIX, FIELDS), given)
    if not values.get("job"):
        values["job"] = next(
            (env[k] for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID") if env.get(k) not in (None, "", "none")), ""
        )
    if not values.get("run_id"):  # the launcher's, else one per process (the agent's spool is then its own)
        values["run_id"] = discovered_run_id(env) or new_run_id()
    # the Kafka connection: the pipeline's settings, unless given to the agent itself
    kafka_missing = [n for n, f in FIELDS.items() if f.metadata.get("kafka") and n not in values]
    if kafka_missing:
        pipeline = lockstep_config.load(env=env)
        for name in kafka_missing:
            values[name] = getattr(pipeline, name)
    return AgentConfig(**values).validate()


def to_env(cfg: AgentConfig) -> dict[str, str]:
    """Environment variables that reproduce ``cfg`` in a child process (what ``lockstep agent run`` sets)."""
    out: dict[str, str] = {}
    default = AgentConfig()
    for name in FIELDS:
        value = getattr(cfg, name)
        if value == getattr(default, name) or value is None:
            continue
        if isinstance(value, dict):
            text = ",".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, Redaction):
            text = value.spec(with_salt=True)
        else:
            text = str(value)
        out[env_name(name)] = text
    return out
