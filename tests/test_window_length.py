"""scripts/window_length.py: recordings cut into windows and scored (here two corpus fixtures of 10 steps, cut at 5)."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

from lockstep.app.real_corpus import CORPUS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "window_length.py"


def test_each_recording_is_scored_as_its_first_steps_the_rest_the_whole_and_a_follow_up(tmp_path, capsys, monkeypatch):
    for case in ("extra_forward-strong-w3", "healthy-w3"):
        for f in CORPUS.glob(f"{case}.*"):
            shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path), "--first", "5", "--json"])
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code == 0
    rows = json.loads(capsys.readouterr().out)
    ways = {(r["kind"], r["window"]): r for r in rows}
    assert {w for _, w in ways} == {"first", "rest", "whole", "follow-up"}
    assert {k for k, _ in ways} == {"one", "healthy"}
    assert all(r["jobs"] == 1 for r in rows)
    assert ways[("one", "whole")]["faults"] == 1 and ways[("healthy", "whole")]["faults"] == 0
    # the whole recording is the corpus's own window: scored as `lockstep evaluate --real` scores it
    assert ways[("one", "whole")]["worker_function"] == 1
    assert ways[("healthy", "whole")]["false_confident"] == 0
