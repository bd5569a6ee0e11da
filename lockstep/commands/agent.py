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

from .. import config

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
