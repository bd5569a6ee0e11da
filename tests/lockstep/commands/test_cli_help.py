"""The help is generated from what each command reads: it accepts the flags of the settings it reads and no other,
lists the choices of a flag that has them, shows the defaults, and says nothing its behaviour contradicts."""

import argparse
import contextlib
import io

import pytest

from lockstep import config
from lockstep.commands.cli import build_parser, main

SETTINGS = {f.name for f in __import__("dataclasses").fields(config.Settings)}


def leaves() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command's parser (``agent run`` and ``agent env`` included), by its name."""
    out = {}

    def walk(parser, name):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[name] = parser
        for sub in subs:
            for child, p in sub.choices.items():
                walk(p, f"{name} {child}".strip())

    walk(build_parser(), "")
    return out


LEAVES = leaves()


def helps(parser) -> str:
    return parser.format_help()


#: commands without settings flags whose own flag sets a setting's value: their --db defaults to the settings' db
#: (LOCKSTEP_DB or the settings file); test-page's --routes is the routes file it tests, required
OWN = {
    "findings": {"db"},
    "query": {"db"},
    "report": {"db"},
    "agent status": {"db"},
    "jobs": {"db"},
    "prune": {"db"},
    "incident ack": {"db"},
    "incident resolve": {"db"},
    "test-page": {"routes"},
}


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_a_command_accepts_the_settings_it_reads_and_no_other(name):
    parser = LEAVES[name]
    accepted = {a.dest for a in parser._actions if a.dest in SETTINGS}
    command = name.split()[0]
    wanted = OWN[name] if name in OWN else set(config.read_by(command)) if command in config.COMMANDS else set()
    assert accepted == wanted, (accepted - wanted, wanted - accepted)
    # and every flag it accepts is shown, with a help text
    hidden = [a.option_strings for a in parser._actions if a.help in (None, argparse.SUPPRESS) and a.option_strings]
    assert not [h for h in hidden if h != ["-h", "--help"]], hidden
    positional_without_help = [a.dest for a in parser._actions if not a.option_strings and not a.help]
    assert not positional_without_help


def test_a_flag_of_a_setting_another_command_reads_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trigger", "j", "--bootstrap-servers", "127.0.0.1:1", "--partitions", "12"])
    assert exit_.value.code == 2 and "unrecognized arguments: --partitions 12" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_choices_are_listed_and_defaults_shown(name):
    parser = LEAVES[name]
    for a in parser._actions:
        if not a.option_strings or a.help in (None, argparse.SUPPRESS):
            continue
        text = " ".join(a.help.split())
        for choice in a.choices or ():
            assert str(choice) in text, (name, a.option_strings, choice)
        meaningful = a.default not in (None, False, True, "", [], argparse.SUPPRESS) and not isinstance(
            a, argparse._VersionAction
        )
        assert not meaningful or "default" in text, (name, a.option_strings, a.default)


#: how each command that talks to a given Kafka, and refuses without one, is asked to run without one
REFUSE_WITHOUT_KAFKA = {
    "trigger": ["trigger", "j"],
    "raw": ["raw", "j", "--workers", "1"],
    "topics": ["topics"],
    "simulate": ["simulate", "{scenario}", "--publish"],
    "agent env": ["agent", "env", "--job", "j"],
    "agent run": ["agent", "run", "--job", "j", "--", "true"],
}


@pytest.mark.parametrize("name", sorted(REFUSE_WITHOUT_KAFKA))
def test_a_command_that_refuses_without_kafka_does_not_promise_the_embedded_broker(name, monkeypatch, tmp_path):
    from tests.paths import ROOT

    for var in [v for v in __import__("os").environ if v.startswith("LOCKSTEP_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{scenario}", str(ROOT / "scenarios" / "demo.yaml")) for a in REFUSE_WITHOUT_KAFKA[name]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 2 and "bootstrap" in err.getvalue().lower(), err.getvalue()  # it refuses...
    text = " ".join(helps(LEAVES[name]).split())
    assert "starts the embedded broker" not in text  # ...and its help does not say it would start one
    assert "required" in text


@pytest.mark.parametrize("name", sorted(config.EMBEDDED_BROKER_COMMANDS))
def test_the_commands_that_start_the_embedded_broker_say_so(name):
    assert "starts its own embedded broker" in " ".join(
        helps(LEAVES[name]).split()
    ) or "starts the embedded broker" in " ".join(helps(LEAVES[name]).split())


def test_the_demos_help_names_no_environment_variable_and_no_default_store_it_does_not_use():
    text = " ".join(helps(LEAVES["demo"]).split())
    assert "LOCKSTEP_" not in text.replace("no LOCKSTEP_* variable", "")
    assert "default lockstep.duckdb)" not in text and "temporary folder" in text
    assert "--config" not in text


def test_simulates_step_bound_is_explained():
    text = " ".join(helps(LEAVES["simulate"]).split())
    assert "--max-steps MAX_STEPS --publish: the most steps published" in text
    assert "0: deliver every window until --max-steps" in text
