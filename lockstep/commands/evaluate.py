"""``lockstep evaluate [SUITE]``: how well the diagnosis finds injected faults, per fault type.

``lockstep evaluate --detector``: how soon the slowdown detector finds sustained slowdowns, and how
often it fires on healthy jobs (``lockstep/app/detector_eval.py``).

``lockstep evaluate --real [CORPUS]``: the diagnosis on the real-fault corpus (``tests/data/real/corpus/``,
recorded real jobs), per part of its split (dev, test), per mechanism and per job size, also over the faults whose
recording shows them (:func:`lockstep.app.real_corpus.visibility`)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from .. import config


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="run a suite of simulated scenarios through the diagnosis and score it")
    config.add_arguments(p, command="evaluate")
    p.add_argument(
        "suite", type=Path, nargs="?", help="a scenario file or a folder of them (default: the standard suite)"
    )
    p.add_argument(
        "--json", action="store_true", help='print {"overall": {...}, "by_fault": {...}, "calibration": [...]}'
    )
    p.add_argument(
        "--scenarios", action="store_true", help="also list every scenario with its findings (table) or outcome (JSON)"
    )
    r = p.add_argument_group("real-fault corpus")
    r.add_argument(
        "--real",
        action="store_true",
        help="score the diagnosis on the real-fault corpus (SUITE: its folder; default tests/data/real/corpus, with "
        "--part holdout tests/data/real/holdout)",
    )
    r.add_argument(
        "--part",
        choices=["dev", "test", "holdout", "all"],
        default="all",
        help="with --real: the part of the split (default all: dev and test; holdout: the part recorded after them)",
    )
    r.add_argument(
        "--simulated",
        action="store_true",
        help="with --real: also evaluate the standard suite (~1.5 min) for its calibration error beside the corpus's",
    )
    d = p.add_argument_group("detector evaluation")
    d.add_argument(
        "--detector",
        action="store_true",
        help="evaluate the slowdown detector on step-time series instead of the diagnosis on a suite",
    )
    d.add_argument("--runs", type=_positive, default=40, help="runs per series and slowdown size (default 40)")
    d.add_argument(
        "--days",
        type=float,
        default=1.0,
        help="job-days (86,400 steps) of each healthy series per disturbance (default 1)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    d.add_argument(
        "--series", action="append", metavar="NAME", help="evaluate only this series (repeatable; default: all)"
    )
    p.set_defaults(func=run)


def _positive(value: str) -> int:
    import argparse

    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def run(args) -> int:
    import logging

    from ..app.evaluate import evaluate, load_suite
    from ..app.progress import Progress, wanted
    from ..logs import setup_logging
    from ..producers.simulator.suite import standard_suite
    from ..streams.policy import load_policy

    settings = config.load(args)
    setup_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("lockstep.evaluate")
    policy = load_policy(settings.policy)
    if args.detector:
        return run_detector(args, policy)
    if args.real:
        return run_real(args, policy)
    if args.part != "all" or args.simulated:
        raise config.ConfigError("--part and --simulated apply to --real only")
    if args.days != 1.0 or args.runs != 40 or args.seed != 0 or args.series:
        raise config.ConfigError("--runs, --days, --seed and --series apply to --detector only")
    scenarios = load_suite(args.suite) if args.suite else standard_suite()

    with Progress(wanted(args.json), "scenarios", total=len(scenarios), unit="scenario") as bar:

        def progress(i: int, n: int, r) -> None:
            bar.status(r.name)
            bar.update()
            log.debug("%s: %d findings in %.2fs", r.name, len(r.findings), r.seconds)

        summary, results = evaluate(scenarios, policy, progress)
    if args.json:
        if args.scenarios:
            summary["scenarios"] = [scenario_json(r) for r in results]
        print(json.dumps(summary, indent=2))
        return 0
    print(report(summary, policy.ref, str(args.suite or "standard suite")))
    if args.scenarios:
        print()
        print(scenario_table(results))
    return 0


def run_real(args, policy) -> int:
    from ..app.evaluate import evaluate, evaluate_real
    from ..app.progress import Progress, wanted
    from ..app.real_corpus import CORPUS, HOLDOUT
    from ..producers.simulator.suite import standard_suite

    if args.detector:
        raise config.ConfigError("--real and --detector are two evaluations: give one")
    folder = args.suite or (HOLDOUT if args.part == "holdout" else CORPUS)
    with Progress(wanted(args.json), "cases", unit="case") as bar:

        def progress(i: int, n: int, r) -> None:
            bar.status(r.manifest.case)
            bar.update()

        summary, results = evaluate_real(folder, policy, args.part, progress)
    summary["corpus"] = str(folder)
    summary["policy"] = policy.ref
    summary["simulated"] = None
    if args.simulated:
        simulated, _ = evaluate(standard_suite(), policy)
        summary["simulated"] = {
            "suite": "standard",
            "scenarios": simulated["overall"]["scenarios"],
            "calibration_error": simulated["overall"]["calibration_error"],
        }
    if args.scenarios:
        summary["cases"] = [real_case_json(r) for r in results]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(real_report(summary))
    if args.scenarios:
        print()
        print(real_case_table(results))
    return 0


def real_case_json(r) -> dict:
    m = r.manifest
    return {
        "case": m.case,
        "split": m.split,
        "mechanism": m.mechanism,
        "resource": m.resource,
        "ranks": m.ranks,
        "culprits": m.culprits,
        "function": m.function,
        "causes": m.causes,
        "worker": r.worker,
        "worker_function": r.worker_function,
        "cause": r.cause,
        "paging": r.paging,
        "visible": r.visible if not r.healthy else None,
        "visibility": None if r.visibility is None else msgspec.to_builtins(r.visibility),
        "findings": [
            {
                "id": f.id,
                "scope": f.scope,
                "workers": f.workers,
                "function": f.function,
                "cause": f.cause,
                "confidence": f.confidence,
                "step_time_share": f.impact.step_time_share,
            }
            for f in r.findings
        ],
    }


def real_report(summary: dict) -> str:
    from ..app.output import table

    headers = [
        "part",
        "group",
        "cases",
        "faults",
        "worker",
        "worker+fn",
        "cause",
        "paging",
        "conf",
        "healthy: conf/all",
        "false conf",
        "job-wide",
        "calib err",
        "visible",
        "worker+fn vis",
        "paging vis",
    ]
    rows = []
    for part, p in summary["parts"].items():
        groups = [
            ("overall", p["overall"]),
            *((f"mechanism {k}", v) for k, v in p["by_mechanism"].items()),
            *((f"{k} ranks", v) for k, v in p["by_size"].items()),
            *((f"{k} culprit{'s' if k != '1' else ''}", v) for k, v in p["by_culprits"].items() if k != "0"),
        ]
        for name, f in groups:
            rows.append(
                [
                    part,
                    name,
                    f["cases"],
                    f["faults"] or "-",
                    _pct(f["worker"]),
                    _pct(f["worker_function"]),
                    _pct(f["cause"]),
                    _pct(f["paging"]),
                    "-" if f["confidence"] is None else f"{f['confidence']:.2f}",
                    f"{f['healthy_confident']}/{f['healthy_findings']} on {f['healthy']}" if f["healthy"] else "-",
                    f["false_confident"],
                    f"{f['job_wide']} ({f['job_wide_confident']} conf)" if f["faults"] else "-",
                    "-" if f["calibration_error"] is None else f"{f['calibration_error']:.2f}",
                    f["visible"] if f["faults"] else "-",
                    _pct(f["worker_function_visible"]),
                    _pct(f["paging_visible"]),
                ]
            )
    sim = summary.get("simulated")
    cal = ", ".join(
        f"{part} {p['overall']['calibration_error']:.2f}"
        for part, p in summary["parts"].items()
        if p["overall"]["calibration_error"] is not None
    )
    lines = [
        f"Real-fault corpus: {summary['corpus']}; policy {summary['policy']}.",
        "",
        table(headers, rows),
        "",
        f"Expected calibration error on the real corpus: {cal or '-'}; "
        + (
            f"on the simulator's standard suite ({sim['scenarios']} scenarios): {sim['calibration_error']:.2f}."
            if sim and sim["calibration_error"] is not None
            else "the simulator's: lockstep evaluate --real --simulated."
        ),
        "worker: every culprit named (by findings naming culprits only); worker+fn: and with a function the fault slows;",
        "cause: and a cause right for it; paging: worker+fn at confidence >= 0.5; conf: mean confidence of those findings;",
        "healthy conf: confident/all findings on healthy jobs; false conf: confident findings naming a worker that is no",
        "culprit on faulty jobs; job-wide: faulty jobs with a job-scope finding; calib err: expected calibration error;",
        "visible: faults whose recording shows them (each culprit's critical time in the fault's functions above the",
        "others' median in >= 70% of the steps running them, by a median >= 1% of the step); worker+fn vis, paging vis:",
        "worker+fn and paging over those faults only.",
    ]
    return "\n".join(lines)


def real_case_table(results) -> str:
    from ..app.output import table

    rows = []
    for r in results:
        m = r.manifest
        got = (
            "; ".join(
                f"{f.cause} {f.function} {','.join(map(str, f.workers[:4]))} {f.confidence:.2f}" for f in r.findings
            )
            or "(none)"
        )
        ok = "healthy" if r.healthy else ("ok" if r.cause else "fn" if r.worker_function else "MISS")
        rows.append([m.case, m.split, ok, ",".join(map(str, m.culprits)) or "-", visible_cell(r), got])
    return table(["case", "part", "result", "culprits", "visible", "findings"], rows, max_width=70)


def visible_cell(r) -> str:
    """``yes w2 10/10 +20.6%``: visible or not, and per culprit the steps its work in the fault's functions is
    above the others' median, of the steps running them, and its median excess as a share of the step."""
    v = r.visibility
    if v is None:
        return "-"
    per = ", ".join(
        f"w{c} {a}/{v.steps} {e * 100:+.1f}%" for c, a, e in zip(r.manifest.culprits, v.above, v.excess, strict=True)
    )
    return f"{'yes' if v.visible else 'no'} {per}"


