"""Where the tests' own files are, for test modules at any depth of the tree (``from tests.paths import DATA``)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"


def _package_dir() -> dict[str, str]:
    """pyproject.toml's ``package-dir``: package -> the folder it installs from (the one folder map; the packaging,
    the layout and layer tests and ``.ci/typecheck.py`` all read it)."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _is_data(folder: str) -> bool:
    """A folder of data installed as a package (lockstep/app/data.py finds them): no module but its ``__init__.py``."""
    return all(p.name == "__init__.py" for p in (ROOT / folder).rglob("*.py"))


#: folder -> the package it installs as, for every entry of the map
INSTALLED: dict[str, str] = {folder: package for package, folder in _package_dir().items()}
#: the folders of code (``lockstep``, ``schemas``, ``producers``, ``streams``, ``sinks``) -> their packages
CODE: dict[str, str] = {folder: package for folder, package in INSTALLED.items() if not _is_data(folder)}
#: the folders of data installed as packages of their own -> their packages
DATA_PACKAGES: dict[str, str] = {folder: package for folder, package in INSTALLED.items() if _is_data(folder)}
