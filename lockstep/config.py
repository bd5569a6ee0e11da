"""Configuration: one set of settings from a file, environment variables and flags.

Precedence, highest first: command-line flags > ``LOCKSTEP_*`` environment
variables > the YAML file (``--config`` or ``LOCKSTEP_CONFIG``) > defaults.
Settings are validated once, at start-up; a bad value stops the command with a
one-line :class:`ConfigError` that names the setting and where it came from.

Library settings pass through untouched: ``kafka`` (librdkafka properties, e.g.
``security.protocol``, ``sasl.mechanism``) and ``faust`` (faust ``App`` settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .schemas.errors import LockstepError


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


def positive_int(v: Any) -> int:
    iv = int(v)
    if iv < 1:
        raise ValueError("must be >= 1")
    return iv


def positive_float(v: Any) -> float:
    fv = float(v)
    if not fv > 0:
        raise ValueError("must be > 0")
    return fv


_AGE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def age_s(v: Any) -> float:
    """An age: ``30d``, ``12h``, ``90m``, ``45s``, ``2w``, or a number of seconds; positive."""
    text = str(v).strip().lower()
    if text and text[-1] in _AGE_UNITS:
        try:
            n = float(text[:-1])
        except ValueError:
            raise ValueError(f"{v!r} is not an age like 30d, 12h, 90m or a number of seconds") from None
        return positive_float(n * _AGE_UNITS[text[-1]])
    try:
        return positive_float(text)
    except ValueError as exc:
        if "must be" in str(exc):
            raise
        raise ValueError(f"{v!r} is not an age like 30d, 12h, 90m or a number of seconds") from None


def optional_age_s(v: Any) -> float | None:
    """:func:`age_s`, or None for empty, ``0``, ``none`` or ``off``."""
    if v is None or str(v).strip().lower() in ("", "0", "none", "off"):
        return None
    return age_s(v)


def kv_map(v: Any) -> dict[str, str]:
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


#: the commands that talk to Kafka, and those of them that create topics (the partition count is also
#: checked against existing topics); a setting's ``read_by`` names the commands that read it
KAFKA_COMMANDS = ("processor", "sink", "topics", "simulate", "trigger", "raw")
TOPIC_COMMANDS = ("processor", "sink", "topics", "simulate")
#: the commands that read Kafka with a consumer of their own (``topics`` asks the admin API only)
CONSUMER_COMMANDS = ("processor", "sink", "simulate", "trigger", "raw")
#: every command that has settings flags
COMMANDS = (*KAFKA_COMMANDS, "demo", "agent", "evaluate", "diagnose")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    parse: Callable[[Any], Any],
    read_by: Iterable[str],
    help_by: Mapping[str, str] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A field of a settings model: its help text, its parser (raw file, environment or flag value -> the value),
    the commands that read it (only they accept its flag, and their ``--help`` lists it), a command's own help text
    where the setting means more to it (``help_by``: command -> text), and optionally its flag name (default: the
    field's, dashed) and metavar."""
    metadata = {
        "help": help,
        "parse": parse,
        "read_by": frozenset(read_by),
        "help_by": dict(help_by or {}),
        "flag": flag,
        "metavar": metavar,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


#: ``stage_budget_mib``'s bounds: one record's decompressed table may be 64 MiB; five stages of 64 GiB are beyond a host
MIN_STAGE_BUDGET_MIB = 64
MAX_STAGE_BUDGET_MIB = 64 << 10

#: the commands that start the embedded broker when no ``--bootstrap-servers`` is given; the others that talk to
#: Kafka refuse without it
EMBEDDED_BROKER_COMMANDS = ("processor", "sink", "demo")
_EMBEDDED = "; when unset the command starts the embedded broker (memory storage: to try it out, not to keep data)"


@dataclass
class Settings:
    """Every setting of every command.  Each field says (:func:`setting`) its flag's help, its parser and which
    commands read it: the flags, the environment variables and the file's keys all derive from these fields."""

    bootstrap_servers: str | None = setting(
        None,
        help="Kafka bootstrap servers (required: the command talks to a running pipeline)",
        parse=str,
        read_by=(*KAFKA_COMMANDS, "demo", "agent"),
        help_by={
            "processor": "Kafka bootstrap servers" + _EMBEDDED,
            "sink": "Kafka bootstrap servers" + _EMBEDDED,
            "demo": "Kafka bootstrap servers; when unset the demo starts its own embedded broker",
            "simulate": "Kafka bootstrap servers (required with --publish)",
            "agent": "Kafka bootstrap servers the agents publish to (required)",
        },
        metavar="HOST:PORT[,...]",
    )
    kafka: dict[str, str] = setting(
        default_factory=dict,
        help="librdkafka properties passed through (KEY=VALUE, repeatable)",
        parse=kv_map,
        read_by=(*KAFKA_COMMANDS, "demo", "agent"),
        flag="kafka-config",
    )
    faust: dict[str, str] = setting(
        default_factory=dict,
        help="faust App settings passed through (KEY=VALUE, repeatable)",
        parse=kv_map,
        read_by=("processor",),
        flag="faust-config",
    )
    topic_prefix: str = setting(
        "lockstep",
        help="prefix of every topic name",
        parse=str,
        read_by=(*KAFKA_COMMANDS, "demo", "agent"),
        metavar="PREFIX",
    )
    partitions: int = setting(
        6, help="partitions per topic when creating topics", parse=positive_int, read_by=(*TOPIC_COMMANDS, "demo")
    )
    replication_factor: int = setting(
        1, help="replication factor when creating topics", parse=positive_int, read_by=TOPIC_COMMANDS
    )
    session_timeout_ms: int = setting(
        6000,
        help="consumer-group session timeout (short: groups form in about half of it)",
        parse=positive_int,
        read_by=CONSUMER_COMMANDS,
    )
    fetch_wait_ms: int = setting(
        100,
        help="most time a consumer fetch waits for data; keep it short: the embedded broker does not "
        "answer a waiting fetch early when data arrives",
        parse=positive_int,
        read_by=CONSUMER_COMMANDS,
    )
    connect_timeout_s: float = setting(
        10.0,
        help="most seconds a command waits for Kafka to take the connection and answer before it stops with one line "
        "(exit status 69)",
        parse=positive_float,
        read_by=("topics", "simulate", "trigger", "raw", "processor", "sink"),
    )
    db: Path = setting(
        Path("lockstep.duckdb"), help="DuckDB findings file", parse=Path, read_by=("sink", "demo"), metavar="FILE"
    )
    routes: Path | None = setting(
        None,
        help="paging routes file (YAML: PagerDuty, Slack, webhooks); no paging without it",
        parse=Path,
        read_by=("sink",),
        metavar="FILE",
    )
    resolve_min_coverage: float = setting(
        0.9,
        help="a later window resolves an incident only if it saw at least this share of workers",
        parse=float,
        read_by=("sink",),
    )
    resolve_after_s: float = setting(
        43200.0,
        help="resolve an incident that no window has seen for this long",
        parse=positive_float,
        read_by=("sink",),
    )
    step_timeout_s: float = setting(
        10.0,
        help="close a step this long after its first record even if workers are missing",
        parse=positive_float,
        read_by=("processor",),
    )
    heartbeat_lateness_s: float = setting(
        2.0,
        help="a shard's step waits this long (processor clock, from its first heartbeat; on a slow job three step "
        "intervals) for the heartbeats of its missing workers before it goes without them; agents send theirs in "
        "batches every flush_interval_s, which arrive in any order: keep it a few flush intervals (the detector "
        "waits twice as long for a step's missing shards)",
        parse=positive_float,
        read_by=("processor",),
    )
    heartbeat_lateness_steps: int = setting(
        256,
        help="... or until its shard is this many steps past it; a worker this far behind its shard's newest step is "
        "no longer waited for (gone), and the detector forgets a step this far behind the job",
        parse=positive_int,
        read_by=("processor",),
    )
    window_timeout_s: float = setting(
        30.0, help="close a window this long after its first step report", parse=positive_float, read_by=("processor",)
    )
    stage_budget_mib: int = setting(
        512,
        help="the most MiB each processor stage's open units may hold together (the heartbeat stage's open steps, the "
        "shard, step and window stages' decompressed tables and step results); past it the one holding most closes as "
        "it is and is diagnosed with what it has (budget_closes_total)",
        parse=positive_int,
        read_by=("processor",),
        metavar="MIB",
    )
    policy: Path | None = setting(
        None,
        help="trigger/diagnosis policy file (YAML)",
        parse=Path,
        read_by=("processor", "demo", "evaluate", "diagnose"),
        metavar="FILE",
    )
    processor_id: str = setting(
        "lockstep-processor",
        help="faust app id (consumer group) of the processors",
        parse=str,
        read_by=("processor", "topics"),
        metavar="GROUP",
    )
    sink_group: str = setting(
        "lockstep-sink", help="consumer group of the DuckDB sink", parse=str, read_by=("sink",), metavar="GROUP"
    )
    log_level: str = setting(
        "INFO",
        help="DEBUG, INFO, WARNING or ERROR",
        parse=lambda v: str(v).upper(),
        read_by=(*KAFKA_COMMANDS, "demo", "evaluate"),
        metavar="LEVEL",
    )
    log_format: str = setting(
        "text",
        help="text (one line per record) or json (one JSON object per line)",
        parse=lambda v: str(v).lower(),
        read_by=(*KAFKA_COMMANDS, "demo", "evaluate"),
        metavar="text|json",
    )
    series_keep_steps: int = setting(
        20_000,
        help="steps of each job's step-time series the sink keeps (older points are pruned)",
        parse=positive_int,
        read_by=("sink",),
    )
    retention: float | None = setting(
        None,
        help="the sink deletes findings, windows, triggers, step series, the detector's news, resolved incidents and "
        "finished deliveries older than this (30d, 12h, or seconds), once at start and then hourly; what open "
        "incidents still need stays. Unset, 0 or off: keep everything (lockstep prune does it by hand)",
        parse=optional_age_s,
        read_by=("sink",),
        metavar="AGE",
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
        if not MIN_STAGE_BUDGET_MIB <= self.stage_budget_mib <= MAX_STAGE_BUDGET_MIB:
            raise ConfigError(
                f"stage_budget_mib: {self.stage_budget_mib} MiB must lie in [{MIN_STAGE_BUDGET_MIB}, "
                f"{MAX_STAGE_BUDGET_MIB}]: below, one record's table (up to 64 MiB) would close its step on arrival; "
                "above, five stages' budgets exceed any machine's memory"
            )
        if self.heartbeat_lateness_s > 600:
            raise ConfigError(
                f"heartbeat_lateness_s: {self.heartbeat_lateness_s} s is beyond 600 s: a step's missing heartbeats "
                "would hold up the detector (and its hang checks) that long"
            )
        return self


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def read_by(command: str) -> list[str]:
    """The settings ``command`` reads (their fields' ``read_by``), in the model's order."""
    if command not in COMMANDS:
        raise ValueError(f"{command!r} is not a command with settings; those are {', '.join(COMMANDS)}")
    return [name for name, f in _FIELDS.items() if command in f.metadata["read_by"]]


def flag_name(name: str) -> str:
    """The command-line flag of a setting (``kafka`` -> ``--kafka-config``)."""
    return "--" + (_FIELDS[name].metadata["flag"] or name.replace("_", "-"))


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (a fresh one where it has a factory)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_arguments(
    parser: argparse.ArgumentParser,
    names: list[str] | None = None,
    config_file: bool = True,
    only: bool = True,
    title: str = "settings (flag > LOCKSTEP_<NAME> environment > --config file > default)",
    *,
    command: str | None = None,
    environment: bool = True,
    defaults_shown: Mapping[str, str] | None = None,
) -> None:
    """Add ``--config`` and one flag per setting the command reads (default None, so that unset flags are known),
    in a group of their own so that ``--help`` shows the command's own options first.

    ``command``: the settings it reads (:func:`read_by`) and their help as it reads them (``help_by``); or ``names``,
    a list of settings.  A command accepts the flags of the settings it reads and no other (a file or the
    environment may still set any setting: one file serves every process).  ``environment``: whether the help names
    each setting's ``LOCKSTEP_<NAME>`` variable (not for a command that reads none); ``defaults_shown``: a default as
    the command's help should say it, where it is not the model's (setting -> text).  ``only`` is kept for callers
    and ignored: every command accepts only its own settings."""
    del only
    group = parser.add_argument_group(title)
    if config_file:
        group.add_argument(
            "--config", type=Path, default=None, metavar="FILE", help="YAML settings file (also LOCKSTEP_CONFIG)"
        )
    listed = list(names if names is not None else read_by(command) if command else _FIELDS)
    for name in listed:
        f = _FIELDS[name]
        default = default_of(f)
        shown = (defaults_shown or {}).get(name) or ("" if default in (None, {}, "") else str(default))
        notes = "; ".join(
            x for x in (f"env LOCKSTEP_{name.upper()}" if environment else "", f"default {shown}" if shown else "") if x
        )
        text = f.metadata["help_by"].get(command, f.metadata["help"]) if command else f.metadata["help"]
        help_ = f"{text} ({notes})" if notes else text
        metavar = f.metadata["metavar"] or (
            "SECONDS" if name.endswith("_s") else "N" if isinstance(default, (int, float)) else "VALUE"
        )
        if isinstance(default, dict):
            group.add_argument(
                flag_name(name), dest=name, action="append", default=None, metavar="KEY=VALUE", help=help_
            )
        else:
            group.add_argument(flag_name(name), dest=name, default=None, metavar=metavar, help=help_)


# ------------------------------------------------------------------------------------------ the layered loader

#: one layer's values: (setting, raw value, where it came from, as the error message names it)
Layer = Iterable[tuple[str, Any, str]]


def file_layer(path: Path, what: str, fields: Mapping[str, dataclasses.Field[Any]]) -> Layer:
    """The settings of a YAML file (``what``: the file as the user knows it; keys may be dashed)."""
    data = read_yaml_mapping(path, what)
    for key, raw in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{what}: unknown setting {key!r}; known: {', '.join(fields)}")
        yield name, raw, what


def env_layer(env: Mapping[str, str], prefix: str, fields: Mapping[str, dataclasses.Field[Any]]) -> Layer:
    """The settings of ``<prefix><NAME>`` environment variables (empty ones are unset)."""
    for name in fields:
        raw = env.get(prefix + name.upper())
        if raw not in (None, ""):
            yield name, raw, prefix + name.upper()


def layered(fields: Mapping[str, dataclasses.Field[Any]], *layers: Layer) -> dict[str, Any]:
    """Parse each layer's values with their fields' parsers, lowest layer first: a later layer's value wins, and
    mappings (``kafka``, ``labels``) merge key by key.  A bad value raises :class:`ConfigError` naming the setting
    and where it came from."""
    values: dict[str, Any] = {}
    for layer in layers:
        for name, raw, source in layer:
            try:
                parsed = fields[name].metadata["parse"](raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name} (from {source}): {raw!r} is not valid: {exc}") from None
            previous = values.get(name)
            values[name] = {**previous, **parsed} if isinstance(previous, dict) and isinstance(parsed, dict) else parsed
    return values


def load(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge defaults < file < environment < flags, then validate.

    File and environment may set any setting, so that one file serves every command."""
    env = dict(os.environ if env is None else env)
    cfg_path = getattr(args, "config", None) or env.get("LOCKSTEP_CONFIG")
    file = file_layer(Path(cfg_path), f"config file {cfg_path}", _FIELDS) if cfg_path else ()
    flags = ((name, raw, flag_name(name)) for name in _FIELDS if (raw := getattr(args, name, None)) is not None)
    return Settings(**layered(_FIELDS, file, env_layer(env, "LOCKSTEP_", _FIELDS), flags)).validate()
