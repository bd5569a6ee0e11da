"""The agent's control follower in memory (MemoryKafka): it waits for the topic without blocking, then hands over
what is asked of its job from the moment it connected.  Against the real broker: tests/integration/test_torch_agent.py."""

from lockstep.kafka import MemoryKafka, Publisher
from lockstep.producers.agent.control import ControlFollower
from lockstep.schemas.records import ProfileTrigger, RawRequest, TriggerRefused


def test_the_follower_connects_once_the_topic_exists_and_takes_only_its_jobs_requests():
    kafka = MemoryKafka()
    follower = ControlFollower({}, "t.control", "j", retry_s=0.0, clients=kafka.clients())
    assert follower.poll() is None and not follower.connected  # no topic yet: nothing, at once
    kafka.create("t.control", 2)
    pub = Publisher({}, clients=kafka.clients())
    pub.send(
        "t.control", "j", ProfileTrigger(job="j", window="old", start_step=5, steps=4, expected_workers=2)
    )  # before it connected
    pub.flush()
    assert follower.poll() == [] and follower.connected
    asked = [
        ProfileTrigger(job="j", window="w1", start_step=50, steps=4, expected_workers=2),
        ProfileTrigger(job="k", window="w1", start_step=50, steps=4, expected_workers=2),  # another job
        TriggerRefused(job="j", request="r", code="cooldown", reason="for the operator"),
        RawRequest(job="j", request="r2", workers=[1]),
    ]
    for rec in asked:
        pub.send("t.control", rec.job, rec)
    pub.send_raw("t.control", b"j", b"garbage")
    pub.flush()
    got = follower.poll(timeout_s=1.0)
    got += follower.poll()
    assert sorted(got, key=lambda r: type(r).__name__) == [asked[0], asked[3]]
    assert follower.bad_records == 1
    follower.close()
    assert not follower.connected
