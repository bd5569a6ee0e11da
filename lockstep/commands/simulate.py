"""``lockstep simulate SCENARIO (--out DIR | --publish)``: a simulated fleet, to files or live through Kafka."""

from __future__ import annotations

from pathlib import Path

from .. import config
from ._kafka import reach_kafka


def register(sub) -> None:
    p = sub.add_parser("simulate", help="run a simulated fleet from a scenario file")
    config.add_arguments(p, command="simulate")
    p.add_argument("scenario", type=Path, help="scenario file (YAML or JSON)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--out", type=Path, metavar="DIR", help="write the records (Parquet) and the ground truth (truth.json) to DIR"
    )
    where.add_argument(
        "--publish", action="store_true", help="publish live through Kafka, following the control topic like agents do"
    )
    p.add_argument(
        "--steps-per-s", type=float, default=25.0, help="--publish: pace of the live fleet (default 25 steps/s)"
    )
    p.add_argument(
        "--windows",
        type=int,
        default=1,
        help="--publish: stop 3 steps after this many profiling windows were delivered (default 1: with the default "
        "policy the first window is triggered and delivered within the first hundred steps, so a run is short); 0: "
        "deliver every window until --max-steps. Either way every worker then sends its final heartbeat, as agents "
        "do when a job ends",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=2000,
        help="--publish: the most steps published, whatever was delivered (default 2000); the run ends earlier when "
        "--windows windows were delivered",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.progress import Progress, wanted
    from ..logs import setup_logging
    from ..producers.simulator.fleet import Scenario
    from ..units import number

    settings = config.load(args)
    setup_logging(settings.log_level, settings.log_format)
    scenario = Scenario.load(args.scenario)
    show = wanted()
    if args.out:
        from ..producers.simulator.files import write_records

        with Progress(show, "simulating", total=0, unit="step") as bar:

            def on_step(step: int, last: int) -> None:
                bar.set_total(last)
                bar.update()

            w = write_records(scenario, args.out, progress=on_step)
        print(
            f"{number(w.heartbeats)} heartbeats, {number(w.feature_batches)} feature batches ({number(w.feature_rows)} function rows) "
            f"of window(s) {', '.join(w.windows)} and the ground truth written to {w.folder}"
        )
        return 0
    if not args.publish:
        raise config.ConfigError("simulate: say where the records go: --out DIR or --publish")
    if args.windows < 0 or args.max_steps < 1:
        raise config.ConfigError("simulate: --windows must be >= 0 and --max-steps >= 1")
    if not settings.bootstrap_servers:
        raise config.ConfigError(
            "bootstrap_servers: --publish needs a running Kafka (--bootstrap-servers) with a processor attached"
        )
    reach_kafka(settings)
    from ..broker import kafka_or_embedded
    from ..kafka import Publisher, Tail, consumer_config, ensure_topics, producer_config
    from ..producers.simulator.fleet import FleetSimulator
    from ..producers.simulator.live import run_live

    with kafka_or_embedded(settings) as s:
        topics = ensure_topics(s)
        with Tail(consumer_config(s, None), topics.control).open() as control, Progress(show, "publishing") as bar:

            def progress(step, res) -> None:
                bar.status(f"step {step}, {len(res.windows_done)} of {args.windows or 'any'} window(s) delivered")

            res = run_live(
                FleetSimulator(scenario),
                Publisher(producer_config(s)),
                control,
                topics,
                steps_per_s=args.steps_per_s,
                max_steps=args.max_steps,
                stop_after_windows=args.windows,
                progress=progress,
            )
    why = (
        f"stopped 3 steps after {args.windows} window(s) were delivered (--windows; 0: run --max-steps)"
        if args.windows and len(res.windows_done) >= args.windows
        else f"stopped at --max-steps {args.max_steps}"
    )
    print(
        f"{res.steps} steps ({why}); windows delivered: {', '.join(res.windows_done) or 'none'}; "
        f"refused triggers: {len(res.refused)}"
    )
    return 0
