"""The README's example outputs are what the commands print today (``scripts/readme_examples.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow  # each example runs `lockstep` in a subprocess


def test_the_readme_examples_print_what_the_readme_shows():
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_examples.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, (
        f"{p.stdout}\n{p.stderr}\nAfter a change to what the command prints: python scripts/readme_examples.py --write"
    )
    assert " examples, 0 stale" in p.stderr, p.stderr


def test_a_stale_example_is_found_and_rewritten(tmp_path, monkeypatch):
    """The check can fail: an output changed by hand is reported, and --write puts the command's back."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import readme_examples as rx
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    first = rx.examples(text.split("\n"))[0]
    lines = text.split("\n")
    lines[first.out_start] = lines[first.out_start] + " (edited)"
    readme.write_text("\n".join(lines))
    monkeypatch.setattr(rx, "README", readme)
    assert rx.main(["--check"]) == 1
    assert rx.main(["--write"]) == 0
    assert readme.read_text() == text
    assert rx.main(["--check"]) == 0
