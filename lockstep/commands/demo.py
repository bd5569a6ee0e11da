"""``lockstep demo``: a simulated 64-worker job with one injected fault, diagnosed end to end."""

from __future__ import annotations

from pathlib import Path

from .. import config


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline on the embedded broker and diagnose an injected fault")
    config.add_arguments(p)
    p.add_argument("--workers", type=int, default=64, help="workers in the simulated job (default 64: 8 hosts x 8 GPUs)")
    p.add_argument("--fault", default="gpu_throttle_thermal", help="fault to inject (default gpu_throttle_thermal)")
    p.add_argument("--culprit", type=int, default=13, help="worker the fault hits (default 13)")
    p.add_argument("--scenario", type=Path, help="a scenario file instead of --workers/--fault/--culprit")
    p.add_argument("--timeout", type=float, default=90.0, help="give up after this many seconds (default 90)")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this folder")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list of Finding records")
    p.set_defaults(func=run)


def run(args) -> int:
    import logging

    from ..cli import setup_logging
    from ..demo import default_scenario, run_demo
    from ..output import findings_table, print_json, table
    from ..producers.simulator.faults import CATALOGUE
    from ..producers.simulator.fleet import Scenario
    from ..sinks.report import render
    from .report import gather

    settings = config.load(args)
    setup_logging("WARNING" if args.json else settings.log_level)
    logging.getLogger("lockstep.simulator").setLevel(logging.WARNING)
    if args.scenario:
        scenario = Scenario.load(args.scenario)
    else:
        worker_faults = [name for name, kind in CATALOGUE.items() if kind.target == "workers" and kind.cause]
        if args.fault not in worker_faults:
            raise config.ConfigError(f"--fault: {args.fault!r} is not one of {', '.join(worker_faults)} (other faults: --scenario FILE)")
        if not 0 <= args.culprit < args.workers:
            raise config.ConfigError(f"--culprit: {args.culprit} is not a worker of 0..{args.workers - 1}")
        scenario = default_scenario(args.workers, args.fault, args.culprit)
    res = run_demo(settings, scenario, timeout_s=args.timeout, keep_logs=args.logs)
    if args.json:
        print_json(res.findings)
        return 0
    f = scenario.faults[0] if scenario.faults else None
    print()
    if f:
        print(f"Injected: {f.type} on worker(s) {', '.join(map(str, f.workers))} of {scenario.job} from step {f.start_step}.")
    print(f"Findings in {res.db}:\n")
    print(findings_table(res.findings))
    for w in res.windows:
        print(f"\nWindow {w['window_id']}: steps {w['start_step']}..{w['start_step'] + w['steps'] - 1}, "
              f"coverage {w['coverage']:.0%} of {w['expected_workers']} workers, {w['bytes_per_worker'] / 1024:.1f} KiB per worker, closed {w['closed']}.")  # fmt: skip
    print("\nThrough Kafka:\n")
    print(table(["topic", "records", "bytes"], [(t.topic, t.records, t.bytes) for t in res.topics]))
    page = Path(res.db).with_name(f"{Path(res.db).stem}-report.html")
    page.write_text(render(*gather(res.db), title=f"Lockstep demo: {scenario.job}", scope=f"the demo's {res.db}"))
    print(f"\nDone in {res.seconds:.1f}s. Pictures of the finding: open {page}")
    print(f"Try: lockstep findings --db {res.db}   or   lockstep query \"SELECT cause, count(*) FROM findings GROUP BY cause\"")
    return 0
