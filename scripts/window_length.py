"""How the diagnosis depends on the window's length, on real jobs: longer runs of the corpus's cases cut into windows.

    python tests/integration/real_faults.py --long 30 /tmp/long [CASE_ID ...]   # every case again, 30 steps (as root)
    python scripts/window_length.py /tmp/long [--first 10] [--json]

Each recording (``--long``: the case's job run again, its fixture and manifest as the corpus's, its part kept) is cut
after the warm-up into windows of its steps, and each is diagnosed alone as ``lockstep evaluate --real`` diagnoses a
fixture (:func:`lockstep.app.evaluate.judge_real` scores it):

- ``first``: the first ``--first`` steps (the corpus's windows were 10 until 2026-12-04, 24 since);
- ``rest``: the steps after them (a second, longer window of the same job);
- ``whole``: every step, one window;
- ``follow-up``: the findings of ``first``, and of ``rest`` too where ``first`` named no worker at paging confidence
  (a window that explained nothing, followed by a longer one).

Printed per part (dev, test, holdout) and per kind of case (one culprit, two, healthy): the faults with worker and
function right, of those whose window shows the fault (visible), and the confident findings that name a worker not
at fault.  A fresh recording of a case is new data for every part: the rules were developed on the corpus's
recordings, not on these.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.compute as pc

from lockstep.app.evaluate import PAGING, judge_real
from lockstep.app.offline import diagnose
from lockstep.app.real_corpus import fixture_connections, fixture_inputs, load_corpus, read_fixture
from lockstep.streams.policy import load_policy


def _window(table, first: int, last: int):
    return table.filter(pc.and_(pc.greater_equal(table["step"], first), pc.less_equal(table["step"], last)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders of --long recordings (fixtures and manifests)")
    ap.add_argument(
        "--first", type=int, default=10, help="steps in the first window (default 10: the corpus before 2026-12-04)"
    )
    ap.add_argument("--json", action="store_true", help="the figures as JSON")
    args = ap.parse_args(argv)
    policy = load_policy(None)
    tally: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for folder in args.folders:
        for manifest, fixture in load_corpus(folder):
            table, connections = read_fixture(fixture), fixture_connections(fixture)

            def findings(t, case=manifest.case, connections=connections):  # the window's, as evaluate --real's
                inputs = fixture_inputs(t)
                inputs.connections = connections
                return diagnose(inputs, policy, case, now=0.0).findings, t

            start = int(pc.min(table["step"]).as_py())
            first_steps = _window(table, start, start + args.first - 1)
            rest_steps = _window(table, start + args.first, 1 << 40)
            found = {"first": findings(first_steps), "whole": findings(table)}
            if rest_steps.num_rows:
                found["rest"] = findings(rest_steps)
            first, first_t = found["first"]
            explained = any(f.workers and f.confidence >= PAGING for f in first)
            rest = [] if explained or "rest" not in found else found["rest"][0]
            found["follow-up"] = (first + rest, first_t)
            kind = {0: "healthy", 1: "one"}.get(len(manifest.culprits), "two")
            judged = {way: judge_real(manifest, findings, t) for way, (findings, t) in found.items()}
            for way, r in judged.items():
                c = tally[(manifest.split, kind, way)]
                c["jobs"] += 1
                c["faults"] += not r.healthy
                c["worker_function"] += r.worker_function
                c["visible"] += r.visible
                c["worker_function_visible"] += r.worker_function and r.visible
                c["false_confident"] += sum(1 for f in r.false_findings if f.confidence >= PAGING)
                c["followed"] += way == "follow-up" and not explained
            marks = " ".join(f"{w}={'Y' if r.worker_function else '-'}" for w, r in judged.items())
            print(f"{manifest.case}: {marks}", file=sys.stderr, flush=True)  # progress
    rows = [{"part": p, "kind": k, "window": w, **c} for (p, k, w), c in sorted(tally.items())]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'part':8s} {'kind':8s} {'window':10s} {'jobs':>4s} {'worker+function':>16s} {'of visible':>11s} {'false conf':>10s}"
    )
    for r in rows:
        wf = f"{r['worker_function']}/{r['faults']}" if r["faults"] else "-"
        vis = f"{r['worker_function_visible']}/{r['visible']}" if r["faults"] else "-"
        print(
            f"{r['part']:8s} {r['kind']:8s} {r['window']:10s} {r['jobs']:4d} {wf:>16s} {vis:>11s} {r['false_confident']:10d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
