"""The README's example outputs, run again: ``--check`` says where they differ, ``--write`` puts today's in.

    python scripts/readme_examples.py --check   # exit 1 and a diff when an example's output changed
    python scripts/readme_examples.py --write   # rewrite the outputs in README.md

An example is marked in README.md by an HTML comment line ``<!-- example: checked by scripts/readme_examples.py -->``
followed by a ``sh`` block with one ``lockstep ...`` command (globs expanded as a shell does, sorted; run
from the repository's root) and then a block with what it prints: its stderr lines first (the notes come
before the table), then its stdout.  Only commands that read files of the repository and print the same
thing every time belong here (``lockstep diagnose tests/data/...``); ``tests/test_readme_examples.py`` runs
``--check``, so an example that goes stale fails the tests, and after a change to the diagnosis
``--write`` makes the README say what the command now prints.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = "<!-- example: checked by scripts/readme_examples.py -->"
_FENCE = re.compile(r"^```")


@dataclass
class Example:
    command: str
    out_start: int  # first line of the output block's content (0-based, in README's lines)
    out_end: int  # its closing fence
    shown: str


def examples(lines: list[str]) -> list[Example]:
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fences = [j for j in range(i + 1, len(lines)) if _FENCE.match(lines[j])][:4]
        if len(fences) < 4 or fences[0] != i + 1 or fences[2] != fences[1] + 1:
            raise SystemExit(f"README.md:{i + 1}: the mark must be followed by a sh block and an output block")
        command = "\n".join(lines[fences[0] + 1 : fences[1]]).strip()
        if "\n" in command or not command.startswith("lockstep "):
            raise SystemExit(f"README.md:{i + 1}: an example is one `lockstep ...` command, got {command!r}")
        found.append(Example(command, fences[2] + 1, fences[3], "\n".join(lines[fences[2] + 1 : fences[3]])))
    return found


def run(command: str) -> str:
    """What the command prints (stderr, then stdout), globs expanded as a shell would, from the root."""
    argv: list[str] = []
    for word in shlex.split(command)[1:]:
        matched = sorted(glob.glob(word, root_dir=ROOT)) if any(c in word for c in "*?[") else []
        argv += matched or [word]
    env = {**os.environ, "COLUMNS": "200", "LOCKSTEP_TRACEBACK": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", *argv], cwd=ROOT, capture_output=True, text=True, env=env, check=False
    )
    if p.returncode:
        raise SystemExit(f"`{command}` failed ({p.returncode}):\n{p.stderr}")
    text = p.stderr + ("\n" if p.stderr and p.stdout else "") + p.stdout
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="exit 1 with a diff when an output differs")
    what.add_argument("--write", action="store_true", help="rewrite the outputs in README.md")
    a = ap.parse_args(argv)
    lines = README.read_text().split("\n")
    found = examples(lines)
    if not found:
        print(f"no example marked {MARK} in README.md", file=sys.stderr)
        return 1
    stale = 0
    for ex in reversed(found):  # from the end: rewriting one leaves the line numbers of those before it
        now = run(ex.command)
        if now == ex.shown:
            continue
        stale += 1
        if a.write:
            lines[ex.out_start : ex.out_end] = now.split("\n")
        else:
            diff = difflib.unified_diff(
                ex.shown.split("\n"), now.split("\n"), "README.md", ex.command, lineterm="", n=1
            )
            print(f"README.md:{ex.out_start + 1}: `{ex.command}` prints something else now:", *diff, sep="\n")
    if a.write and stale:
        README.write_text("\n".join(lines))
    print(
        f"{len(found)} examples, {stale} {'rewritten' if a.write else 'stale'}"
        + ("" if a.write or not stale else " (python scripts/readme_examples.py --write)"),
        file=sys.stderr,
    )
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
