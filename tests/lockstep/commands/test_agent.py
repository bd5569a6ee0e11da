"""``lockstep agent status``: each job's agents from the findings store, and their counters from the processors'
/metrics (a real HTTP endpoint serving a real processor Metrics registry)."""

import http.server
import json
import threading

import pytest

from lockstep.commands.agent import COUNTERS
from lockstep.commands.cli import main
from lockstep.metrics import Metrics
from lockstep.schemas.records import StepSeries
from lockstep.sinks.store import FindingsStore
from lockstep.sinks.store.writes import Batch
from lockstep.streams.stages.detect import AGENT_COUNTERS, top_jobs


def series(job, steps, workers, tenant=""):
    return StepSeries(
        job=job,
        tenant=tenant,
        steps=list(steps),
        step_time_us=[100.0] * len(steps),
        median_us=[90.0] * len(steps),
        workers=list(workers),
    )


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "f.duckdb"
    s = FindingsStore(db)
    s.write(
        Batch(
            [],
            [],
            {},
            series=[series("train-a", range(10), [8] * 9 + [6]), series("train-b", range(3), [4] * 3, tenant="acme")],
        )
    )
    s.close()
    return db


@pytest.fixture
def processor():
    """A processor's /metrics, as the detect stage sets the agents' gauges (jobs at zero have no series)."""
    m = Metrics("processor")
    for name in AGENT_COUNTERS:
        m.replace(f"agent_{name}", top_jobs({"train-a": 3 if name == "spooled_records" else 0}))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = m.render().encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_counters_read_are_the_ones_the_processor_exports():
    assert set(COUNTERS) == set(AGENT_COUNTERS)


def test_status_lists_each_jobs_agents_from_the_store(store, capsys):
    assert main(["agent", "status", "--db", str(store), "--json"]) == 0
    jobs = {j["job"]: j for j in json.loads(capsys.readouterr().out)}
    assert set(jobs) == {"train-a", "train-b"}
    a = jobs["train-a"]
    assert (a["workers_now"], a["workers_most"], a["last_step"]) == (6, 8, 9)  # two agents missing at the last step
    assert a["spooled_records"] is None  # no processor asked
    assert jobs["train-b"]["tenant"] == "acme"
    assert main(["agent", "status", "--db", str(store)]) == 0
    out = capsys.readouterr().out
    assert "6 (of 8)" in out and "add --processor URL" in out


def test_status_adds_the_agents_counters_from_the_processors(store, processor, capsys):
    assert main(["agent", "status", "--db", str(store), "--processor", processor, "--job", "train-a", "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)
    assert (a["job"], a["spooled_records"], a["dropped_records"], a["failed_windows"]) == ("train-a", 3, 0, 0)


def test_a_processor_that_does_not_answer_is_one_line(store, capsys):
    assert main(["agent", "status", "--db", str(store), "--processor", "http://127.0.0.1:1"]) == 1
    assert "--processor http://127.0.0.1:1: no metrics there" in capsys.readouterr().err


def test_a_store_without_agents_says_so(tmp_path, capsys):
    FindingsStore(tmp_path / "empty.duckdb").close()
    assert main(["agent", "status", "--db", str(tmp_path / "empty.duckdb")]) == 0
    assert "no job's agents have reported" in capsys.readouterr().out
