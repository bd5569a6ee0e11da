"""The README's example outputs are what the commands print today (``scripts/readme_examples.py``): the offline
examples exactly (slow: each runs ``lockstep`` in a subprocess), the demo's and the queries on its store as one
run's output (integration: one real ``lockstep demo``, its broker, processor and sink)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow  # each example runs `lockstep` in a subprocess


def check(*flags: str) -> str:
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_examples.py"), "--check", *flags],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert p.returncode == 0, (
        f"{p.stdout}\n{p.stderr}\nAfter a change to what the command prints: python scripts/readme_examples.py --write"
    )
    assert " examples, 0 stale" in p.stderr, p.stderr
    return p.stderr


def test_the_readme_examples_print_what_the_readme_shows():
    assert check("--offline").startswith("1 examples")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_readme_demo_and_the_queries_on_its_store_print_what_the_readme_shows():
    """One real ``lockstep demo``: its Kafka table (every topic, records within a factor of 1.5), its finding, and
    the SQL examples' figures on its store (the KiB per worker, the GPU-hours, the trigger)."""
    assert check().startswith("6 examples")


def rx_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import readme_examples as rx
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return rx


def test_one_runs_output_is_compared_loosely_but_a_stale_figure_still_fails():
    rx = rx_module()
    shown = "lockstep.heartbeats      632      363,173\nWindow w67: steps 67..74, 5.0 KiB\nDone in 21.9 s. open /tmp/lockstep-demo-qm6k0cay/x"
    now = "lockstep.heartbeats      640      362,981\nWindow w69: steps 69..76, 5.0 KiB\nDone in 44.6 s. open /tmp/lockstep-demo-as6rvxns/x"
    loose = ("one run's output",)
    assert rx.agree(shown, now, loose) and not rx.agree(shown, now)
    assert not rx.agree(shown.replace("632", "4,992"), now, loose)  # the figure the README showed before
    assert not rx.agree(shown.replace("5.0 KiB", "14.7 KiB"), now, loose)
    assert not rx.agree(shown, now.replace("heartbeats", "partials"), loose)  # another topic
    assert not rx.agree(shown, now + "\nlockstep.partials 80 34,303", loose)  # a topic the README does not list


def test_a_stale_example_is_found_and_rewritten(tmp_path, monkeypatch):
    """The check can fail: an output changed by hand is reported, and --write puts the command's back (on the
    README's offline examples: a README of those alone)."""
    rx = rx_module()
    readme = tmp_path / "README.md"
    full = (ROOT / "README.md").read_text().split("\n")
    offline = [ex for ex in rx.examples(full) if not rx.starts_processes(ex)]
    text = "\n".join(line for ex in offline for line in full[ex.out_start - 5 : ex.out_end + 1])
    first = rx.examples(text.split("\n"))[0]
    lines = text.split("\n")
    lines[first.out_start] = lines[first.out_start] + " (edited)"
    readme.write_text("\n".join(lines))
    monkeypatch.setattr(rx, "README", readme)
    assert rx.main(["--check"]) == 1
    assert rx.main(["--write"]) == 0
    assert readme.read_text() == text
    assert rx.main(["--check"]) == 0
