"""The training process's TCP connections from the kernel (producers/agent/tcpdiag.py), on real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from lockstep.producers.agent import tcpdiag
from lockstep.schemas.events import CONNECTION_SCHEMA

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux's")


def connected() -> tuple[socket.socket, socket.socket]:
    """A connected pair of TCP sockets in this process over the loopback: (the sending end, the receiving end)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    out = socket.create_connection(srv.getsockname())
    inn, _ = srv.accept()
    srv.close()
    return out, inn


@pytest.fixture
def pair():
    """A connected pair of TCP sockets in this process, the receiving end drained by a thread."""
    out, inn = connected()
    received = []

    def drain() -> None:
        while chunk := inn.recv(1 << 20):
            received.append(len(chunk))

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    yield out, inn, received
    out.close()
    t.join(timeout=10)
    inn.close()


def test_a_snapshot_has_this_process_connections_with_their_ends(pair):
    out, inn, _ = pair
    snap = tcpdiag.snapshot()
    assert snap is not None
    ends = {(s.local, s.peer) for s in snap.values()}
    a = "{}:{}".format(*out.getsockname())
    b = "{}:{}".format(*inn.getsockname())
    assert (a, b) in ends and (b, a) in ends


def test_two_snapshots_give_what_was_sent_between_them(pair):
    out, _, received = pair
    before = tcpdiag.snapshot()
    out.sendall(b"x" * 4_000_000)
    while sum(received) < 4_000_000:
        threading.Event().wait(0.01)
    t = tcpdiag.connections(7, before, tcpdiag.snapshot())
    assert t is not None and t.schema == CONNECTION_SCHEMA
    rows = {r["local"]: r for r in t.to_pylist()}
    sender = rows["{}:{}".format(*out.getsockname())]
    assert sender["worker"] == 7
    assert sender["bytes_sent"] >= 4_000_000 and sender["segs_out"] >= 4_000_000 // 65_483
    assert 0 <= sender["retrans"] <= sender["segs_out"]  # the loopback drops nothing; a timer may still fire
    assert sender["rtt_us"] > 0
    # the receiving end sent no data
    receiver = rows["{}:{}".format(*pair[1].getsockname())]
    assert receiver["segs_out"] == 0 and receiver["bytes_sent"] == 0


def test_the_time_a_connection_was_busy_and_what_held_it_back_are_counted():
    # a receiver that reads nothing for 0.3 s: the sender has data in flight, held back by the receiver's window
    out, inn = connected()
    local = "{}:{}".format(*out.getsockname())
    with out, inn:
        before = tcpdiag.snapshot()
        sender = threading.Thread(target=out.sendall, args=(b"x" * 30_000_000,), daemon=True)
        sender.start()
        threading.Event().wait(0.3)
        got = 0
        while got < 30_000_000:
            got += len(inn.recv(1 << 20))
        sender.join(timeout=10)
        rows = {r["local"]: r for r in tcpdiag.connections(0, before, tcpdiag.snapshot()).to_pylist()}
    row = rows[local]
    if row["busy_us"] is None:
        pytest.skip("this kernel's tcp_info has no busy time (linux < 4.10)")
    assert row["busy_us"] >= 150_000  # most of the 0.3 s the receiver slept, in kernel ticks
    held = row["rwnd_limited_us"] + row["sndbuf_limited_us"]
    assert 0 < held <= row["busy_us"]


def test_another_process_connections_are_not_this_one(pair):
    # a child with a connection of its own (to a server of its own): not in this process's snapshot
    code = (
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "c = socket.create_connection(s.getsockname()); a, _ = s.accept(); "
        "print('%s:%d' % c.getsockname(), flush=True); sys.stdin.readline()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = child.stdout.readline().strip()
        mine = tcpdiag.snapshot()
        assert mine is not None and theirs not in {s.local for s in mine.values()}
        assert "{}:{}".format(*pair[0].getsockname()) in {s.local for s in mine.values()}
    finally:
        child.communicate("\n", timeout=10)


def test_a_listening_socket_and_a_file_are_no_connection(tmp_path, pair):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    listening = "{}:{}".format(*srv.getsockname())
    with srv, open(tmp_path / "f", "w"):
        snap = tcpdiag.snapshot()
    assert listening not in {s.local for s in snap.values()}
    assert len(snap) >= 2  # the pair's two ends


def test_a_connection_opened_between_snapshots_counts_from_zero_and_a_missing_snapshot_gives_none(pair):
    out, _, received = pair
    before: dict[tuple[str, str], tcpdiag.Socket] = {}  # as if the connection were opened after the window began
    out.sendall(b"y" * 100_000)
    while sum(received) < 100_000:
        threading.Event().wait(0.01)
    t = tcpdiag.connections(0, before, tcpdiag.snapshot())
    sender = next(r for r in t.to_pylist() if r["local"] == "{}:{}".format(*out.getsockname()))
    assert sender["bytes_sent"] >= 100_000
    assert tcpdiag.connections(0, None, tcpdiag.snapshot()) is None
    assert tcpdiag.connections(0, tcpdiag.snapshot(), None) is None
