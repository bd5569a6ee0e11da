"""A closed Publisher lets go of its Kafka producer: none of its connections to the broker stay open (a broker stopped
with a client connected waits for it before it is killed), and what it sent before was delivered."""

from __future__ import annotations

import os

import pytest

from lockstep.kafka import Publisher, PublisherClosed, ensure_topics, producer_config, read_all
from lockstep.schemas.records import ProfileTrigger

pytestmark = pytest.mark.integration  # the embedded broker


def connections_to(port: int) -> set[int]:
    """The socket inodes of this process's established TCP connections to ``port`` on the loopback (Linux /proc)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    found = set()
    with open("/proc/self/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            remote, state, inode = cols[2], cols[3], int(cols[9])
            if state == "01" and int(remote.split(":")[1], 16) == port and inode in mine:
                found.add(inode)
    return found


def test_close_delivers_and_drops_the_producers_connections(settings):
    topics = ensure_topics(settings)
    port = int(settings.bootstrap_servers.rsplit(":", 1)[1])
    before = connections_to(port)
    pub = Publisher(producer_config(settings))
    trig = ProfileTrigger(job="j", window="w1", start_step=10, steps=4, expected_workers=8)
    pub.send(topics.control, "j", trig)
    pub.flush()
    ours = connections_to(port) - before
    assert ours  # the producer is connected
    pub.close()
    assert not connections_to(port) & ours  # ... and no longer
    assert pub.pending() == 0 and pub.stats.records[topics.control] == 1
    with pytest.raises(PublisherClosed):
        pub.send(topics.control, "j", trig)
    pub.close()  # again: nothing
    assert [v for _, v in read_all(settings, [topics.control])[topics.control]] != []
