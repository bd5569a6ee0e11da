"""The real sink under hostile queries for ~20 s (``scripts/query_soak.py``; RELIABILITY.md quotes its 10-minute run):
every answer is an expected refusal, "ask again", or a bounded answer; /healthz always answers; the sink's resident
memory stays under the bound."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the sink and an embedded broker in processes of their own

BOUND_MIB = 4096  # RELIABILITY.md: two queries at once, each within DuckDB's 1 GiB memory_limit plus its vectors


def test_the_sink_answers_a_hostile_query_mix_with_refusals_and_bounded_answers(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "query_soak.py"),
            "--seconds",
            "20",
            "--seed",
            "2",
            "--bound-mib",
            str(BOUND_MIB),
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    assert lines, (done.stdout[-2000:], done.stderr[-3000:])
    result = json.loads(lines[-1])
    print(f"\nRELIABILITY query soak (20 s): {json.dumps(result)}")
    assert result["unexpected"] == [], result["unexpected"]
    assert set(result["health_polls"]) == {"ok"}, result["health_polls"]
    assert result["sink_alive"] and result["final_query_rows"] == [[3000]], result
    assert result["peak_rss_mib"] <= BOUND_MIB, result
    answered = {k.rsplit(" ", 1)[0] for k in result["outcomes"] if not k.endswith(" 503") and k != "unexpected"}
    assert len(answered) >= 5, result["outcomes"]  # the mix ran: several kinds of request answered, not only "busy"
    assert done.returncode == 0, done.stderr[-3000:]