def run_detector(args, policy) -> int:
    import sys

    from ..app.detector_eval import evaluate_detector, families
    from ..app.detector_eval import report as detector_report

    if args.suite or args.scenarios:
        raise config.ConfigError(
            "--detector takes no SUITE and no --scenarios: its series are built in (lockstep/app/detector_eval.py)"
        )
    if not args.days > 0:
        raise config.ConfigError(f"--days must be > 0, got {args.days}")
    interactive = sys.stderr.isatty() and not args.json

    def progress(name: str) -> None:
        if interactive:
            print(f"\r{name:30s}", end="", file=sys.stderr, flush=True)

    try:
        fams = families(args.seed, only=tuple(args.series or ()))
    except ValueError as exc:
        raise config.ConfigError(f"--series: {exc}") from None
    summary = evaluate_detector(policy, runs=args.runs, days=args.days, seed=args.seed, fams=fams, progress=progress)
    if interactive:
        print("\r" + " " * 30 + "\r", end="", file=sys.stderr)
    print(json.dumps(summary, indent=2) if args.json else detector_report(summary))
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def report(summary: dict, policy_ref: str, suite: str) -> str:
    from ..app.output import plural, table

    rows = []
    for name, f in [*summary["by_fault"].items(), ("overall", summary["overall"])]:
        rows.append(
            [
                name,
                f["scenarios"],
                f["faults"] or "-",
                _pct(f["accuracy"]),
                _pct(f["recall"]),
                _pct(f["precision"]),
                _pct(f["worker"]),
                _pct(f["host"]),
                _pct(f["device"]),
                _pct(f["function"]),
                _pct(f["cause"]),
                f["false_findings"],
                "-" if f["confidence"] is None else f"{f['confidence']:.2f}",
                "-" if f["impact_abs_error"] is None else f"{f['impact_abs_error'] * 100:.1f}",
            ]
        )
    headers = [
        "fault",
        "scen",
        "faults",
        "accuracy",
        "recall",
        "precision",
        "worker",
        "host",
        "device",
        "function",
        "cause",
        "false",
        "conf",
        "impact err",
    ]
    o = summary["overall"]
    lines = [
        f"Suite: {suite}, {plural(o['scenarios'], 'scenario')}; policy {policy_ref}; {o['seconds']:.0f} s of diagnosis and simulation.",
        "",
        table(headers, rows),
        "",
        f"Healthy scenarios: {o['healthy_scenarios']}, findings on them: {o['healthy_false_findings']}. "
        f"Scenarios that must stay silent and did: {_pct(o['silent_ok'])}.",
        "Calibration (confidence -> share right): "
        + ", ".join(
            f"{b['confidence'][0]:.1f}-{b['confidence'][1]:.1f}: {b['findings']} -> {_pct(b['right'])}"
            for b in summary["calibration"]
            if b["findings"]
        )
        + ("" if o["calibration_error"] is None else f"; expected calibration error {o['calibration_error']:.2f}."),
        "accuracy: culprit, function and cause right; recall: culprit right; precision: findings that name an injected culprit;",
        "worker/host/device/function/cause: share of faults where that part is right; impact err: |estimated - true| step-time share, points.",
    ]
    return "\n".join(lines)


