"""One root for every error Lockstep raises on purpose; each error is also the builtin it resembles."""

import importlib
import pkgutil

import pytest

from lockstep.commands.cli import main
from lockstep.schemas.errors import LockstepError
from lockstep.schemas.records import RecordError

#: the builtin each error resembles (code that catches builtins keeps catching them)
BUILTIN = {
    "RecordError": ValueError,
    "CompressionError": ValueError,
    "ConfigError": ValueError,
    "PolicyError": ValueError,
    "HistoryError": ValueError,
    "RoutesError": ValueError,
    "TraceError": ValueError,
    "SummaryError": ValueError,
    "FaultError": ValueError,
    "ScenarioError": ValueError,
    "TopologyError": ValueError,
    "DiagnoseError": ValueError,
    "BrokerError": RuntimeError,
    "DeliveryError": RuntimeError,
    "TopicError": RuntimeError,
    "StoreError": RuntimeError,
    "ProfilerBusy": RuntimeError,
    "RuntimeFailure": RuntimeError,
    "TriggerError": RuntimeError,
    "RawError": RuntimeError,
    "KafkaUnavailable": ConnectionError,
    "ProcessorUnreachable": ConnectionError,
}


def our_exceptions() -> list[type[BaseException]]:
    # runs the command line / copied onto PYTHONPATH by the launcher, never imported as ours
    skip = {"lockstep.__main__", "lockstep.producers.agent.boot"}
    for top in (
        "lockstep",
        "lockstep.schemas",
        "lockstep.producers",
        "lockstep.streams",
        "lockstep.sinks",
    ):  # folders of their own
        for mod in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
            if not any(mod.name == s or mod.name.startswith(s + ".") for s in skip):
                importlib.import_module(mod.name)
    found, todo = [], [BaseException]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("lockstep."):
                found.append(sub)
    return found


def test_every_error_of_ours_has_the_one_root_and_its_builtin():
    errors = our_exceptions()
    assert {e.__name__ for e in errors} >= set(BUILTIN)
    rootless = [f"{e.__module__}.{e.__name__}" for e in errors if not issubclass(e, LockstepError)]
    assert not rootless, f"errors without LockstepError as their root: {rootless}"
    for e in errors:
        if e.__name__ in BUILTIN:
            assert issubclass(e, BUILTIN[e.__name__]), e


def test_a_record_error_refuses_an_unknown_reason_even_under_python_O():
    with pytest.raises(ValueError, match="unknown dead-letter reason 'nonsense'"):
        RecordError("nonsense", "x")  # type: ignore[arg-type]
    assert RecordError("invalid", "x").reason == "invalid"


def test_the_cli_prints_any_lockstep_error_in_one_line(monkeypatch, capsys):
    class Novel(LockstepError):  # one no list names: the root is what the command line catches
        pass

    def boom(args):
        raise Novel("the file says nothing; give it a mapping")

    import lockstep.commands.topics as topics

    monkeypatch.setattr(topics, "run", boom)
    code = main(["topics"])
    err = capsys.readouterr().err
    assert code == 1 and err == "lockstep topics: error: the file says nothing; give it a mapping\n"
