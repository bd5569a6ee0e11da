"""`lockstep evaluate --real`: the real-fault corpus's table, recounted independently from the findings it lists.

The figures are not asserted to be high (the diagnosis changes); they must be what the listed findings and the
manifests say, counted here by other code.
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from lockstep.app.offline import diagnose
from lockstep.app.real_corpus import CORPUS, Manifest, Visibility, load_fixture
from lockstep.commands.cli import main
from lockstep.streams.policy import Policy

PAGING = 0.5


@pytest.fixture(scope="module")
def run_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["evaluate", "--real", "--json", "--scenarios"]) == 0
    return json.loads(out.getvalue())


def manifests() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))}


def names_only_culprits(f: dict, culprits: list[int]) -> bool:
    return bool(f["workers"]) and set(f["workers"]) <= set(culprits)


def recount(cases: list[dict], mans: dict[str, dict]) -> dict:
    """The figures of a group of cases, from their findings and manifests alone."""
    faults = [c for c in cases if mans[c["case"]]["culprits"]]
    healthy = [c for c in cases if not mans[c["case"]]["culprits"]]

    def per_culprit(c: dict, ok) -> bool:
        m = mans[c["case"]]
        return all(
            any(c_ in f["workers"] and names_only_culprits(f, m["culprits"]) and ok(f, m) for f in c["findings"])
            for c_ in m["culprits"]
        )

    fn = lambda f, m: re.search(m["function"], f["function"] or "") is not None  # noqa: E731
    cause = lambda f, m: fn(f, m) and f["cause"] in m["causes"]  # noqa: E731
    share = lambda k: round(k / len(faults), 4) if faults else None  # noqa: E731
    healthy_findings = [f for c in healthy for f in c["findings"]]
    visible = [c for c in faults if c["visible"]]
    shown = lambda k: round(k / len(visible), 4) if visible else None  # noqa: E731
    wrong = [f for c in faults for f in c["findings"] if not names_only_culprits(f, mans[c["case"]]["culprits"])]
    return {
        "cases": len(cases),
        "faults": len(faults),
        "worker": share(sum(per_culprit(c, lambda f, m: True) for c in faults)),
        "worker_function": share(sum(per_culprit(c, fn) for c in faults)),
        "cause": share(sum(per_culprit(c, cause) for c in faults)),
        "paging": share(sum(per_culprit(c, lambda f, m: fn(f, m) and f["confidence"] >= PAGING) for c in faults)),
        "healthy": len(healthy),
        "healthy_findings": len(healthy_findings),
        "healthy_confident": sum(f["confidence"] >= PAGING for f in healthy_findings),
        "false_confident": sum(f["confidence"] >= PAGING for f in wrong),
        "job_wide": sum(any(f["scope"] == "job" for f in c["findings"]) for c in faults),
        "findings": sum(len(c["findings"]) for c in cases),
        "visible": len(visible),
        "worker_function_visible": shown(sum(per_culprit(c, fn) for c in visible)),
        "paging_visible": shown(
            sum(per_culprit(c, lambda f, m: fn(f, m) and f["confidence"] >= PAGING) for c in visible)
        ),
    }


def test_the_corpus_is_broad_and_split_in_both_parts():
    mans = manifests()
    faulty = [m for m in mans.values() if m["culprits"]]
    mechanisms = {m["mechanism"] for m in faulty}
    assert len(mechanisms) >= 12 and len({m["resource"] for m in faulty}) >= 6
    for mech in mechanisms:  # both severities, both parts
        mine = [m for m in faulty if m["mechanism"] == mech]
        assert {"mild", "strong"} <= {m["severity"] for m in mine} <= {"mild", "medium", "strong"}, mech
        assert {m["split"] for m in mine} == {"dev", "test"}, mech
    assert {m["ranks"] for m in faulty} == {2, 3, 4, 8}
    assert any(len(m["culprits"]) == 2 for m in faulty)
    healthy = [m for m in mans.values() if not m["culprits"]]
    assert any(m["neighbour"] for m in healthy) and any(not m["neighbour"] for m in healthy)
    for m in mans.values():
        assert (CORPUS / m["fixture"]).stat().st_size < 200_000, m["case"]
        assert all(0 <= c < m["ranks"] for c in m["culprits"])


def test_the_table_is_an_independent_recount_of_the_findings(run_json):
    mans = manifests()
    out = run_json
    assert set(out["parts"]) == {"dev", "test", "all"}
    cases = out["cases"]
    assert sorted(c["case"] for c in cases) == sorted(mans)
    for c in cases:
        assert c["split"] == mans[c["case"]]["split"]
    for part, figures in out["parts"].items():
        mine = [c for c in cases if part == "all" or mans[c["case"]]["split"] == part]
        groups = {"overall": ("overall", mine)}
        for mech in {mans[c["case"]]["mechanism"] for c in mine}:
            groups[f"m:{mech}"] = (("by_mechanism", mech), [c for c in mine if mans[c["case"]]["mechanism"] == mech])
        for size in {mans[c["case"]]["ranks"] for c in mine}:
            groups[f"s:{size}"] = (("by_size", str(size)), [c for c in mine if mans[c["case"]]["ranks"] == size])
        for n in {len(mans[c["case"]]["culprits"]) for c in mine}:
            groups[f"c:{n}"] = (("by_culprits", str(n)), [c for c in mine if len(mans[c["case"]]["culprits"]) == n])
        assert set(figures["by_culprits"]) == {k[2:] for k in groups if k.startswith("c:")}
        assert set(figures["by_mechanism"]) == {k[2:] for k in groups if k.startswith("m:")}
        assert set(figures["by_size"]) == {k[2:] for k in groups if k.startswith("s:")}
        for where, group in groups.values():
            got = figures["overall"] if where == "overall" else figures[where[0]][where[1]]
            expected = recount(group, mans)
            assert {k: got[k] for k in expected} == expected, (part, where)
        # calibration: findings binned by confidence, the right ones (culprits only, function and cause right)
        bins = figures["calibration"]
        assert sum(b["findings"] for b in bins) == figures["overall"]["findings"]
        for b in bins:
            lo, hi = b["confidence"]
            inside = [
                (f, mans[c["case"]])
                for c in mine
                for f in c["findings"]
                if lo <= f["confidence"] < hi or f["confidence"] == hi == 1.0
            ]
            assert b["findings"] == len(inside)
            right = sum(
                names_only_culprits(f, m["culprits"])
                and re.search(m["function"], f["function"] or "") is not None
                and f["cause"] in m["causes"]
                for f, m in inside
            )
            assert b["right"] == (round(right / len(inside), 4) if inside else None)


def test_the_findings_listed_are_lockstep_diagnoses(run_json):
    """The findings of a faulty and a healthy case are what the library ``lockstep diagnose`` uses gives."""
    mans = manifests()
    by_case = {c["case"]: c for c in run_json["cases"]}
    faulty = next(k for k, m in sorted(mans.items()) if m["culprits"])
    healthy = next(k for k, m in sorted(mans.items()) if not m["culprits"])
    for case in (faulty, healthy):
        findings = diagnose(load_fixture(CORPUS / mans[case]["fixture"]), Policy(), case, now=0.0).findings
        listed = by_case[case]["findings"]
        assert [f["id"] for f in listed] == [f.id for f in findings]
        assert [(f["workers"], f["function"], f["cause"]) for f in listed] == [
            (msgspec.to_builtins(f.workers), f.function, f.cause) for f in findings
        ]


def test_every_case_says_whether_its_recording_shows_the_fault(run_json):
    """``visible`` is the fixture's visibility (computed here from the fixture), None on a healthy job; the table of
    cases says it too."""
    from lockstep.app.real_corpus import VISIBILITY_COLUMNS, read_fixture, visibility
    from lockstep.commands.evaluate import visible_cell

    mans = manifests()
    for c in run_json["cases"]:
        m = mans[c["case"]]
        v = visibility(read_fixture(CORPUS / m["fixture"], VISIBILITY_COLUMNS), m["culprits"], m["function"])
        assert c["visible"] == (None if v is None else v.visible), c["case"]
        assert c["visibility"] == (None if v is None else msgspec.to_builtins(v)), c["case"]
    faulty = [c for c in run_json["cases"] if c["visible"] is not None]
    assert any(c["visible"] for c in faulty) and not all(c["visible"] for c in faulty)
    assert run_json["parts"]["all"]["overall"]["visible"] == sum(c["visible"] for c in faulty)

    class Case:  # what visible_cell reads of a result
        def __init__(self, c: dict) -> None:
            self.manifest = msgspec.convert(mans[c["case"]], type=Manifest)
            self.visibility = None if c["visibility"] is None else msgspec.convert(c["visibility"], type=Visibility)

    for c in run_json["cases"]:
        cell = visible_cell(Case(c))
        assert cell == "-" if c["visible"] is None else cell.startswith("yes " if c["visible"] else "no "), cell


def test_the_text_table_has_both_parts(run_json):
    from lockstep.commands.evaluate import real_report

    text = real_report(run_json)
    header = text.splitlines()[2].split()
    assert header[-8:] == ["job-wide", "calib", "err", "visible", "worker+fn", "vis", "paging", "vis"]
    assert re.search(r"^dev\s+overall", text, re.M) and re.search(r"^test\s+overall", text, re.M)
    for mech in {m["mechanism"] for m in manifests().values()}:
        assert re.search(rf"^test\s+mechanism {mech}\s", text, re.M), mech
    assert "calibration error on the real corpus" in text


def test_a_part_alone_and_another_corpus_folder(tmp_path, capsys):
    import shutil

    mans = manifests()
    picked = [next(k for k, m in sorted(mans.items()) if m["split"] == part) for part in ("dev", "test")]
    for case in picked:
        shutil.copy(CORPUS / f"{case}.json", tmp_path)
        shutil.copy(CORPUS / mans[case]["fixture"], tmp_path)
    assert main(["evaluate", "--real", str(tmp_path), "--part", "dev", "--json", "--scenarios"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["parts"]) == {"dev"} and out["parts"]["dev"]["overall"]["cases"] == 1
    assert [c["case"] for c in out["cases"]] == [picked[0]]


def test_a_missing_corpus_is_a_one_line_error(tmp_path, capsys):
    assert main(["evaluate", "--real", str(tmp_path / "nowhere")]) != 0
    err = capsys.readouterr().err
    assert "no such corpus folder" in err and "Traceback" not in err
    assert main(["evaluate", "--part", "dev"]) != 0
    assert "--real only" in capsys.readouterr().err


def test_the_holdout_part_is_its_own_folder_of_new_sizes_and_severities():
    from lockstep.app.real_corpus import HOLDOUT, load_corpus

    held = [m for m, _ in load_corpus(HOLDOUT)]
    assert {m.split for m in held} == {"holdout"}
    faulty = [m for m in held if len(m.culprits) == 1]
    assert len({m.mechanism for m in faulty}) == len(faulty) >= 12  # one case per mechanism
    two = [m for m in held if len(m.culprits) == 2]  # and a cohort of two-culprit jobs, one per mechanism
    assert len({m.mechanism for m in two}) == len(two) >= 12 and all(m.case.endswith("-two-h") for m in two)
    corpus = manifests()
    for m in faulty:  # a size the mechanism's one-culprit dev/test cases do not have
        sizes = {c["ranks"] for c in corpus.values() if c["mechanism"] == m.mechanism and len(c["culprits"]) == 1}
        assert m.ranks not in sizes, m.case
    assert "medium" in {m.severity for m in faulty}
    assert {m.ranks for m in faulty} == {2, 3, 4, 8}
    assert any(m.neighbour for m in held if not m.culprits)
    assert not {m.case for m in held} & set(corpus)


def test_the_holdout_part_alone(tmp_path, capsys):
    import shutil

    from lockstep.app.real_corpus import HOLDOUT

    case = sorted(HOLDOUT.glob("*.json"))[0]
    shutil.copy(case, tmp_path)
    shutil.copy(case.with_suffix(".parquet"), tmp_path)
    assert main(["evaluate", "--real", str(tmp_path), "--part", "holdout", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["parts"]) == {"holdout"} and out["parts"]["holdout"]["overall"]["cases"] == 1
    assert main(["evaluate", "--real", str(tmp_path), "--json"]) == 0  # all: the parts the folder has
    assert set(json.loads(capsys.readouterr().out)["parts"]) == {"dev", "test", "holdout", "all"}
