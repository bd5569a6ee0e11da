"""The embedded broker leaves no log behind in the temporary folder when it stops cleanly, and keeps it when it
failed (the error names it)."""

import socket
import tempfile

import pytest

from lockstep.broker import BrokerError, EmbeddedBroker

pytestmark = pytest.mark.integration  # starts the Tansu broker


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_clean_stop_removes_the_brokers_log(temp_dir):
    with EmbeddedBroker() as broker:
        (log,) = temp_dir.glob("lockstep-broker-*.log")
        with socket.create_connection(("127.0.0.1", broker.port), timeout=2):
            pass
    assert not log.exists()
    assert not list(temp_dir.glob("lockstep-broker-*.log"))


def test_a_given_log_is_kept(tmp_path, temp_dir):
    log = tmp_path / "kept" / "broker.log"
    log.parent.mkdir()
    with EmbeddedBroker(log_path=log):
        pass
    assert log.exists()


def test_a_broker_that_cannot_listen_keeps_its_log_and_names_it(temp_dir):
    with socket.socket() as taken:  # bound, not listening: connections are refused and the broker cannot bind
        taken.bind(("127.0.0.1", 0))
        broker = EmbeddedBroker(port=taken.getsockname()[1])
        with pytest.raises(BrokerError, match=r"log: .*lockstep-broker-.*\.log") as err:
            broker.start(timeout_s=10)
    (log,) = temp_dir.glob("lockstep-broker-*.log")
    assert str(log) in str(err.value)
