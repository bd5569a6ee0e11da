"""``lockstep demo``: a simulated 64-worker job with one injected fault, diagnosed end to end.

Safe by construction: it reads no environment variable and no settings file (a production
``LOCKSTEP_CONFIG`` must not point it at production Kafka, consumer groups or stores), starts its own
embedded broker unless ``--bootstrap-servers`` is given, uses consumer groups of its own, and writes
into a new temporary folder unless ``--db`` names a file, which it writes only if it does not exist or
a previous demo created it.
"""

from __future__ import annotations

from pathlib import Path

from .. import config


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on the embedded broker and diagnose an injected fault",
        description="Reads flags only (no LOCKSTEP_* variable, no settings file): its own embedded broker, consumer "
        "groups and temporary store unless told otherwise here.",
    )
    p.add_argument(
        "--workers", type=int, default=64, help="workers in the simulated job (default 64: 8 hosts x 8 GPUs)"
    )
    faults = [*worker_faults(), "hang"]
    p.add_argument(
        "--fault",
        default="gpu_throttle_thermal",
        choices=faults,
        metavar="FAULT",
        help=f"fault to inject: one of {', '.join(faults)} (default gpu_throttle_thermal; hang: the culprit stops in "
        "its data loading and the job hangs; other faults: --scenario)",
    )
    p.add_argument("--culprit", type=int, default=13, help="worker the fault hits (default 13)")
    p.add_argument("--scenario", type=Path, help="a scenario file instead of --workers/--fault/--culprit")
    p.add_argument("--timeout", type=float, default=90.0, help="give up after this many seconds (default 90)")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this folder")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list of Finding records")
    config.add_arguments(
        p,
        command="demo",
        config_file=False,
        environment=False,
        defaults_shown={
            "db": "lockstep.duckdb in a new temporary folder",
            "topic_prefix": "lockstep on its own broker, a new lockstep-demo-* on a given Kafka",
        },
        title="settings (flags only: the demo reads no LOCKSTEP_* variable and no settings file; --db: a new file, "
        "or one a previous demo wrote)",
    )
    p.set_defaults(func=run)


def worker_faults() -> list[str]:
    """The faults ``--fault`` injects: those of one worker with a cause (the others need a scenario file)."""
    from ..producers.simulator.faults import CATALOGUE

    return [name for name, kind in CATALOGUE.items() if kind.target == "workers" and kind.cause]


def run(args) -> int:
    import logging

    from ..app.demo import claim_store, default_scenario, demo_settings, hang_scenario, run_demo
    from ..app.output import findings_table, plural, print_json, table
    from ..app.progress import Progress, wanted
    from ..logs import setup_logging
    from ..producers.simulator.fleet import Scenario
    from ..sinks.report.data import gather
    from ..sinks.report.page import render

    settings = demo_settings(args)
    show = wanted(args.json)
    setup_logging("WARNING" if args.json else settings.log_level, settings.log_format)
    logging.getLogger("lockstep.simulator").setLevel(logging.WARNING)
    hang = None
    if args.scenario:
        scenario = Scenario.load(args.scenario)
    elif args.fault == "hang":
        if not 0 <= args.culprit < args.workers:
            raise config.ConfigError(f"--culprit: {args.culprit} is not a worker of 0..{args.workers - 1}")
        scenario, hang = hang_scenario(args.workers, args.culprit)
    else:
        if args.fault not in worker_faults():  # argparse checks a flag; this, a caller's args
            raise config.ConfigError(
                f"--fault: {args.fault!r} is not one of {', '.join(worker_faults())}, hang (other faults: --scenario FILE)"
            )
        if args.workers < 1:
            raise config.ConfigError(f"--workers: {args.workers} must be at least 1")
        if not 0 <= args.culprit < args.workers:
            raise config.ConfigError(f"--culprit: {args.culprit} is not a worker of 0..{args.workers - 1}")
        scenario = default_scenario(args.workers, args.fault, args.culprit)
    if args.timeout <= 0:
        raise config.ConfigError(f"--timeout: {args.timeout:g} must be > 0")
    page = claim_store(settings.db, explicit=args.db is not None)
    with Progress(show, "starting the pipeline") as bar:
        res = run_demo(settings, scenario, timeout_s=args.timeout, keep_logs=args.logs, status=bar.status, hang=hang)
        bar.status("writing the report")
        page.write_text(
            render(gather_store(gather, res.db), title=f"Lockstep demo: {scenario.job}", scope=f"the demo's {res.db}")
        )
    if args.json:
        print_json(res.findings)
        return 0
    f = scenario.faults[0] if scenario.faults else None
    print()
    if f:
        print(f"Injected: {f.type} on {fault_target(f, scenario.topology)} of {scenario.job} from step {f.start_step}.")
    if hang:
        print(
            f"Injected: hang of worker {hang.culprit} (stuck in its data loading) of {scenario.job} at step {hang.at_step}."
        )
    print(f"Findings in {res.db}:\n")
    print(findings_table(res.findings))
    for w in res.windows:
        print(
            f"\nWindow {w['window_id']}: steps {w['start_step']}..{w['start_step'] + w['steps'] - 1}, "
            f"coverage {w['coverage']:.0%} of {plural(w['expected_workers'], 'worker')}, {w['bytes_per_worker'] / 1024:.1f} KiB per worker, closed {w['closed']}."
        )
    print("\nThrough Kafka:\n")
    print(table(["topic", "records", "bytes"], [(t.topic, t.records, t.bytes) for t in res.topics]))
    print(f"\nDone in {res.seconds:.1f} s. Pictures of the finding: open {page}")
    print(
        f'Try: lockstep findings --db {res.db}   or   lockstep query --db {res.db} "SELECT cause, count(*) FROM findings GROUP BY cause"'
    )
    return 0


def gather_store(gather, db):
    from ..sinks.http import query

    return gather(lambda sql, params=None: query(db, sql, params))


def fault_target(f, topo) -> str:
    """What a fault hits, named: ``worker 13``, ``host node0003``, ``NIC node0003/bond1``, ``stage 2``."""
    named = [
        ("worker", "workers", [str(w) for w in f.workers]),
        ("host", "hosts", [topo.host_name(h) for h in f.hosts]),
        ("NIC", "NICs", list(f.nics)),
        ("switch", "switches", list(f.switches)),
        ("pipeline stage", "pipeline stages", [] if f.stage is None else [str(f.stage)]),
    ]
    parts = [f"{one if len(xs) == 1 else many} {', '.join(xs)}" for one, many, xs in named if xs]
    if f.function and not parts:
        parts.append(f"function {f.function} on every worker")
    return " and ".join(parts) or "the whole job"
