"""``lockstep agent run -- CMD``: run a training command with the host agent attached, no code change.

``lockstep agent env`` prints the same environment for launchers that cannot wrap
the command (Kubernetes manifests, Slurm scripts).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import config
from ..schemas.errors import LockstepError

#: a worker's identity, discovered in each process; a flag fixes it for every process the command starts
IDENTITY = ("rank", "local_rank", "world_size", "host", "device", "nic")


def register(sub) -> None:
    from ..producers.agent.settings import FIELDS

    p = sub.add_parser("agent", help="attach the host agent to a training job without editing it")
    agent_sub = p.add_subparsers(dest="agent_command", metavar="SUBCOMMAND")
    run_p = agent_sub.add_parser(
        "run",
        help="run a command (e.g. torchrun ...) with the agent attached to every training process",
        description="Everything after -- is the command.",
    )
    env_p = agent_sub.add_parser(
        "env", help="print the environment that attaches the agent (for launchers that cannot wrap)"
    )
    for q in (run_p, env_p):
        config.add_arguments(q, command="agent")
        group = q.add_argument_group(
            "agent settings (flag > LOCKSTEP_AGENT_<NAME> environment > LOCKSTEP_AGENT_CONFIG file > default)"
        )
        for name, f in FIELDS.items():
            if f.metadata.get("kafka"):  # the agent's Kafka settings are the pipeline's flags above
                continue
            fixed = (
                (
                    " Fixes it for every process the command starts: for launchers that run one process per command "
                    "(srun, mpirun wrappers), not torchrun"
                )
                if name in IDENTITY
                else ""
            )
            group.add_argument(
                f"--{name.replace('_', '-')}",
                dest=f"agentcfg_{name}",
                default=None,
                metavar=name.upper(),
                action="append" if name == "labels" else None,
                help=f"{f.metadata['help']} (env LOCKSTEP_AGENT_{name.upper()}).{fixed}",
            )
    status_p = agent_sub.add_parser(
        "status",
        help="each job's agents: how many report, their last step, and (with --processor) their counters",
        description="Reads the findings store (the step times the sink keeps: which jobs' agents report, how many, "
        "up to which step) and, with --processor, the processors' /metrics (the agents' own counters, carried on "
        "their heartbeats: records dropped, records waiting in spools, triggers refused, windows failed).",
    )
    status_p.add_argument(
        "--db", type=Path, default=None, help="DuckDB findings file (default: settings db, lockstep.duckdb)"
    )
    status_p.add_argument(
        "--processor",
        action="append",
        default=[],
        metavar="URL",
        help="a processor's HTTP address (http://host:6066), repeatable: every processor of the group, since each "
        "counts the jobs of its own partitions (default: none; the counters are then left out)",
    )
    status_p.add_argument("--job", help="only this job")
    status_p.add_argument("--tenant", help="only this tenant (the query runs on that tenant's rows only)")
    status_p.add_argument("--json", action="store_true", help="print a JSON list of jobs")
    status_p.set_defaults(func=status)
    run_p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    run_p.set_defaults(func=run)
    env_p.add_argument("--json", action="store_true", help="a JSON object instead of shell export lines")
    env_p.set_defaults(func=print_env)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def agent_env(args) -> dict[str, str]:
    """The variables that attach the agent, checked the way the agent will check them."""
    from ..producers.agent import settings as agent_settings
    from ..producers.agent.hook import BOOT_DIR

    settings = config.load(args)
    overrides = {
        name[len("agentcfg_") :]: v for name, v in vars(args).items() if name.startswith("agentcfg_") and v is not None
    }
    if isinstance(overrides.get("labels"), list):
        overrides["labels"] = ",".join(overrides["labels"])
    overrides.update(
        bootstrap_servers=settings.bootstrap_servers, topic_prefix=settings.topic_prefix, kafka=settings.kafka
    )
    if "run_id" not in overrides and not os.environ.get(agent_settings.env_name("run_id")):
        # every process the command starts is one run: its ranks' spools and exports are its own (a later run of
        # the same job never sends them), and a restart of a rank within the run (torchrun) finds its spool
        overrides["run_id"] = agent_settings.discovered_run_id(dict(os.environ)) or agent_settings.new_run_id()
    cfg = agent_settings.load(overrides, source="--{flag}")
    env = agent_settings.to_env(cfg)
    env[agent_settings.env_name("job")] = cfg.job  # always: it is what switches the hook on
    current = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + current if current else "")
    return env


def run(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise config.ConfigError(
            "agent run: give the command after --, e.g. lockstep agent run --job J -- torchrun --nproc-per-node 8 train.py"
        )
    env = agent_env(args)
    exe = shutil.which(cmd[0])
    if exe is None:
        raise config.ConfigError(f"agent run: command {cmd[0]!r} not found")
    sys.stdout.flush()
    os.execve(exe, cmd, {**os.environ, **env})
    return 0  # not reached


def print_env(args) -> int:
    env = agent_env(args)
    if args.json:
        print(json.dumps(env, indent=2, sort_keys=True))
    else:
        for k in sorted(env):
            print(f"export {k}={shlex.quote(env[k])}")
    return 0


class ProcessorUnreachable(LockstepError, ConnectionError):
    """A processor named with ``--processor`` did not serve its metrics."""


#: the agents' counters (AgentCounters on their heartbeats) as the processors export them, per job
COUNTERS = ("dropped_records", "spooled_records", "refused_triggers", "failed_windows")


@dataclass
class JobAgents:
    """One job's agents as ``lockstep agent status`` shows them."""

    job: str
    tenant: str
    workers_now: int  # workers that reported the job's last step
    workers_most: int  # the most workers that reported any step kept
    last_step: int
    last_heard: str  # when the sink received the last step (ISO, UTC)
    #: the agents' counters summed over the job's workers (None: no --processor asked)
    dropped_records: int | None = None
    spooled_records: int | None = None
    refused_triggers: int | None = None
    failed_windows: int | None = None


