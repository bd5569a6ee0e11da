"""Put on PYTHONPATH by ``lockstep agent run``: attaches the Lockstep agent when LOCKSTEP_AGENT_JOB is set.

Imports nothing heavy (see lockstep.producers.agent.hook), then runs any other
``sitecustomize`` further down ``sys.path`` so that the environment's own still applies.
"""

import os
import sys

try:
    from lockstep.producers.agent.hook import install_from_env

    install_from_env()
except Exception as exc:
    sys.stderr.write(f"lockstep agent: not attached ({type(exc).__name__}: {exc})\n")


def _chain() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        path = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_sitecustomize_after_lockstep", path)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return


_chain()
