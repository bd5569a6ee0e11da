"""Where the data a command reads lies, in a checkout and in an installed wheel alike.

The suites (``suites/``) and the real-fault corpus (``tests/data/real/corpus/``, ``tests/data/real/holdout/``) are
packages of their own (``lockstep.suites``, ``lockstep.corpus``, ``lockstep.holdout``: pyproject's package-dir and package-data), so that a non-editable install
(the Docker image) carries them.  An editable install made before they were packages does not map them: then the
checkout's folder is used."""

from __future__ import annotations

import importlib
from pathlib import Path

#: the checkout this module lies in (meaningful only in a checkout or an editable install)
_CHECKOUT = Path(__file__).resolve().parents[2]


def package_folder(package: str, checkout_folder: str) -> Path:
    """The folder of ``package`` (a data package), or ``checkout_folder`` of the checkout where it is not importable."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        return _CHECKOUT / checkout_folder
    return Path(module.__file__ or _CHECKOUT / checkout_folder / "__init__.py").parent


SUITES = package_folder("lockstep.suites", "suites")
#: the real-fault corpus
CORPUS = package_folder("lockstep.corpus", "tests/data/real/corpus")
#: its held-out part (``evaluate --real --part holdout``)
CORPUS_HOLDOUT = package_folder("lockstep.holdout", "tests/data/real/holdout")
