"""``lockstep raw`` against answers any training process could write to the raw topic (real broker): answers
to other requests, jobs or workers are ignored, a window name never becomes a path, a trace that expands
without bound is refused in bounded memory, and the good answer is still written."""

from __future__ import annotations

import json
import threading

import cramjam
import pytest

from lockstep.kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config
from lockstep.schemas.records import RawRequest, RawTrace

pytestmark = pytest.mark.integration

GOOD = {"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}

CLI = """
import contextlib, io
from lockstep.commands import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = cli.main({argv!r})
result = {{"rc": rc, "printed": out.getvalue()}}
"""


def _answer_hostilely(settings, topics, ready: threading.Event, done: threading.Event, bomb: bytes) -> None:
    """A process that can write the raw topic: answers the request for workers 2 and 5 with every trick."""
    with Tail(consumer_config(settings, None), topics.control).open() as control:
        pub = Publisher(producer_config(settings))
        ready.set()
        while not done.is_set():
            for req in control.records(RawRequest, timeout_s=0.2):
                good = bytes(cramjam.zstd.compress(json.dumps(GOOD).encode()))
                base = dict(job=req.job, request=req.request, steps=[1], events=1, events_total=1)
                for rec in [
                    RawTrace(
                        **{**base, "request": "someone-elses"}, window="w", worker=5, trace=good
                    ),  # another request
                    RawTrace(**{**base, "job": "other-job"}, window="w", worker=5, trace=good),  # another job
                    RawTrace(**base, window="../../escaped", worker=9, trace=good),  # a worker nobody asked
                    RawTrace(**base, window="../../../../tmp/evil", worker=2, trace=bomb),  # 33 KiB expanding to 1 GiB
                    RawTrace(
                        **base, window="../../evil-too", worker=5, trace=good
                    ),  # the good answer, with a path for a window
                    RawTrace(**base, window="w", worker=5, trace=bomb),  # a second answer of worker 5: the first counts
                ]:
                    pub.send(topics.raw, req.job, rec)
                pub.flush()
                return


def test_raw_takes_only_answers_to_its_request_and_writes_only_where_asked(settings, tmp_path, hostile):
    topics = ensure_topics(settings)
    ready, done = threading.Event(), threading.Event()
    agent = threading.Thread(
        target=_answer_hostilely, args=(settings, topics, ready, done, hostile.zstd_bomb(hostile.GiB)), daemon=True
    )
    agent.start()
    assert ready.wait(60)
    out = tmp_path / "out" / "inner"
    argv = [
        "raw",
        "victim",
        "--workers",
        "2,5",
        "--out",
        str(out),
        "--json",
        "--timeout",
        "20",
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
    ]
    try:
        res = hostile.run_isolated("", CLI.format(argv=argv))
    finally:
        done.set()
        agent.join(10)
    assert res["rc"] == 1  # one worker's answer was unreadable
    answers = {a["worker"]: a for a in json.loads(res["printed"])}
    assert "expands beyond" in answers[2]["error"] and answers[2]["file"] == ""
    assert answers[5]["file"] == str(out / "victim.last.rank5.trace.json") and answers[5]["error"] == ""
    assert json.loads((out / "victim.last.rank5.trace.json").read_text()) == GOOD
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert [str(p) for p in written] == [
        "out/inner/victim.last.rank5.trace.json"
    ]  # before: files named by the answers' windows
    assert res["grew_mb"] < 200, res  # the bomb stopped at its bound (32 x the request's 512 KiB)
