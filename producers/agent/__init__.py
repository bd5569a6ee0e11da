"""The host agent: lives inside the training process (PyTorch hook, hardware sampler,
host-side summariser, spool) and publishes heartbeats and feature batches.

One line in the training loop::

    agent = lockstep.producers.agent.attach(job="llm-7b")   # then, every iteration:
    agent.step()

or none at all: ``lockstep agent run --job llm-7b -- torchrun ... train.py`` (see ``hook``).
Names are imported lazily so that the launcher hook, which imports this package in
every Python process of the job, costs nothing until an agent is made.
"""

from __future__ import annotations

__all__ = ["Agent", "AgentConfig", "attach"]


def __getattr__(name: str):
    if name in ("Agent", "attach"):
        from . import agent

        return getattr(agent, name)
    if name == "AgentConfig":
        from .settings import AgentConfig

        return AgentConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
