"""Where the tests' own files are, for test modules at any depth of the tree (``from tests.paths import DATA``)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
