"""``lockstep trigger JOB``: an operator's profiling window, decided by the detector
(:func:`lockstep.app.operator.request_window`)."""

from __future__ import annotations

from .. import config
from ._kafka import reach_kafka


def register(sub) -> None:
    p = sub.add_parser(
        "trigger", help="ask the detector for a profiling window of a job (same policy checks as its own)"
    )
    config.add_arguments(p, command="trigger")
    p.add_argument("job", help="the job to profile")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps in the window (default: the policy's window_steps, or small_job_window_steps for a job of at most "
        "small_job_workers workers)",
    )
    p.add_argument("--reason", default="", help="why, recorded in the trigger")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the detector's answer (default 30)")
    p.add_argument("--json", action="store_true", help="print the ProfileTrigger (or TriggerRefused) record as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..app.operator import TriggerError, request_window
    from ..app.output import print_json, table
    from ..schemas.records import TriggerRefused, to_builtins

    settings = config.load(args)
    if not settings.bootstrap_servers:
        raise config.ConfigError(
            "bootstrap_servers: `lockstep trigger` talks to the running processors; pass --bootstrap-servers"
        )
    if args.steps is not None and not 1 <= args.steps <= 10_000:
        raise config.ConfigError(f"--steps: {args.steps} is not in 1..10000")
    reach_kafka(settings)
    answer = request_window(settings, args.job, steps=args.steps, reason=args.reason, timeout_s=args.timeout)
    if args.json:
        print_json(to_builtins(answer))
    if isinstance(answer, TriggerRefused):
        raise TriggerError(f"refused ({answer.code}): {answer.reason}")
    if not args.json:
        t = answer
        print(
            table(
                ["job", "window", "steps", "workers", "kind", "policy", "reason"],
                [
                    [
                        t.job,
                        t.window,
                        f"{t.start_step}..{t.start_step + t.steps - 1}",
                        t.expected_workers,
                        t.kind,
                        t.policy_ref,
                        t.reason,
                    ]
                ],
                max_width=100,
            )
        )
    return 0