def scenario_json(r) -> dict:
    return {
        "name": r.name,
        "category": r.category,
        "workers": r.workers,
        "coverage": r.coverage,
        "faults": [
            {
                "truth": o.truth.to_dict(),
                "correct": o.correct,
                "localised": o.localised,
                "function": o.function,
                "cause": o.cause,
                "finding": o.finding.id if o.finding else None,
            }
            for o in r.faults
        ],
        "findings": [
            {
                "id": f.id,
                "workers": f.workers,
                "devices": f.devices,
                "function": f.function,
                "cause": f.cause,
                "scope": f.scope,
                "confidence": f.confidence,
                "step_time_share": f.impact.step_time_share,
            }
            for f in r.findings
        ],
    }


def scenario_table(results) -> str:
    from ..app.output import table

    rows = []
    for r in results:
        expected = (
            "; ".join(
                f"{o.truth.fault} {','.join(map(str, o.truth.workers[:4]))}{'…' if len(o.truth.workers) > 4 else ''}"
                for o in r.faults
            )
            or "(none)"
        )
        got = (
            "; ".join(
                f"{f.cause} {f.function} {','.join(map(str, f.workers[:4]))}{'…' if len(f.workers) > 4 else ''}"
                for f in r.findings
            )
            or "(none)"
        )
        ok = all(o.correct for o in r.faults) and sum(r.true_findings) == len(r.findings)
        rows.append([r.name, "ok" if ok else "MISS", expected, got])
    return table(["scenario", "result", "injected", "findings"], rows, max_width=70)