def job_agents(rows: list[list], counters: dict[str, dict[str, int]] | None) -> list[JobAgents]:
    """The store's rows (job, tenant, workers_now, workers_most, last_step, last_heard) with the processors' counters
    (job -> counter -> value; a job the processors export no series of has zero of each)."""
    out = []
    for job, tenant, now, most, last, heard in rows:
        got = None if counters is None else counters.get(job, {})
        out.append(
            JobAgents(
                job,
                tenant,
                int(now or 0),
                int(most or 0),
                int(last),
                str(heard or ""),
                **({} if got is None else {name: int(got.get(name, 0)) for name in COUNTERS}),
            )
        )
    return out


def scrape_counters(urls: list[str]) -> dict[str, dict[str, int]]:
    """Every processor's agent counters, summed per job (each processor exports the jobs of its partitions)."""
    from ..metrics import PREFIX, scrape

    out: dict[str, dict[str, int]] = {}
    for url in urls:
        base = url.rstrip("/")
        try:
            samples = scrape(base + "/metrics" if not base.endswith("/metrics") else base)
        except (OSError, ValueError) as exc:
            raise ProcessorUnreachable(f"--processor {url}: no metrics there ({exc})") from None
        for (name, labels), value in samples.items():
            counter = name.removeprefix(f"{PREFIX}_agent_")
            job = dict(labels).get("job")
            if counter in COUNTERS and job is not None and name.startswith(f"{PREFIX}_agent_"):
                per_job = out.setdefault(job, {})
                per_job[counter] = per_job.get(counter, 0) + int(value)
    return out


STATUS_SQL = """
    SELECT job, tenant, arg_max(workers, step), max(workers), max(step), max(received_at)
    FROM step_series {where}
    GROUP BY job, tenant
    ORDER BY max(received_at) DESC, job
"""


def status(args) -> int:
    from ..app.output import plural, print_json, table
    from .findings import store_runner

    db = args.db or config.load(None).db
    run = store_runner(db, args.tenant)
    where, params = ("WHERE job = ?", [args.job]) if args.job else ("", None)
    _, rows = run(STATUS_SQL.format(where=where), params)
    jobs = job_agents(rows, scrape_counters(args.processor) if args.processor else None)
    if args.json:
        print_json([asdict(j) for j in jobs])
        return 0
    if not jobs:
        print(f"no job's agents have reported to {db}" + (f" (job {args.job})" if args.job else ""))
        return 0
    dash = "-"
    print(
        table(
            ["job", "tenant", "agents", "last step", "last heard", "dropped", "spooled", "refused", "failed windows"],
            [
                [
                    j.job,
                    j.tenant or dash,
                    f"{j.workers_now}" + (f" (of {j.workers_most})" if j.workers_most != j.workers_now else ""),
                    j.last_step,
                    j.last_heard,
                    *(dash if getattr(j, c) is None else getattr(j, c) for c in COUNTERS),
                ]
                for j in jobs
            ],
        )
    )
    if not args.processor:
        print(
            f"{plural(len(jobs), 'job')}; the agents' counters come from the processors: add --processor URL "
            "(each processor of the group)"
        )
    return 0
