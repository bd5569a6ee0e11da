"""Attaching the agent to a job that cannot be edited.

``lockstep agent run --job J -- torchrun ... train.py`` puts ``boot/`` (holding a
``sitecustomize.py``) first on ``PYTHONPATH`` and the agent's settings into
``LOCKSTEP_AGENT_*`` variables, then runs the command.  Python imports
``sitecustomize`` in every process of the job; it calls :func:`install_from_env`,
which, when ``LOCKSTEP_AGENT_JOB`` is set, waits (importing nothing) for
``torch.optim.optimizer`` to be imported and then registers a global optimizer
step post-hook.  The first optimizer step creates the agent (by then
torch.distributed is initialised, so the rank is known); every further step of
that same optimizer ends a training step.  Processes that never step an optimizer
(the torchrun launcher, data-loader workers) never create an agent.

This module must stay cheap to import: it runs in every Python process of the job.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
from collections.abc import Mapping

log = logging.getLogger("lockstep.agent")

ENABLE_VAR = "LOCKSTEP_AGENT_JOB"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
TARGET = "torch.optim.optimizer"

_lock = threading.Lock()
_state: dict[str, object] = {}


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._callback(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once ``name`` has been imported (a one-shot post-import hook)."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.callback)
                return spec
        return None


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` when ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


def _on_optimizer_module(module) -> None:
    module.register_optimizer_step_post_hook(_on_optimizer_step)


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    agent = _state.get("agent")
    if agent is not None:
        if _state.get("optimizer") is optimizer:
            agent.step()  # type: ignore[attr-defined]
        return
    if _state.get("failed"):
        return
    with _lock:
        if "agent" in _state or _state.get("failed"):
            return
        try:
            from .agent import Agent
            from .settings import load

            cfg = load()
            cfg.start_step += 1  # this optimizer step ended the job's first step, which the agent did not see begin
            _state["optimizer"] = optimizer
            _state["agent"] = Agent(cfg)
        except Exception as exc:
            _state["failed"] = True
            log.error("lockstep agent not attached: %s", exc)


def install_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Install the optimizer-step hook when the environment asks for an agent; True if installed."""
    env = os.environ if env is None else env
    if not env.get(ENABLE_VAR) or _state.get("installed"):
        return False
    _state["installed"] = True
    after_import(TARGET, _on_optimizer_module)
    return True


def current_agent():
    """The agent the hook created in this process, if any."""
    return _state.get("agent")
