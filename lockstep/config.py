"""Configuration: one set of settings from a file, environment variables and flags.

Precedence, highest first: command-line flags > ``LOCKSTEP_*`` environment
variables > the YAML file (``--config`` or ``LOCKSTEP_CONFIG``) > defaults.
Settings are validated once, at start-up; a bad value stops the command with a
one-line :class:`ConfigError` that names the setting and where it came from.

Library settings pass through untouched: ``kafka`` (librdkafka properties, e.g.
``security.protocol``, ``sasl.mechanism``) and ``faust`` (faust ``App`` settings).
"""

from __future__ import annotations

from .schemas.errors import LockstepError

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(LockstepError, ValueError):
    """A setting is missing, malformed or out of range."""


def read_yaml_mapping(path: Path, what: str, error: type[Exception] = ConfigError) -> dict:
    """A YAML file whose top level is a mapping (empty: ``{}``); any problem raises ``error`` in one
    line that starts with ``what`` (the file, as the user knows it)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise error(f"{what}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise error(f"{what}: expected a mapping at the top level")
    return data


def _pos_int(v: Any) -> int:
    iv = int(v)
    if iv < 1:
        raise ValueError("must be >= 1")
    return iv


def _pos_float(v: Any) -> float:
    fv = float(v)
    if not fv > 0:
        raise ValueError("must be > 0")
    return fv


def _kv_map(v: Any) -> dict[str, str]:
    """'a=1,b=2' or ['a=1', 'b=2'] or a mapping -> dict[str, str]."""
    if v is None:
        return {}
    if isinstance(v, dict):
        return {str(k): str(x) for k, x in v.items()}
    items = v.split(",") if isinstance(v, str) else list(v)
    out = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        k, x = item.split("=", 1)
        out[k.strip()] = x.strip()
    return out


@dataclass
class Settings:
    """Every setting of every command.  Field metadata: help text and parser."""

    bootstrap_servers: str | None = field(
        default=None,
        metadata={"help": "Kafka bootstrap servers; when unset the command starts the embedded broker", "parse": str},
    )
    kafka: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "librdkafka properties passed through (KEY=VALUE, repeatable)", "parse": _kv_map, "flag": "kafka-config"},
    )
    faust: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "faust App settings passed through (KEY=VALUE, repeatable)", "parse": _kv_map, "flag": "faust-config"},
    )
    topic_prefix: str = field(default="lockstep", metadata={"help": "prefix of every topic name", "parse": str})
    partitions: int = field(default=6, metadata={"help": "partitions per topic when creating topics", "parse": _pos_int})
    replication_factor: int = field(default=1, metadata={"help": "replication factor when creating topics", "parse": _pos_int})
    session_timeout_ms: int = field(
        default=6000,
        metadata={"help": "consumer-group session timeout (short: groups form in about half of it)", "parse": _pos_int},
    )
    fetch_wait_ms: int = field(
        default=100,
        metadata={"help": "most time a consumer fetch waits for data; keep it short: the embedded broker does not "
                          "answer a waiting fetch early when data arrives", "parse": _pos_int},
    )
    db: Path = field(default=Path("lockstep.duckdb"), metadata={"help": "DuckDB findings file", "parse": Path})
    routes: Path | None = field(
        default=None, metadata={"help": "paging routes file (YAML: PagerDuty, Slack, webhooks); no paging without it", "parse": Path}
    )
    resolve_min_coverage: float = field(
        default=0.9, metadata={"help": "a later window resolves an incident only if it saw at least this share of workers", "parse": float}
    )
    resolve_after_s: float = field(
        default=43200.0, metadata={"help": "resolve an incident that no window has seen for this long", "parse": _pos_float}
    )
    step_timeout_s: float = field(
        default=10.0, metadata={"help": "close a step this long after its first record even if workers are missing", "parse": _pos_float}
    )
    window_timeout_s: float = field(
        default=30.0, metadata={"help": "close a window this long after its first step report", "parse": _pos_float}
    )
    policy: Path | None = field(default=None, metadata={"help": "trigger/diagnosis policy file (YAML)", "parse": Path})
    processor_id: str = field(default="lockstep-processor", metadata={"help": "faust app id (consumer group) of the processors", "parse": str})
    sink_group: str = field(default="lockstep-sink", metadata={"help": "consumer group of the DuckDB sink", "parse": str})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR", "parse": lambda v: str(v).upper()})
    log_format: str = field(default="text", metadata={"help": "text (one line per record) or json (one JSON object per line)", "parse": lambda v: str(v).lower()})
    series_keep_steps: int = field(
        default=20_000, metadata={"help": "steps of each job's step-time series the sink keeps (older points are pruned)", "parse": _pos_int}
    )

    def validate(self) -> Settings:
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: {self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: {self.log_format!r} is not one of text, json")
        if not self.topic_prefix or any(c in self.topic_prefix for c in " /\\:"):
            raise ConfigError(f"topic_prefix: {self.topic_prefix!r} must be a non-empty Kafka topic name part")
        if "bootstrap.servers" in self.kafka:
            raise ConfigError("kafka: set bootstrap servers with --bootstrap-servers, not bootstrap.servers")
        if self.policy is not None and not self.policy.is_file():
            raise ConfigError(f"policy: file {self.policy} does not exist")
        if self.routes is not None and not self.routes.is_file():
            raise ConfigError(f"routes: file {self.routes} does not exist")
        if not 0.0 <= self.resolve_min_coverage <= 1.0:
            raise ConfigError(f"resolve_min_coverage: {self.resolve_min_coverage} must lie in [0, 1]")
        return self


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}

_METAVARS = {"bootstrap_servers": "HOST:PORT[,...]", "topic_prefix": "PREFIX", "db": "FILE", "routes": "FILE", "policy": "FILE",
             "processor_id": "GROUP", "sink_group": "GROUP", "log_level": "LEVEL", "log_format": "text|json"}  # fmt: skip

#: settings every command that talks to Kafka reads
KAFKA = ["bootstrap_servers", "kafka", "topic_prefix", "session_timeout_ms", "fetch_wait_ms", "log_level", "log_format"]
#: ... and those that create topics (the partition count is also checked against existing topics)
TOPICS = ["partitions", "replication_factor"]


def flag_name(name: str) -> str:
    """The command-line flag of a setting (``kafka`` -> ``--kafka-config``)."""
    return "--" + _FIELDS[name].metadata.get("flag", name.replace("_", "-"))


def add_arguments(parser: argparse.ArgumentParser, names: list[str] | None = None, config_file: bool = True, only: bool = False,
                  title: str = "settings (flag > LOCKSTEP_<NAME> environment > --config file > default)") -> None:
    """Add ``--config`` and one flag per setting (default None, so that unset flags are known), in a group of
    their own so that ``--help`` shows the command's own options first.

    ``--help`` lists ``names``, the settings the command reads.  The other settings' flags are accepted too,
    unlisted (one set of flags serves every process, as one file does), unless ``only``."""
    group = parser.add_argument_group(title)
    if config_file:
        group.add_argument("--config", type=Path, default=None, metavar="FILE", help="YAML settings file (also LOCKSTEP_CONFIG)")
    listed = list(names or _FIELDS)
    for name in listed + ([] if only else [n for n in _FIELDS if n not in listed]):
        f = _FIELDS[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        shown = "" if default in (None, {}, "") else f"; default {default}"
        help_ = f"{f.metadata['help']} (env LOCKSTEP_{name.upper()}{shown})" if name in listed else argparse.SUPPRESS
        metavar = _METAVARS.get(name) or ("SECONDS" if name.endswith("_s") else "N" if isinstance(default, (int, float)) else "VALUE")
        if isinstance(f.default_factory, type) and f.default_factory is dict:  # type: ignore[misc]
            group.add_argument(flag_name(name), dest=name, action="append", default=None, metavar="KEY=VALUE", help=help_)
        else:
            group.add_argument(flag_name(name), dest=name, default=None, metavar=metavar, help=help_)


def _parse(name: str, value: Any, source: str) -> Any:
    try:
        return _FIELDS[name].metadata["parse"](value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} (from {source}): {value!r} is not valid: {exc}") from None


def load(args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> Settings:
    """Merge defaults < file < environment < flags, then validate.

    File and environment may set any setting, so that one file serves every command."""
    env = dict(os.environ if env is None else env)
    values: dict[str, Any] = {}
    dict_values: dict[str, dict[str, str]] = {n: {} for n, f in _FIELDS.items() if f.default_factory is dict}  # type: ignore[comparison-overlap]

    def put(name: str, raw: Any, source: str) -> None:
        parsed = _parse(name, raw, source)
        if name in dict_values:
            dict_values[name].update(parsed)
        else:
            values[name] = parsed

    cfg_path = getattr(args, "config", None) or env.get("LOCKSTEP_CONFIG")
    if cfg_path:
        path = Path(cfg_path)
        data = read_yaml_mapping(path, f"config file {path}")
        for key, raw in data.items():
            name = str(key).replace("-", "_")
            if name not in _FIELDS:
                raise ConfigError(f"config file {path}: unknown setting {key!r}; known: {', '.join(_FIELDS)}")
            put(name, raw, f"config file {path}")
    for name in _FIELDS:
        raw = env.get(f"LOCKSTEP_{name.upper()}")
        if raw not in (None, ""):
            put(name, raw, f"LOCKSTEP_{name.upper()}")
    if args is not None:
        for name in _FIELDS:
            raw = getattr(args, name, None)
            if raw is not None:
                put(name, raw, flag_name(name))
    return Settings(**values, **dict_values).validate()
